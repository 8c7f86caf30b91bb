"""Data-parallel traffic of a stage: gradient reductions and ZeRO's weight gathers, inside one
device group or across two (`Pricer`'s data-parallel half).

`DataParallelTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `costs`, `groups`,
`cluster`, `precision`, `engine` and `comm`, and caches cross-group paths in `_cross`. The
step formula that uses these figures (overlap windows, exposure) is in simulate.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from meshplan.ir import (
    DeviceGroup,
    GpuSpec,
    Parallel,
    StageConfig,
)

from .collectives import (
    Collective,
    CrossPath,
    Path,
    bus_factor,
    cross_group_path,
    group_collective_time,
)
from .compression import (
    CommChoice,
    choose,
    coded_cross,
    tensor_of,
)
from .graph_costs import Composition


@dataclass(frozen=True, slots=True)
class DpTraffic:
    """The data-parallel collectives of one stage per occurrence: (kind, per-rank bytes,
    ranks), collective i run `repeats[i]` times (ZeRO-3: once per FSDP unit of that block;
    every collective once when `repeats` is empty)."""

    collectives: tuple[tuple[Collective, float, int], ...]
    repeats: tuple[int, ...] = ()

    @property
    def times(self) -> tuple[int, ...]:
        """How often each collective runs per occurrence."""
        return self.repeats or (1,) * len(self.collectives)

    @property
    def volume(self) -> float:
        """sum r * S * f(n): bytes one rank moves per occurrence (the alpha-free part)."""
        return sum(
            r * s * bus_factor(k, n)
            for (k, s, n), r in zip(self.collectives, self.times, strict=True)
            if n > 1
        )

    @property
    def count(self) -> int:
        """Collectives that move data (each pays one latency)."""
        return sum(
            r for (_, s, n), r in zip(self.collectives, self.times, strict=True) if n > 1 and s > 0
        )


@dataclass(frozen=True, slots=True)
class CrossTraffic:
    """Data-parallel traffic of a stage whose replicas span two groups: with k stages crossing
    between groups at once, time(k) = max(unshared, latency + per_stage * k)."""

    unshared: float
    latency: float
    per_stage: float | None  # None when no shared GroupLink bounds it
    # The same traffic coded (lossless / int8 gradients, `compression.coded_cross`), in the
    # same form; `time` takes the faster of the two.
    coded: CrossTraffic | None = None

    def raw_time(self, crossing_stages: int) -> float:
        """Seconds uncoded when `crossing_stages` stages' DP rings cross at once."""
        if self.per_stage is None:
            return self.unshared
        return max(self.unshared, self.latency + self.per_stage * max(1, crossing_stages))

    def time(self, crossing_stages: int) -> float:
        """Seconds when `crossing_stages` stages' DP rings cross between groups at once."""
        raw = self.raw_time(crossing_stages)
        return raw if self.coded is None else min(raw, self.coded.raw_time(crossing_stages))


def _dp_ranks(cfg: StageConfig, dp: int) -> tuple[int, int]:
    """(ranks that reduce a dense parameter's gradient: dp * cp, ranks that hold the same
    experts: dp * cp / ep), as `DataParallelTraffic.dp_traffic` states."""
    dcp = dp * cfg.cp
    return dcp, dcp // cfg.ep if dcp >= cfg.ep else 1


class DataParallelTraffic:
    """The data-parallel methods of `pricer.Pricer` (see the module docstring)."""

    @property
    def reduce_bytes(self) -> int:
        """Bytes per gradient element a reduction moves: 4 under `Engine.reduce_fp32`, else
        the training precision's (`memory.Precision.grad_bytes`)."""
        return 4 if self.engine.reduce_fp32 else self.precision.grad_bytes

    def _dp_params(self, comp: Composition, cfg: StageConfig) -> tuple[float, float]:
        """(dense, expert) parameters one rank of `cfg` holds of the blocks in `comp`."""
        tp, ep = cfg.tp, cfg.ep
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        dense = sum(n * (b.params_tp / tp + b.params_rep) for b, n in facts)
        experts = sum(n * b.params_expert / (tp * ep) for b, n in facts)
        return dense, experts

    def dp_traffic(
        self,
        comp: Composition,
        cfg: StageConfig,
        *,
        dp: int,
        zero: int,
        first: str | None = None,
    ) -> DpTraffic:
        """Per-occurrence DP collectives of a stage of `cfg` (its tp, cp and ep) over `dp`
        replicas at ZeRO stage `zero` that overlap with its compute (gradients at
        `reduce_bytes` per parameter, weights at the training precision's,
        `memory.Precision`): ZeRO-0 all-reduces gradients; ZeRO-1/2 reduce-scatter gradients
        and all-gather updated weights (one bucketed collective each); ZeRO-3 (per
        micro-batch) runs one all-gather of each FSDP unit's weights for forward, one for
        backward and one reduce-scatter of its gradients (FSDP2 and FSDP1 wrap every block:
        one collective per unit, each paying its latency and reaching the bandwidth of its
        own message size). Under ZeRO-3 `first` names the block of the stage's first unit:
        its forward all-gather and its reduce-scatter are left out here, because nothing
        overlaps them (`dp_edge`). Context-parallel ranks hold the same weights and their
        gradients are reduced with the data-parallel ones, so the group is dp * cp ranks
        (Megatron-LM's data-parallel group "with CP", torchtitan's FSDP mesh dp_shard x cp).
        Expert parameters use the dp * cp / ep ranks that hold the same experts."""
        # what prices it: cfg enters through its tp, cp and ep only (`_dp_params`, `_dp_ranks`)
        key = (comp, cfg.tp, cfg.cp, cfg.ep, dp, zero, first)
        got = self._dp_traffic.get(key)
        if got is None:
            got = self._dp_traffic[key] = self._dp_traffic_of(comp, cfg, dp, zero, first)
        return got

    def _dp_traffic_of(
        self, comp: Composition, cfg: StageConfig, dp: int, zero: int, first: str | None
    ) -> DpTraffic:
        AR, AG, RS = Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.REDUCE_SCATTER
        g_bytes, w_bytes = self.reduce_bytes, self._gather_bytes()
        ranks = _dp_ranks(cfg, dp)
        if zero in (0, 1, 2):
            dense, experts = self._dp_params(comp, cfg)
            out: list[tuple[Collective, float, int]] = []
            for params, n in zip((dense, experts), ranks, strict=True):
                if params <= 0 or n <= 1:
                    continue
                if zero == 0:
                    out.append((AR, params * g_bytes, n))
                else:
                    out += [(RS, params * g_bytes, n), (AG, params * w_bytes, n)]
            return DpTraffic(tuple(out))
        colls: list[tuple[Collective, float, int]] = []
        reps: list[int] = []
        for key, count in comp:
            unit = self._dp_params(((key, 1),), cfg)
            edge = 1 if key == first else 0
            for params, n in zip(unit, ranks, strict=True):
                if params <= 0 or n <= 1:
                    continue
                colls += [(AG, params * w_bytes, n), (RS, params * g_bytes, n)]
                reps += [2 * count - edge, count - edge]
        kept = [(c, r) for c, r in zip(colls, reps, strict=True) if r > 0]
        return DpTraffic(tuple(c for c, _ in kept), tuple(r for _, r in kept))

    def dp_edge(self, first: str, cfg: StageConfig, *, dp: int) -> DpTraffic:
        """ZeRO-3's collectives of a micro-batch of `cfg` over `dp` replicas that no compute
        overlaps: the all-gather of the stage's first unit (block `first`) before its forward
        (FSDP prefetches each next unit's gather behind the current unit's compute, but the
        first has nothing before it) and that unit's reduce-scatter after the backward's last
        compute (the optimizer waits for it). Run on the critical path of every micro-batch
        (`simulate`)."""
        AG, RS = Collective.ALL_GATHER, Collective.REDUCE_SCATTER
        out: list[tuple[Collective, float, int]] = []
        unit = self._dp_params(((first, 1),), cfg)
        for params, n in zip(unit, _dp_ranks(cfg, dp), strict=True):
            if params > 0 and n > 1:
                out += [(AG, params * self._gather_bytes(), n), (RS, params * self.reduce_bytes, n)]
        return DpTraffic(tuple(out))

    def _gather_bytes(self) -> int:
        """Bytes per weight an all-gather moves: the training precision's, or 1 when FSDP
        gathers the FP8 weights (`Engine.float8_all_gather`)."""
        return 1 if self.engine.float8_all_gather else self.precision.weight_bytes

    def dp_single(self, traffic: DpTraffic, group: str, cfg: StageConfig) -> float:
        """DP traffic time when all replicas of the stage (of `cfg`: its tp) sit in one group,
        packed into NVLink domains (nodes)."""
        key = (traffic, group, cfg.tp)  # what prices it (`dp_single_choices`)
        got = self._dp_single_time.get(key)
        if got is None:
            choices = self.dp_single_choices(traffic, group, cfg)
            got = sum(c.time_s * r for c, r in zip(choices, traffic.times, strict=True))
            self._dp_single_time[key] = got
        return got

    def dp_single_choices(
        self, traffic: DpTraffic, group: str, cfg: StageConfig
    ) -> list[CommChoice]:
        """The priced methods of each collective of `dp_single` (gradients reduced, weights
        gathered), once per entry of `traffic.collectives` (each runs `traffic.times` times)."""
        g = self.groups[group]
        # The DP x CP group's ranks in one NVLink domain (node): every rank of the domain
        # outside TP (cp sits inside dp in the mesh order pp, dp, cp, ep, tp).
        per_node = max(1, g.domain_gpus // cfg.tp)
        # The choices depend on nothing else (the pricer's options, dtype and cluster are
        # fixed): the search asks for the same ones under many configurations.
        key = (traffic.collectives, group, per_node)
        got = self._dp_single.get(key)
        if got is None:
            got = self._dp_single[key] = self._dp_single_priced(traffic, g, per_node)
        return got

    def _dp_single_priced(
        self, traffic: DpTraffic, g: DeviceGroup, per_node: int
    ) -> list[CommChoice]:
        return [
            choose(
                k,
                s,
                n,
                lambda x, k=k, n=n: group_collective_time(
                    k, x, self.cluster, g, n, min(n, per_node)
                ),
                self.comm,
                g.gpu,
                self.dtype,
                tensor_of(k),
            )
            for k, s, n in traffic.collectives
        ]

    def cross_path(self, a: str, b: str, ranks_a: int, ranks_b: int) -> CrossPath:
        """`collectives.cross_group_path`, cached."""
        key = (a, b, ranks_a, ranks_b)
        got = self._cross.get(key)
        if got is None:
            got = self._cross[key] = cross_group_path(self.cluster, a, b, ranks_a, ranks_b)
        return got

    def dp_cross(self, traffic: DpTraffic, a: str, b: str, cfg: StageConfig) -> CrossTraffic:
        """DP traffic time of a flat ring spanning groups a and b (replicas packed in nodes).
        Each crossing stage has tp rings (one per TP rank of `cfg`, each over the dp * cp ranks
        that hold the same weights) on a shared GroupLink."""
        tp = cfg.tp
        # The price depends on nothing else (the pricer's options, dtype and cluster are
        # fixed): the search asks for the same one under many configurations.
        key = (traffic, a, b, tp)
        got = self._dp_cross.get(key)
        if got is None:
            got = self._dp_cross[key] = self._dp_cross_priced(traffic, a, b, tp)
        return got

    def _dp_cross_priced(self, traffic: DpTraffic, a: str, b: str, tp: int) -> CrossTraffic:
        # Ranks of one DP ring per NVLink domain (node): the replicas a domain holds, at most
        # dp. Placement-independent on purpose (the planner prices it before placing):
        # optimistic when one side holds fewer replicas than fit in a domain.
        dp = max((n for _, _, n in traffic.collectives), default=1)
        ga, gb = self.groups[a], self.groups[b]
        path = self.cross_path(
            a,
            b,
            max(1, min(dp, ga.domain_gpus // tp)),
            max(1, min(dp, gb.domain_gpus // tp)),
        )
        vol, alpha = traffic.volume, traffic.count * path.latency
        per_stage = None
        if path.shared_bandwidth is not None:
            per_stage = vol * tp / path.shared_bandwidth
        coded = coded_cross(
            traffic.collectives,
            traffic.times,
            Path(path.bandwidth, path.latency),
            path.shared_bandwidth,
            tp,
            self.comm,
            slower_gpu(ga.gpu, gb.gpu),
            self.dtype,
        )
        return CrossTraffic(
            alpha + vol / path.bandwidth,
            alpha,
            per_stage,
            CrossTraffic(*coded) if coded is not None else None,
        )

    def hetero_dp_traffic(
        self, comp: Composition, parallel: Parallel, tp_by_group: Mapping[str, int]
    ) -> dict[str, DpTraffic]:
        """Per-group TP (`StagePlacement.group_tp`): the gradient reduction of a stage of the
        complete configuration `parallel` (its dp and cp) whose replicas use different TP
        degrees (`tp_by_group`), per rank of each group, as the runtime runs it
        (`meshplan.runtime.data_parallel.HeteroGradients`).

        Every TP-sharded parameter (and stacked expert weight) is cut into L = lcm(tp_g)
        pieces along its sharded dim; a rank of group g holds L / tp_g consecutive pieces.
        Piece j is all-reduced over the dp * cp ranks that hold it (one per replica and cp
        rank), together with the stage's TP-replicated parameters (norms), which every rank
        holds whole. So a rank of group g runs L / tp_g all-reduces of (P_tp / L + P_rep)
        gradients each, n = dp * cp ranks: ZeRO-0 only (the replicas' optimizers cannot
        share shards of different shapes)."""
        facts = [(self.costs.facts[k].memory, n) for k, n in comp]
        sharded = sum(n * (b.params_tp + b.params_expert) for b, n in facts)
        replicated = sum(n * b.params_rep for b, n in facts)
        pieces = math.lcm(*tp_by_group.values())
        piece = (sharded / pieces + replicated) * self.reduce_bytes
        ranks = parallel.dp * parallel.cp
        if ranks <= 1:
            return {g: DpTraffic(()) for g in tp_by_group}
        return {
            g: DpTraffic(((Collective.ALL_REDUCE, piece, ranks),) * (pieces // t))
            for g, t in tp_by_group.items()
        }

    def dp_cross_hetero(
        self,
        comp: Composition,
        a: str,
        b: str,
        parallel: Parallel,
        tp_by_group: Mapping[str, int],
    ) -> CrossTraffic:
        """`hetero_dp_traffic` of a stage of `parallel` with replicas in groups a and b
        (`tp_by_group`: the degree of each group holding replicas of the stage, L = their
        lcm), priced like `dp_cross`: the piece rings cross the groups' link; the slower side
        (the group with the smaller tp moves more pieces) sets the unshared time, and the link
        carries L pieces per stage when a shared GroupLink bounds it. Raw: the runtime does
        not code these reductions."""
        traffic = self.hetero_dp_traffic(comp, parallel, tp_by_group)
        dp = parallel.dp
        ga, gb = self.groups[a], self.groups[b]
        ta, tb = tp_by_group[a], tp_by_group[b]
        path = self.cross_path(
            a,
            b,
            max(1, min(dp, ga.domain_gpus // ta)),
            max(1, min(dp, gb.domain_gpus // tb)),
        )
        unshared = max(
            traffic[g].count * path.latency + traffic[g].volume / path.bandwidth for g in (a, b)
        )
        latency = max(traffic[g].count for g in (a, b)) * path.latency
        per_stage = None
        if path.shared_bandwidth is not None:
            pieces = math.lcm(*tp_by_group.values())
            one = traffic[a].collectives[:1]  # one piece's ring
            per_stage = pieces * DpTraffic(one).volume / path.shared_bandwidth
        return CrossTraffic(unshared, latency, per_stage, None)


def slower_gpu(a: GpuSpec, b: GpuSpec) -> GpuSpec:
    """The GPU with less streaming bandwidth (the codec's end that sets its speed)."""
    return a if a.hbm_bandwidth <= b.hbm_bandwidth else b
