"""The host's time per traced op of an eager training step, by phase and recompute policy.

    python benchmarks/host_overhead.py                 # this host, CPU tensors, ~20 s
    python benchmarks/host_overhead.py --device cuda   # on a GPU machine: the GPU's host

A Llama-style decoder small enough that its kernels take next to nothing (hidden 64, 8 tokens
on the CPU; the `tiny-8` shape of gpu_step.py on a GPU) runs forward and backward through the
runtime's own checkpoint wrappers (`runtime.recompute`) with no recomputation, full
recomputation and selective recomputation (torch's selective-checkpoint dispatch mode with the
keep-linear policy). What is measured is then the host: Python, the dispatcher, autograd and
the kernel launches. It prints the median seconds of forward and of backward per traced node
(`Op.fx_nodes`: the aten calls of the traced graph, views included, 85 per layer of this
model), and each phase as a multiple of the forward + backward time without recomputation.

What `cost_model.host.PHASE_FACTORS` takes from it is the forward's share of each policy's
host time (0.44 / 0.34 / 0.44 on this repository's 2-vCPU development host, session 26, in
float32 and in bfloat16 alike); each policy's total against no recomputation, and the level
per node (`host.HOST_NODE_S`), come from a GPU machine's host (gpu_step.py's `tiny-8` steps,
data/gpu_step/H200_session26.json), because a GPU host also launches a kernel per op and the
totals here depend on how much of the time is the CPU's own arithmetic (float32: 2.5x and
5.0x; bfloat16: 2.0x and 3.4x; the GPU hosts: 2.0-2.6x and 3.3-3.7x).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

CPU_SHAPE = dict(layers=8, hidden=64, heads=4, kv_heads=4, ffn=128, vocab=256, seq_len=8)
GPU_SHAPE = dict(layers=8, hidden=256, heads=4, kv_heads=4, ffn=1024, vocab=4096, seq_len=128)
MODES = ("none", "full", "selective")
FOREACH = True  # the CUDA default of torch.optim.SGD


def nodes_per_layer(shape: dict, dtype: str) -> int:
    """Traced aten nodes of one layer (what the cost model counts: `BlockFacts.host_nodes`)."""
    import meshplan
    from meshplan.api import as_graph
    from meshplan.cost_model.graph_costs import model_costs

    model, inputs = meshplan.models.transformer(dtype=dtype, device="meta", **shape)
    return model_costs(as_graph(model, inputs)).facts["layer"].host_nodes


def measure(
    mode: str, shape: dict, device: torch.device, reps: int, dtype: str
) -> tuple[float, float]:
    """Median (forward, backward) seconds of one micro-batch through every layer."""
    import meshplan
    from meshplan.runtime.recompute import _wrap

    torch.manual_seed(0)
    model, _ = meshplan.models.transformer(dtype=dtype, device=str(device), **shape)
    if mode != "none":
        for i in range(len(model.layers)):
            _wrap(model.layers, str(i), selective=mode == "selective")
    x = torch.randint(0, shape["vocab"], (1, shape["seq_len"]), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for _ in range(reps + 2):  # two warm-up passes
        sync()
        t0 = time.perf_counter()
        loss = model(x).float().sum()
        t1 = time.perf_counter()
        loss.backward()
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd[2:]), statistics.median(bwd[2:])


def tp_steps(shape: dict, device: torch.device, dtype: str, tp: int, reps: int) -> dict:
    """Median seconds of whole runtime steps (`meshplan.runtime.apply`, one micro-batch,
    SGD) without TP and at TP `tp` (with and without sequence parallelism, without and with
    selective recompute), this process acting as rank 0 of a fake process group whose
    collectives do nothing: the host's time with DTensor's dispatch, no network in it."""
    import meshplan
    import meshplan.runtime as rt
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def loss_fn(logits, targets):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    cluster = "cpu" if device.type == "cpu" else "H100"
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out = {}
    for world, configs in ((1, ((1, False, "none"), (1, False, "selective"))),
                           (tp, ((tp, False, "none"), (tp, True, "none"),
                                 (tp, True, "selective")))):  # fmt: skip
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        for t, sp, mode in configs:
            model, inputs = meshplan.models.transformer(dtype=dtype, **shape)
            par = meshplan.Parallel(dp=1, tp=t, pp=1, micro_batch=1, global_batch=1,
                                    recompute=meshplan.Recompute(mode),
                                    sequence_parallel=sp)  # fmt: skip
            plan = meshplan.estimate_plan(model, inputs, meshplan.Cluster.preset(
                cluster, gpus=world), par)  # fmt: skip
            torch.manual_seed(0)
            real, _ = meshplan.models.transformer(dtype=dtype, device=str(device), **shape)
            opt = lambda ps: torch.optim.SGD(ps, lr=1e-4, foreach=FOREACH)  # noqa: E731
            runner = rt.apply(real, plan, loss_fn, opt)
            x = torch.randint(0, shape["vocab"], (1, shape["seq_len"] + 1))
            times = []
            for _ in range(reps + 3):
                sync()
                t0 = time.perf_counter()
                runner.step(x[:, :-1], x[:, 1:])
                sync()
                times.append(time.perf_counter() - t0)
            out[f"tp{t} sp{int(sp)} {mode}"] = statistics.median(times[3:])
            del runner, real
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument(
        "--dtype",
        default="",
        help="float32 or bfloat16 (default: float32 on the CPU, bfloat16 on a GPU)",
    )
    ap.add_argument(
        "--tp", type=int, default=0, help="also time runtime steps at this TP degree (DTensor)"
    )
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("host_overhead: no CUDA device", file=sys.stderr)
        return 2
    if device.type == "cpu":
        torch.set_num_threads(1)  # the host's single issuing thread
    shape = GPU_SHAPE if device.type == "cuda" else CPU_SHAPE
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    nodes = nodes_per_layer(shape, dtype) * shape["layers"]
    got = {mode: measure(mode, shape, device, args.reps, dtype) for mode in MODES}
    base = sum(got["none"])
    out = {"device": str(device), "nodes": nodes, "modes": {}}
    print(f"{nodes} traced nodes in {shape['layers']} layers; per node, and x (fwd + bwd, none):")
    for mode, (f, b) in got.items():
        out["modes"][mode] = dict(fwd_s=f, bwd_s=b, fwd_factor=f / base, bwd_factor=b / base)
        print(f"  {mode:<10} forward {f / nodes * 1e6:6.2f} us ({f / base:.2f})  "
              f"backward {b / nodes * 1e6:6.2f} us ({b / base:.2f})  "
              f"forward's share {f / (f + b):.2f}")  # fmt: skip
    if args.tp > 1:
        steps = tp_steps(shape, device, dtype, args.tp, args.reps)
        base = steps["tp1 sp0 none"]
        out["tp_steps_s"] = steps
        print(
            f"runtime steps, this rank of a fake {args.tp}-rank group (x TP 1 without recompute):"
        )
        for name, sec in steps.items():
            print(f"  {name:<22} {sec * 1e3:8.2f} ms ({sec / base:.2f})")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
