"""The host's share of an eager training step: the CPU time it takes to issue a block's ops,
and how much of it the GPU's own time does not hide.

An eager PyTorch step is issued op by op by one Python thread: module calls, the dispatcher,
autograd's bookkeeping and a kernel launch per op. The GPU runs the kernels as they come, so
while the kernels are long the host runs ahead and costs nothing; when they are short (a small
model, a small micro-batch, a high TP degree) the GPU waits for the host. Selective
recomputation makes the host much slower: torch's selective-checkpoint mode passes every op
of a checkpointed region through a Python dispatch mode and its policy, in the forward and
again in the recompute (measured: 3.3x the host time of a step without recomputation).

The model: a block's host time is its traced aten nodes (`Op.fx_nodes`, views included) times
`HOST_NODE_S`, times a factor per phase and recompute policy (`PHASE_FACTORS`; only the
repeated layers are checkpointed, so the embedding and the head take the factors of no
recomputation). The host queues kernels ahead wherever they are longer than it takes to
issue them, so over a step's micro-batches the GPU waits max(0, H - G) in all (`host_exposed`),
H the host's time of a micro-batch of the block and G the GPU's, its traffic included (the
host issues the next ops while NCCL runs). That ignores where in the step each falls: a
host-bound forward beside a GPU-bound backward hides behind it only as far as the host can
run ahead, so where H and G are close it is a lower bound.

Where it comes from (data/gpu_step/*_session26.json, docs/op_latency.md):
- `HOST_NODE_S` and each policy's total: the `tiny-8` steps of `benchmarks/gpu_step.py` on an
  H200 machine's host (Intel Xeon under gVisor), whose kernels keep the GPU busy for 9% of
  the step: 141.1 ms for 4 micro-batches of 8 layers x 85 nodes + 21 of the embedding and
  head, 50.3 us a node; full recomputation 275.9 ms (1.96x the step; 1.98x for the layers,
  which alone recompute), selective 466.7 ms (3.31x; 3.38x for the layers).
  The H100 machine's host (Firecracker) took 38.8 us a node. Bare-metal hosts are faster; a
  user's own figure goes in `Engine.host_node_s` or `MESHPLAN_HOST_US`.
- How each total splits between forward and backward: `benchmarks/host_overhead.py` on this
  repository's development host (CPU tensors small enough that the host is nearly all there
  is): the forward's share is 0.44 without recomputation, 0.34 with full recomputation and
  0.44 under the selective mode, the same in float32 and bfloat16 (whose totals differ).

Under tensor parallelism every op of the layers is a DTensor op, dispatched in Python: 3.25x
the host time per op without sequence parallelism, 4.57x with it (`TP_FACTOR`; the
selective-checkpoint mode's own part is not multiplied, which predicts TP 2 + SP + selective
at 8.5x TP 1's time against 8.51x measured).

Not modelled: FSDP2's per-unit hooks, the optimizer's and the loss's host time. Compiled stacks
(`Engine.fused`: torch.compile, Megatron-LM's fused kernels) are priced without it (a compiled
region is issued as one call); CUDA graphs remove it altogether (`Engine.host_node_s = 0`).
A CPU device group has no separate host.
"""

from __future__ import annotations

import os

from meshplan.ir.parallel import Recompute

# Seconds of host time per traced aten node of one forward + backward without recomputation
# (module docstring: the tiny-8 steps on the H200 machine's host, 141.1 ms / 2,804 nodes).
HOST_NODE_S = 50e-6
# A bound on a given host time per op (microseconds): past it a number is a typo, not a host.
MAX_HOST_US = 1e6

# (forward, backward with its recompute) of a layer as multiples of its forward + backward
# host time without recomputation (module docstring): totals 1, 1.98 and 3.38 from the H200
# machine's tiny-8 steps (the step's 1.96x and 3.31x with its 21 nodes outside the layers
# taken out: (r x 701 - 21) / 680; the H100 machine's steps: 2.60x and 3.71x), split by the
# forward shares 0.44, 0.34 and 0.44 of benchmarks/host_overhead.py on the development host
# (session 26; on the H200 machine's host the same script gave 0.39, 0.35 and 0.46).
PHASE_FACTORS: dict[Recompute, tuple[float, float]] = {
    Recompute.NONE: (0.44, 0.56),
    Recompute.FULL: (0.67, 1.31),
    Recompute.SELECTIVE: (1.49, 1.89),
}

# The part of each phase that is the selective-checkpoint mode's own Python (its dispatch
# mode and policy), which DTensor does not slow down; the rest is ops issued (forward, the
# backward and the recomputed forward: 0.44 / 0.56 + 0.44 under the selective mode).
SAC_PART: dict[Recompute, tuple[float, float]] = {
    Recompute.NONE: (0.0, 0.0),
    Recompute.FULL: (0.0, 0.0),
    Recompute.SELECTIVE: (1.49 - 0.44, 1.89 - 1.00),
}

# DTensor's Python dispatch under tensor parallelism: the host's time per op at TP >= 2 over
# TP 1, without / with sequence parallelism. Measured on the H200 machine's host
# (benchmarks/host_overhead.py --device cuda --tp 2: whole runtime steps of tiny-8 as rank 0 of
# a fake 2-rank group, so no network; data/gpu_step/H200_host_overhead.json): 112.3 and
# 158.3 ms against 34.6 ms at TP 1. On this repository's host TP 4 took what TP 2 did.
TP_FACTOR = {False: 3.25, True: 4.57}


def default_node_s() -> float:
    """The host's seconds per node where the engine does not say (`Engine.host_node_s` None):
    `MESHPLAN_HOST_US` (microseconds; for every plan of a machine, e.g. a bare-metal host
    measured with benchmarks/host_overhead.py) or `HOST_NODE_S`."""
    raw = os.environ.get("MESHPLAN_HOST_US", "").strip()
    if not raw:
        return HOST_NODE_S
    try:
        us = float(raw)
    except ValueError:
        us = -1.0
    if not 0.0 <= us < MAX_HOST_US:
        raise ValueError(
            f"MESHPLAN_HOST_US is the host's microseconds per traced op, from 0 to under "
            f"{MAX_HOST_US:g}; got {raw!r}"
        )
    return us * 1e-6


def host_times(
    nodes: int,
    recompute: Recompute | None,
    node_s: float,
    tp: int = 1,
    sequence_parallel: bool = False,
    every_other_layer: bool = False,
) -> tuple[float, float]:
    """(forward, backward with recompute) host seconds of one micro-batch of a block with
    `nodes` traced aten nodes, at TP `tp` (DTensor's dispatch, `TP_FACTOR`, slows the ops
    issued, not the selective-checkpoint mode's own part, `SAC_PART`).
    `every_other_layer`: `Recompute.SELECTIVE` checkpoints every second layer whole
    (torchtitan's `selective_ac_option = "2"`), no dispatch mode: the mean of none and full."""
    rc = recompute or Recompute.NONE
    if every_other_layer and rc == Recompute.SELECTIVE:
        f0, b0 = host_times(nodes, Recompute.NONE, node_s, tp, sequence_parallel)
        f1, b1 = host_times(nodes, Recompute.FULL, node_s, tp, sequence_parallel)
        return (f0 + f1) / 2, (b0 + b1) / 2
    k = TP_FACTOR[sequence_parallel] if tp > 1 else 1.0
    (f, b), (sf, sb) = PHASE_FACTORS[rc], SAC_PART[rc]
    return nodes * node_s * (k * (f - sf) + sf), nodes * node_s * (k * (b - sb) + sb)


def host_exposed(g_fwd: float, g_bwd: float, h_fwd: float, h_bwd: float) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits for the host per micro-batch of a block:
    max(0, H - G) in all, H = h_fwd + h_bwd the host's time and G = g_fwd + g_bwd the GPU's
    (module docstring), counted in the forward as far as the forward alone is host-bound."""
    over = max(0.0, h_fwd + h_bwd - g_fwd - g_bwd)
    fwd = min(over, max(0.0, h_fwd - g_fwd))
    return fwd, over - fwd
