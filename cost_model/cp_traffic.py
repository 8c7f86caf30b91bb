"""Context-parallel traffic of a stage: each block's CP collectives per micro-batch, K/V
all-gathers or head-parallel all-to-alls (`Pricer`'s context-parallel part).

`ContextParallelTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `costs` and
`cluster`, and calls its `comm_choice`.
"""

from __future__ import annotations

import math

from meshplan.ir import DeviceGroup, GpuSpec, StageConfig
from meshplan.ir.rules import kv_expansion

from .collectives import Collective, Path, group_path
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
          and large cp, more for a few K/V heads at small cp.

        - "usp" (USP / LoongTrain's two-level split; u = `cfg.cp_head_degree` ranks per head
          group, r = cp / u head groups): the four all-to-alls of "heads" over u ranks (of
          the same local tensors; K/V heads repeated u / gcd(kv heads per tp rank, u)
          times), then K/V of the rank's h/u heads all-gathered over the r ranks holding
          the same heads in forward and reduce-scattered in backward: 1/u of "allgather"'s
          size (times the repetition). The all-to-alls run on the head group's path, the
          all-gather on the K/V group's (`_cp_traffic`).

        Asymmetric shares (`cfg.cp_shares`, `cp_head_shares`; HexiSeq): the all-gather is
        padded to the largest token share, as the runtime runs it (cp x the largest share
        over the sequence times the K/V bytes). Under "heads" the all-to-alls have uneven
        splits (`_uneven_a2a`)."""
        cp, tp = cfg.cp, cfg.tp
        if cp <= 1 or not facts.kv_bytes:
            return ()
        if cfg.cp_mode == "usp":
            return self._usp_collectives(facts, cfg, scale)
        if cfg.cp_mode != "heads":
            size = facts.kv_bytes * scale / tp
            if cfg.cp_shares:
                size *= cp * max(cfg.cp_shares) / sum(cfg.cp_shares)
            return (("fwd", Collective.ALL_GATHER, size), ("bwd", Collective.REDUCE_SCATTER, size))
        if cfg.cp_shares or cfg.cp_head_shares:
            return self._uneven_a2a(facts, cfg, scale)
        kv_heads = self.costs.graph.info.kv_heads // tp  # per tp rank; 0: not known
        repeat = cp // math.gcd(kv_heads, cp) if kv_heads else 1
        q = facts.q_bytes * scale / (tp * cp)
        kv = facts.kv_bytes * scale / (tp * cp) * repeat / 2  # K, and V alike
        sizes = (q, kv, kv, q)  # q, k, v in; the output (q's size) back
        a2a = Collective.ALL_TO_ALL
        return tuple((phase, a2a, s) for phase in ("fwd", "bwd") for s in sizes)

    def _usp_collectives(
        self, facts: BlockFacts, cfg: StageConfig, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """ "usp"'s collectives (see `cp_collectives`): all-to-alls over the head group, the
        K/V all-gather / reduce-scatter over the K/V group."""
        cp, tp, u = cfg.cp, cfg.tp, cfg.cp_head_degree
        kv_heads = self.costs.graph.info.kv_heads // tp  # per tp rank; 0: not known
        repeat = u // math.gcd(kv_heads, u) if kv_heads else 1
        q = facts.q_bytes * scale / (tp * cp)
        kv = facts.kv_bytes * scale / (tp * cp) * repeat / 2  # K, and V alike (local)
        gathered = facts.kv_bytes * scale / tp * repeat / u  # K and V of h/u heads, all S
        a2a = Collective.ALL_TO_ALL
        out: list[tuple[str, Collective, float]] = []
        for phase, kv_kind in (("fwd", Collective.ALL_GATHER), ("bwd", Collective.REDUCE_SCATTER)):
            out += [(phase, a2a, s) for s in (q, kv, kv, q)]
            out.append((phase, kv_kind, gathered))
        return tuple(out)

    def _uneven_a2a(
        self, facts: BlockFacts, cfg: StageConfig, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """Head-parallel all-to-alls of uneven splits: rank r holds s_r of S tokens and
        attends h_r of H heads; of a tensor of T bytes over the whole sequence and every
        head it sends s_r (H - h_r) / (S H) T (its tokens of the others' heads) and receives
        h_r (S - s_r) / (S H) T. Priced as the equal all-to-all whose rank moves as much as
        the busiest rank sends or receives: a buffer of that x cp / (cp - 1) (what
        `collectives.bus_factor` takes back off). Equal shares give the equal sizes. K/V at
        the runtime's copies of each head (`ir.rules.kv_expansion`, shares in proportion)."""
        cp, tp = cfg.cp, cfg.tp
        info = self.costs.graph.info
        heads = info.heads // tp if info.heads else 0
        tokens = cfg.cp_shares or (1,) * cp
        split = cfg.cp_head_shares or ((heads // cp,) * cp if heads else (1,) * cp)
        s_all, h_all = sum(tokens), sum(split)

        def buffer(total: float) -> float:
            busiest = max(max(s * (h_all - h), h * (s_all - s)) for s, h in zip(tokens, split)) / (
                s_all * h_all
            )
            return total * busiest * cp / (cp - 1)

        kv_heads = info.kv_heads // tp if info.kv_heads else 0
        copies = kv_expansion(heads, kv_heads, split) if heads and kv_heads else 1
        q = buffer(facts.q_bytes * scale / tp)
        kv = buffer(facts.kv_bytes * scale / tp * copies / 2)  # K, and V alike
        sizes = (q, kv, kv, q)  # q, k, v in; the output (q's size) back
        a2a = Collective.ALL_TO_ALL
        return tuple((phase, a2a, s) for phase in ("fwd", "bwd") for s in sizes)

    def _span_path(self, cfg: StageConfig) -> Path:
        """The path of a cp group spanning device groups (`cfg.cp_span`): its ring (or
        all-to-all) runs at the slowest of each group's own part (c_g ranks strided by tp in
        the group, `group_path`) and every pair of groups' crossing (`cross_path`, at
        `cfg.cp_streams` cp groups crossing a shared link at once), with the largest of their
        latencies. Every rank's traffic crosses, so one bottleneck bandwidth is the
        ring's."""
        tp, parts = cfg.tp, []
        span = cfg.cp_span or ()
        for i, (a, ca) in enumerate(span):
            ga = self.groups[a]
            per_domain_a = max(1, min(ca, ga.domain_gpus // tp))
            if ca > 1:
                parts.append(group_path(self.cluster, ga, ca, per_domain_a))
            for b, cb in span[i + 1 :]:
                gb = self.groups[b]
                per_domain_b = max(1, min(cb, gb.domain_gpus // tp))
                cross = self.cross_path(a, b, per_domain_a, per_domain_b)
                parts.append(cross.path(cfg.cp_streams))
        slow = min(parts, key=lambda p: p.bandwidth)
        return Path(slow.bandwidth, max(p.latency for p in parts), slow.curve)

    def _slowest(self, span: tuple[tuple[str, int], ...]) -> GpuSpec:
        """The GPU whose codec speed bounds a coded collective over the span's ranks."""
        return min((self.groups[g].gpu for g, _ in span), key=lambda gpu: gpu.hbm_bandwidth)

    def _cp_traffic(self, facts, g: DeviceGroup, cfg: StageConfig, scale) -> tuple[float, float]:
        """Context parallelism (`cp_collectives`) on the cp ranks' path: cp ranks strided by
        tp inside g. Not overlapped with attention (ring attention would hide part:
        an assumption, see the context-parallel rows in docs/fidelity.md)."""
        out = {"fwd": 0.0, "bwd": 0.0}
        collectives = self.cp_collectives(facts, cfg, scale)
        if not collectives:
            return 0.0, 0.0
        if cfg.cp_span:
            path, gpu = self._span_path(cfg), self._slowest(cfg.cp_span)
        else:
            path = group_path(self.cluster, g, cfg.cp, max(1, g.domain_gpus // cfg.tp))
            gpu = g.gpu
        ranks = {kind: cfg.cp for _, kind, _ in collectives}
        paths = {kind: path for kind in ranks}
        if cfg.cp_mode == "usp":
            # Head groups: u consecutive cp ranks (strided by tp); K/V groups: r ranks
            # strided by tp x u (`runtime.mesh.usp_groups`).
            u = cfg.cp_head_degree
            r = cfg.cp // u
            ranks = {Collective.ALL_TO_ALL: u, Collective.ALL_GATHER: r}
            ranks[Collective.REDUCE_SCATTER] = r
            paths = {
                Collective.ALL_TO_ALL: group_path(
                    self.cluster, g, u, max(1, g.domain_gpus // cfg.tp)
                ),
                Collective.ALL_GATHER: group_path(
                    self.cluster, g, r, max(1, g.domain_gpus // (cfg.tp * u))
                ),
            }
            paths[Collective.REDUCE_SCATTER] = paths[Collective.ALL_GATHER]
        for phase, kind, size in collectives:
            ch = self.comm_choice(kind, size, ranks[kind], paths[kind], gpu, "activations", "cp")
            out[phase] += ch.time_s
        return out["fwd"], out["bwd"]
