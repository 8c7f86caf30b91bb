"""Compression and quantization figures for docs/compression.md (issue 6, runtime side).

Sections (all on CPU unless a GPU is present; select with --only):

- ratios: the lossless codec (`meshplan.runtime.codec`) on the zoo's tiny Llama-style model
  after a few AdamW steps on random tokens: weights, gradients, Linear outputs, tensors saved
  for backward, Adam's two moments; per tensor kind and dtype, against the exponent-entropy
  ideal bits / (bits - exp_bits + H) (per tensor, summed) and zstd (level 3, if installed).
- throughput: codec compress / decompress GB/s (of the raw tensor) on a 32 MiB bf16 tensor.
- collectives: 2 gloo ranks, all-reduce of 8M bf16 values: compressed vs uncompressed path
  vs torch's all_reduce, wall time and bytes on the wire (loopback: a fast link, so the
  CPU codec is not expected to pay; this is the break-even input for the cost model).
- memory: bytes saved for backward by one forward of the tiny model (micro-batch 4, seq
  256), unquantized vs 8-bit vs the AGoQ plan (single stage, and stages 0 / 3 of 4).
- loss: AdamW training on a random bigram language (loss falls gradually), unquantized vs
  AGoQ activations vs AGoQ activations + 8-bit gradient all-reduce (two simulated ranks,
  `simulate_quantized_all_reduce`, bit-identical to the gloo collective): loss after
  --steps steps (mean of the last 20) and on held-out batches.

    python benchmarks/compression.py                  # everything, 300 training steps
    python benchmarks/compression.py --only ratios,throughput
    python benchmarks/compression.py --steps 30 --json /tmp/compression.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from meshplan import models
from meshplan.runtime import codec
from meshplan.runtime import quantize as Q

SECTIONS = ("ratios", "throughput", "collectives", "memory", "loss")

try:  # optional: only for the comparison column
    import zstandard
except ImportError:  # pragma: no cover - depends on the environment
    zstandard = None


# -- ratios ---------------------------------------------------------------------------------


def tensor_kinds(steps: int = 5) -> dict[str, list[torch.Tensor]]:
    """fp32 tensors of the tiny model after `steps` AdamW steps on random tokens."""
    torch.manual_seed(0)
    model, (tokens, targets) = models.get("tiny", device="cpu", dtype="float32", micro_batch=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        tokens = torch.randint(0, model.cfg.vocab, tokens.shape, generator=g)
        targets = torch.randint(0, model.cfg.vocab, tokens.shape, generator=g)
        opt.zero_grad()
        model(tokens, targets).backward()
        opt.step()
    acts: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: acts.append(o.detach()))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    saved: list[torch.Tensor] = []
    held = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point() and t.untyped_storage().data_ptr() not in held:
            saved.append(t.detach())
        return t

    opt.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, targets)
    loss.backward()
    for h in hooks:
        h.remove()
    params = list(model.parameters())
    return {
        "weights": [p.detach() for p in params],
        "gradients": [p.grad for p in params],
        "activations": acts,
        "saved for backward": saved,
        "adam m": [opt.state[p]["exp_avg"] for p in params],
        "adam v": [opt.state[p]["exp_avg_sq"] for p in params],
    }


def ratio_row(tensors: list[torch.Tensor], dtype: torch.dtype) -> dict[str, float | None]:
    raw = coded = zst = 0
    ideal_bytes = 0.0
    cctx = zstandard.ZstdCompressor(level=3) if zstandard else None
    for t in tensors:
        x = t.to(dtype).reshape(-1)
        if x.numel() == 0:
            continue
        c = codec.compress(x)
        assert torch.equal(codec.decompress(c).view(torch.uint8), x.view(torch.uint8))
        nbytes = x.numel() * x.element_size()
        raw += nbytes
        coded += c.nbytes
        ideal_bytes += nbytes / codec.entropy_ideal_ratio(x)
        if cctx is not None:
            zst += len(cctx.compress(x.view(torch.uint8).numpy().tobytes()))
    return {
        "codec": raw / coded,
        "ideal": raw / ideal_bytes,
        "zstd": raw / zst if cctx is not None else None,
        "mbytes": raw / 2**20,
    }


def bench_ratios() -> dict:
    kinds = tensor_kinds()
    out: dict = {}
    print("\n## Lossless codec ratio (raw / coded bytes; ideal = exponent-entropy bound)")
    print(f"{'kind':20s} {'dtype':9s} {'MiB':>7s} {'codec':>7s} {'ideal':>7s} {'zstd-3':>7s}")
    for kind, ts in kinds.items():
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            if dtype == torch.float16 and kind == "adam v":
                continue  # Adam's v underflows fp16: not a tensor anyone sends in fp16
            r = ratio_row(ts, dtype)
            out[f"{kind}/{str(dtype).split('.')[-1]}"] = r
            z = f"{r['zstd']:7.3f}" if r["zstd"] is not None else "    n/a"
            print(
                f"{kind:20s} {str(dtype).split('.')[-1]:9s} {r['mbytes']:7.1f} "
                f"{r['codec']:7.3f} {r['ideal']:7.3f} {z}"
            )
    if zstandard is None:
        print("(zstd not installed: pip install zstandard for the comparison column)")
    return out


# -- throughput -----------------------------------------------------------------------------


def bench_throughput(repeats: int = 5) -> dict:
    out: dict = {}
    print("\n## Codec throughput (GB/s of raw tensor; median of runs)")
    g = torch.Generator().manual_seed(0)
    base = torch.randn(16 * 2**20, generator=g) * 1e-3  # gradient-like scale
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    default_threads = torch.get_num_threads()
    for device in devices:
        threads = [1, default_threads] if device == "cpu" else [None]
        for nt in dict.fromkeys(threads):
            if nt is not None:
                torch.set_num_threads(nt)
            for dtype in (torch.bfloat16, torch.float32):
                x = base.to(device=device, dtype=dtype)
                tc, td = [], []
                for _ in range(repeats):
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    c = codec.compress(x)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    y = codec.decompress(c)
                    if device == "cuda":
                        torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    tc.append(t1 - t0)
                    td.append(t2 - t1)
                assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))
                nbytes = x.numel() * x.element_size()
                key = f"{device}/{nt or 'gpu'}t/{str(dtype).split('.')[-1]}"
                out[key] = {
                    "compress_GBps": nbytes / statistics.median(tc) / 1e9,
                    "decompress_GBps": nbytes / statistics.median(td) / 1e9,
                    "ratio": c.ratio,
                }
                print(
                    f"{key:22s} compress {out[key]['compress_GBps']:7.3f}  "
                    f"decompress {out[key]['decompress_GBps']:7.3f}  ratio {c.ratio:.3f}"
                )
    torch.set_num_threads(default_threads)
    return out


# -- collectives ----------------------------------------------------------------------------


def _collective_rank(numel: int, repeats: int) -> dict:
    import torch.distributed as dist
    from meshplan.runtime import compressed as cc

    me = dist.get_rank()
    x = (torch.randn(numel, generator=torch.Generator().manual_seed(me)) * 1e-3).bfloat16()
    res = {}
    for name in ("torch", "uncompressed", "compressed"):
        times, stats = [], cc.CommStats()
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            if name == "torch":
                y = x.clone()
                dist.all_reduce(y)
            else:
                cc.all_reduce(x, compress=name == "compressed", stats=stats)
            times.append(time.perf_counter() - t0)
        res[name] = {
            "seconds": statistics.median(times),
            "wire_MiB": stats.wire_bytes / repeats / 2**20,
            "payload_MiB": stats.payload_bytes / repeats / 2**20,
            "encode_s": stats.encode_s / repeats,
            "decode_s": stats.decode_s / repeats,
        }
    return res


def bench_collectives(numel: int = 8 * 2**20, repeats: int = 3) -> dict:
    from meshplan.runtime.launch import run_local

    print(f"\n## All-reduce of {numel / 2**20:.0f}M bf16 values, 2 gloo ranks on loopback")
    res = run_local(_collective_rank, 2, numel, repeats, timeout_s=600)[0]
    for name, r in res.items():
        wire = f"{r['wire_MiB']:7.1f} MiB on the wire" if name != "torch" else ""
        codec_s = (
            f"  (encode {r['encode_s']:.2f} s, decode {r['decode_s']:.2f} s)"
            if name == "compressed"
            else ""
        )
        print(f"{name:13s} {r['seconds']:7.3f} s  {wire}{codec_s}")
    return res


# -- memory ---------------------------------------------------------------------------------


def bench_memory() -> dict:
    torch.manual_seed(0)
    model, (tokens, targets) = models.get("tiny", device="cpu", dtype="float32", micro_batch=4)
    base = Q.measure_saved_bytes(model, None, tokens, targets)
    rows = {
        "8-bit everywhere": 8,
        "AGoQ, 1 stage": Q.agoq_plan(model),
        "AGoQ, stage 0 of 4": Q.agoq_plan(model, stage=0, num_stages=4),
        "AGoQ, stage 3 of 4": Q.agoq_plan(model, stage=3, num_stages=4),
    }
    print("\n## Activation memory: bytes saved for backward, tiny model, micro-batch 4 x 256")
    print(f"{'widths':22s} {'MiB':>7s} {'vs fp32':>8s} {'vs bf16':>8s}  by width")
    mib = 2**20
    print(f"{'none (fp32)':22s} {base.held_bytes / mib:7.1f}")
    print(f"{'none (bf16 equivalent)':22s} {base.bf16_bytes / mib:7.1f}")
    out = {"fp32_MiB": base.held_bytes / mib, "bf16_MiB": base.bf16_bytes / mib}
    for name, bits in rows.items():
        s = Q.measure_saved_bytes(model, bits, tokens, targets)
        red32 = 1 - s.held_bytes / base.held_bytes
        red16 = 1 - s.held_bytes / base.bf16_bytes
        widths = ", ".join(f"{b}-bit {n / mib:.1f} MiB" for b, n in sorted(s.by_bits.items()))
        print(f"{name:22s} {s.held_bytes / mib:7.1f} {red32:8.1%} {red16:8.1%}  {widths}")
        out[name] = {"MiB": s.held_bytes / mib, "vs_fp32": red32, "vs_bf16": red16}
    return out


# -- loss -----------------------------------------------------------------------------------


def bigram_language(vocab: int, successors: int = 8, seed: int = 1) -> torch.Tensor:
    """A random bigram transition matrix: each token has `successors` likely next tokens
    with Dirichlet(0.5) weights (entropy floor ~1.5 nats), so the loss falls over hundreds
    of steps instead of sitting at ln(vocab) as on uniform random tokens."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.distributions.Dirichlet(torch.full((successors,), 0.5)).sample((vocab,))
    succ = torch.randint(0, vocab, (vocab, successors), generator=g)
    return torch.zeros(vocab, vocab).scatter_add_(1, succ, weights)


def sample(g: torch.Generator, probs: torch.Tensor, batch: int, seq: int):
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, probs.shape[0], (batch,), generator=g)
    for i in range(seq):
        x[:, i + 1] = torch.multinomial(probs[x[:, i]], 1, generator=g).squeeze(1)
    return x[:, :-1], x[:, 1:]


def train(mode: str, steps: int, *, batch: int = 4, seq: int = 128) -> dict:
    """mode: "none", "agoq" (activations), "agoq+int8grad" (activations + 8-bit gradient
    all-reduce over two simulated data-parallel ranks, each with half the batch)."""
    torch.manual_seed(0)
    model, _ = models.get("tiny", device="cpu", dtype="float32", seq_len=seq)
    probs = bigram_language(model.cfg.vocab)
    g = torch.Generator().manual_seed(2)
    held_out = [sample(torch.Generator().manual_seed(100 + i), probs, batch, seq) for i in range(8)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bits = None if mode == "none" else Q.agoq_plan(model)
    params = list(model.parameters())
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens, targets = sample(g, probs, batch, seq)
        opt.zero_grad()
        if mode == "agoq+int8grad":
            per_rank, step_loss = [], 0.0
            for half in (slice(0, batch // 2), slice(batch // 2, batch)):
                with Q.ActivationQuantizer(model, bits):
                    loss = model(tokens[half], targets[half])
                grads = torch.autograd.grad(loss, params)
                per_rank.append(grads)
                step_loss += loss.item() / 2
            for i, p in enumerate(params):
                p.grad = Q.simulate_quantized_all_reduce([r[i] for r in per_rank], op="avg")
        else:
            with Q.ActivationQuantizer(model, bits):
                loss = model(tokens, targets)
            loss.backward()
            step_loss = loss.item()
        opt.step()
        losses.append(step_loss)
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        eval_loss = sum(model(t, y).item() for t, y in held_out) / len(held_out)
    tail = min(20, len(losses))
    return {
        "final_train_loss": sum(losses[-tail:]) / tail,
        "eval_loss": eval_loss,
        "first_loss": losses[0],
        "s_per_step": elapsed / steps,
        "curve": losses[:: max(1, steps // 10)],
    }


def bench_loss(steps: int) -> dict:
    print(f"\n## Training loss after {steps} AdamW steps (tiny model, batch 4 x 128, bigram data)")
    print(f"{'run':16s} {'train':>8s} {'eval':>8s} {'vs none':>8s} {'s/step':>7s}")
    out = {}
    for mode in ("none", "agoq", "agoq+int8grad"):
        r = train(mode, steps)
        out[mode] = r
        rel = r["eval_loss"] / out["none"]["eval_loss"] - 1
        print(
            f"{mode:16s} {r['final_train_loss']:8.4f} {r['eval_loss']:8.4f} {rel:+8.2%} "
            f"{r['s_per_step']:7.3f}"
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    ap.add_argument("--steps", type=int, default=300, help="training steps for 'loss'")
    ap.add_argument("--json", help="also write the figures to this JSON file")
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads (default 1: on a shared machine an OpenMP thread without a "
        "free core slows every op by 10-50x)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    chosen = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections {sorted(unknown)}; choose from {SECTIONS}")
    results: dict = {"torch": torch.__version__, "threads": torch.get_num_threads()}
    if "ratios" in chosen:
        results["ratios"] = bench_ratios()
    if "throughput" in chosen:
        results["throughput"] = bench_throughput()
    if "collectives" in chosen:
        results["collectives"] = bench_collectives()
    if "memory" in chosen:
        results["memory"] = bench_memory()
    if "loss" in chosen:
        results["loss"] = bench_loss(args.steps)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
