"""Compression and quantization figures for docs/compression.md (runtime side).

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

- passes: HBM bytes per raw byte and eager ops per call of the codec and the int8 quantizer
  (a TorchDispatchMode counts every op's inputs and outputs): the input of the GPU estimate
  in `cost_model/compression.py`.
- planner: predicted step time with and without compression (`meshplan.plan`, compress
  "auto" vs "off", same pinned configuration) of a ~2.8B-parameter synthetic decoder with its
  data-parallel ring across two sites joined by a 10/25/50/100 Gb/s WAN, and on a 100GbE
  cluster, with the codec at the GPU estimate and at the measured CPU speed; and the
  per-collective decisions on an NVLink + IB cluster (left raw where coding does not pay).

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

SECTIONS = ("ratios", "throughput", "passes", "planner", "collectives", "memory", "loss")

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


# -- passes ---------------------------------------------------------------------------------

_VIEWS = {"view", "_unsafe_view", "slice", "select", "as_strided", "t", "transpose"}
_VIEWS |= {"unsqueeze", "squeeze", "expand", "alias", "detach", "split", "_reshape_alias"}


def _count(fn) -> tuple[int, int, int]:
    """(HBM bytes touched, kernels, host syncs) of `fn()`, counted per dispatched aten op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        bytes = ops = syncs = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket).split(".")[-1]
            if name in _VIEWS:
                return out
            self.ops += 1
            self.syncs += name in ("_local_scalar_dense", "nonzero", "item")
            for x in [*args, *(kwargs or {}).values(), out]:
                for y in x if isinstance(x, (list, tuple)) else [x]:
                    if isinstance(y, torch.Tensor):
                        self.bytes += y.numel() * y.element_size()
            return out

    with Count() as c:
        fn()
    return c.bytes, c.ops, c.syncs


def bench_passes(numel: int = 1 << 22) -> dict:
    print("\n## HBM bytes per raw byte, eager ops and syncs per call (dispatch count)")
    out = {}
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x = (torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3).to(dtype)
        raw = x.numel() * x.element_size()
        c = codec.compress(x)
        eb, eo, es = _count(lambda x=x: codec.compress(x))
        db, do, ds = _count(lambda c=c: codec.decompress(c))
        key = str(dtype).split(".")[-1]
        out[key] = {"compress": [eb / raw, eo, es], "decompress": [db / raw, do, ds]}
        print(
            f"{key:9s} compress {eb / raw:5.1f} B/B {eo:4d} ops {es} syncs | "
            f"decompress {db / raw:5.1f} B/B {do:4d} ops {ds} syncs"
        )
    x = torch.randn(numel).bfloat16()
    q = Q.quantize(x, 8)
    qb, qo, _ = _count(lambda: Q.quantize(x, 8))
    db, do, _ = _count(lambda: Q.dequantize(q))
    out["int8"] = {"quantize": [qb / (2 * numel), qo], "dequantize": [db / (2 * numel), do]}
    print(
        f"int8 (bf16 in) quantize {qb / (2 * numel):5.1f} B/B {qo} ops | dequantize "
        f"{db / (2 * numel):5.1f} B/B {do} ops"
    )
    return out


# -- planner --------------------------------------------------------------------------------


def two_sites(wan_gbps: float, gpus: int = 32):
    """Two sites of DGX H100 nodes (NVLink4, 8 x NDR per node) joined by one WAN link of
    `wan_gbps` Gb/s (efficiency and latency of meshplan's WAN tier)."""
    import dataclasses

    from meshplan import Cluster
    from meshplan.ir import LinkKind, LinkTier
    from meshplan.ir.hardware import DEFAULT_EFFICIENCY, DEFAULT_LATENCY

    base = Cluster.preset("two-sites", gpus=gpus)
    wan = LinkTier(
        f"wan-{wan_gbps:g}g",
        LinkKind.WAN,
        wan_gbps * 1e9 / 8,
        DEFAULT_LATENCY[LinkKind.WAN],
        DEFAULT_EFFICIENCY[LinkKind.WAN],
    )
    links = tuple(t for t in base.links if t.kind != LinkKind.WAN) + (wan,)
    gl = tuple(dataclasses.replace(g, link=wan.name) for g in base.group_links)
    return dataclasses.replace(base, name=f"two-sites-{wan_gbps:g}g", links=links, group_links=gl)


def bench_planner() -> dict:
    import sys
    from pathlib import Path

    import meshplan
    from meshplan import Cluster, Parallel
    from meshplan.cost_model.compression import CPU_CODEC

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import transformer_graph

    g = transformer_graph(16, 4096, 32, 8, 14336, 32000, 4096, 1, name="decoder-2.8b")
    cases = [(f"two sites, {w} Gb/s WAN", two_sites(w)) for w in (10, 25, 50, 100)]
    cases.append(("100GbE cluster (RTX 4090, PCIe)", Cluster.preset("rtx4090-ethernet", gpus=32)))
    cases.append(("NVLink + IB (DGX H100)", Cluster.preset("dgx-h100", gpus=32)))
    out = {}
    print(
        "\n## Predicted step time with compression (decoder-2.8b, dp=32, ZeRO-2, full "
        "recompute, global batch 256)"
    )
    print(f"{'cluster':34s} {'codec':22s} {'off s':>8s} {'auto s':>8s} {'gain':>6s}  coded")
    for name, c in cases:
        mem = "RTX" in name
        pin = Parallel(
            dp=32, tp=1, pp=1, cp=1, micro_batch=1, zero=3 if mem else 2, recompute="full"
        )
        off = meshplan.plan(g, cluster=c, parallel=pin, global_batch=256, compress="off")
        for label, codec_speed in (("GPU estimate", None), ("CPU measured (1 core)", CPU_CODEC)):
            on = meshplan.plan(
                g, cluster=c, parallel=pin, global_batch=256, compress="auto", codec=codec_speed
            )
            coded = sorted(
                {
                    f"{d.group.split(' ')[0]} {d.collective} {d.method}"
                    for d in on.compression.decisions
                }
            )
            gain = off.predicted.step_time_s / on.predicted.step_time_s
            print(
                f"{name:34s} {label:22s} {off.predicted.step_time_s:8.3f} "
                f"{on.predicted.step_time_s:8.3f} {gain:6.3f}  {'; '.join(coded)}"
            )
            out[f"{name} / {label}"] = {
                "off_s": off.predicted.step_time_s,
                "auto_s": on.predicted.step_time_s,
                "gain": gain,
                "decisions": [
                    [d.group, d.collective, d.method, d.raw_s, d.lossless_s, d.chunks]
                    for d in on.compression.decisions
                ],
            }
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
    if "passes" in chosen:
        results["passes"] = bench_passes()
    if "planner" in chosen:
        results["planner"] = bench_planner()
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
