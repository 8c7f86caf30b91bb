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
`HOST_NODE_S`, times a factor per phase and recompute policy (`PHASE_FACTORS`). One
micro-batch of a block runs as a chain: the host issues the forward, then the backward (with
its recompute); the GPU runs each phase's kernels once issued. Its time is then
max(G_f + G_b, H_f + G_b, H_f + H_b) (`host_exposed`), G the GPU's time of a phase and H the
host's; the host can run further ahead across blocks and micro-batches than this, so it is an
upper bound where both are close.

Where it comes from (data/gpu_step/*_session26.json, docs/op_latency.md):
- `HOST_NODE_S` and each policy's total: the `tiny-8` steps of `benchmarks/gpu_step.py` on an
  H200 machine's host (Intel Xeon under gVisor), whose kernels keep the GPU busy for 9% of
  the step: 141.1 ms for 4 micro-batches of 8 layers x 85 nodes + 21 of the embedding and
  head, 50.3 us a node; full recomputation 275.9 ms (1.96x), selective 466.7 ms (3.31x).
  The H100 machine's host (Firecracker) took 38.8 us a node. Bare-metal hosts are faster; a
  user's own figure goes in `Engine.host_node_s` or `MESHPLAN_HOST_US`.
- How each total splits between forward and backward: `benchmarks/host_overhead.py` on this
  repository's development host (CPU tensors small enough that the host is nearly all there
  is): the forward's share is 0.44 without recomputation, 0.34 with full recomputation and
  0.44 under the selective mode, the same in float32 and bfloat16 (whose totals differ).

Not modelled: DTensor's Python dispatch under tensor parallelism (more host time per op),
FSDP2's per-unit hooks, the optimizer's and the loss's host time. Compiled stacks
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

# (forward, backward with its recompute) as multiples of the forward + backward host time
# without recomputation (module docstring): totals 1, 1.96 and 3.31 from the H200 machine's
# tiny-8 steps (the H100 machine's: 2.60 and 3.71), split by the forward shares 0.44, 0.34
# and 0.44 of benchmarks/host_overhead.py on the development host (session 26).
PHASE_FACTORS: dict[Recompute, tuple[float, float]] = {
    Recompute.NONE: (0.44, 0.56),
    Recompute.FULL: (0.66, 1.30),
    Recompute.SELECTIVE: (1.46, 1.85),
}


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
    if not 0.0 <= us < 1e6:
        raise ValueError(
            f"MESHPLAN_HOST_US is the host's microseconds per traced op, at least 0; got {raw!r}"
        )
    return us * 1e-6


def host_times(nodes: int, recompute: Recompute | None, node_s: float) -> tuple[float, float]:
    """(forward, backward with recompute) host seconds of one micro-batch of a block with
    `nodes` traced aten nodes."""
    f, b = PHASE_FACTORS[recompute or Recompute.NONE]
    return nodes * node_s * f, nodes * node_s * b


def host_exposed(g_fwd: float, g_bwd: float, h_fwd: float, h_bwd: float) -> tuple[float, float]:
    """(forward, backward) seconds the GPU waits for the host in one micro-batch of a block:
    the chain host-issues-forward, host-issues-backward, each phase's kernels run once issued
    (module docstring), less the GPU's own time G_f + G_b."""
    over = max(0.0, h_fwd + h_bwd - g_fwd - g_bwd)
    fwd = min(over, max(0.0, h_fwd - g_fwd))
    return fwd, over - fwd
