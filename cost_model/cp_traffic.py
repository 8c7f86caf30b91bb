"""Context-parallel traffic of a stage: each block's CP collectives per micro-batch, K/V
all-gathers or head-parallel all-to-alls (`Pricer`'s context-parallel part).

`ContextParallelTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `costs` and
`cluster`, and calls its `comm_choice`.
"""

from __future__ import annotations

import math

from meshplan.ir import DeviceGroup, StageConfig

from .collectives import Collective, group_path
from .graph_costs import BlockFacts


class ContextParallelTraffic:
    """The context-parallel methods of `pricer.Pricer` (see the module docstring)."""

    def cp_collectives(
        self, facts: BlockFacts, cfg: StageConfig, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """(phase, kind, bytes) of one block's context-parallel collectives for one micro-batch
        of `cfg`, over the cp ranks of a tp rank (heads are TP-sharded, so / tp):

        - "allgather" (and "ring", priced alike: its overlap with attention is not modelled,
          an assumption): K and V all-gathered in forward, their gradients reduce-scattered
          in backward; `kv_bytes` at the model's K/V heads.
        - "heads" (DeepSpeed-Ulysses, Jacobs et al. 2023): in forward one all-to-all
          each for q, k and v to head-sharded tensors and one for the output back; in
          backward the same four reversed. Each moves a rank's local tensor (its sequence
          share, / cp). K/V heads are repeated f = cp / gcd(kv heads per tp rank, cp) times
          when cp does not divide them (the runtime's fewest copies). So head-parallel moves
          (h/kv + f) / cp times what the all-gather does: less for full multi-head attention
          and large cp, more for a few K/V heads at small cp."""
        cp, tp = cfg.cp, cfg.tp
        if cp <= 1 or not facts.kv_bytes:
            return ()
        if cfg.cp_mode != "heads":
            size = facts.kv_bytes * scale / tp
            return (("fwd", Collective.ALL_GATHER, size), ("bwd", Collective.REDUCE_SCATTER, size))
        kv_heads = self.costs.graph.info.kv_heads // tp  # per tp rank; 0: not known
        repeat = cp // math.gcd(kv_heads, cp) if kv_heads else 1
        q = facts.q_bytes * scale / (tp * cp)
        kv = facts.kv_bytes * scale / (tp * cp) * repeat / 2  # K, and V alike
        sizes = (q, kv, kv, q)  # q, k, v in; the output (q's size) back
        a2a = Collective.ALL_TO_ALL
        return tuple((phase, a2a, s) for phase in ("fwd", "bwd") for s in sizes)

    def _cp_traffic(self, facts, g: DeviceGroup, cfg: StageConfig, scale) -> tuple[float, float]:
        """Context parallelism (`cp_collectives`) on the cp ranks' path: cp ranks strided by
        tp inside g. Not overlapped with attention (ring attention would hide part:
        an assumption, see the context-parallel rows in docs/fidelity.md)."""
        out = {"fwd": 0.0, "bwd": 0.0}
        collectives = self.cp_collectives(facts, cfg, scale)
        if not collectives:
            return 0.0, 0.0
        path = group_path(self.cluster, g, cfg.cp, max(1, g.domain_gpus // cfg.tp))
        for phase, kind, size in collectives:
            ch = self.comm_choice(kind, size, cfg.cp, path, g.gpu, "activations", "cp")
            out[phase] += ch.time_s
        return out["fwd"], out["bwd"]
