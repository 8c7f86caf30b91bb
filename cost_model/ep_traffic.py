"""Expert-parallel traffic of a stage: the MoE dispatch and combine all-to-alls at the busiest
rank's load, inside one device group or over an ep group that spans several (`EpSpan`)
(`Pricer`'s expert-parallel part).

`ExpertParallelTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `engine`,
`cluster` and `groups`, and calls its `comm_choice` and `cross_path` (dp_traffic.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.ir import DeviceGroup

from .collectives import BASE_LATENCY_S, Collective, group_path
from .graph_costs import BlockFacts, moe_imbalance


@dataclass(frozen=True, slots=True)
class EpSpan:
    """An expert-parallel group whose ranks sit in several device groups.

    `members`: (group, ranks of the ep group in it) in rank order, at least two groups.
    `streams`: how many such ep groups cross a shared GroupLink at once (tp * cp per spanning
    chunk of dp ranks, summed over the pipeline stages, which run concurrently).
    """

    members: tuple[tuple[str, int], ...]
    streams: int = 1

    def __post_init__(self) -> None:
        if len({g for g, _ in self.members}) < 2 or any(n < 1 for _, n in self.members):
            raise ValueError(f"EpSpan needs ranks in at least two groups, got {self.members}")
        if self.streams < 1:
            raise ValueError(f"EpSpan streams must be >= 1, got {self.streams}")

    @property
    def ranks(self) -> int:
        """The ep group's size."""
        return sum(n for _, n in self.members)


def ep_spans(replicas: Sequence[tuple[str, int]], ep: int) -> tuple[list[tuple], set[str]]:
    """The ep groups of one stage's replicas (group, count) in placement (dp index) order:
    ([members of each ep group that spans groups], {groups holding a whole ep group}).

    An ep group is ep consecutive dp indices (`meshplan.runtime.mesh`), and dp indices are
    numbered across the groups in placement order (`meshplan.ir.plan.assign_ranks`)."""
    spanning: list[tuple] = []
    whole: set[str] = set()
    chunk: list[list] = []
    left = ep
    for group, count in replicas:
        while count > 0:
            take = min(count, left)
            if chunk and chunk[-1][0] == group:
                chunk[-1][1] += take
            else:
                chunk.append([group, take])
            count, left = count - take, left - take
            if left == 0:
                if len(chunk) > 1:
                    spanning.append(tuple((g, n) for g, n in chunk))
                else:
                    whole.add(chunk[0][0])
                chunk, left = [], ep
    return spanning, whole


class ExpertParallelTraffic:
    """The expert-parallel methods of `pricer.Pricer` (see the module docstring)."""

    def moe_load_factor(
        self, facts: BlockFacts, *, tp: int, cp: int, ep: int, sp: bool, scale: float
    ) -> float:
        """The busiest expert-parallel rank's routed rows over the mean: `Engine.moe_imbalance`
        (capped by the capacity factor), else the balanced router's bound `moe_imbalance` for
        the assignments of one rank's tokens (its sequence shard under SP)."""
        share = scale / (cp * (tp if sp else 1))
        factor = self.engine.moe_imbalance
        if factor is None:
            return moe_imbalance(facts.assignments * share, ep, facts.capacity_factor)
        return min(factor, max(1.0, facts.capacity_factor))

    def _ep_traffic(
        self,
        facts,
        g: DeviceGroup,
        tp,
        cp,
        ep,
        sp,
        scale,
        span: EpSpan | None = None,
        stride: int | None = None,
    ) -> tuple[float, float]:
        """Expert parallelism: dispatch + combine all-to-alls of top_k * tokens * hidden in
        forward and again in backward, over ep ranks strided by `stride` GPUs (tp x cp; tp x
        the cp ranks a spanning cp group has in g), at the busiest rank's
        load: the mean times the routing imbalance (`Engine.moe_imbalance`, else the balanced
        router's bound `moe_imbalance`, capped by the capacity factor). `cp`: what a rank's
        share of a sequence divides it by (`StageConfig.seq_div`). Inside group g, or, with
        `span`, over the groups the ep group spans (`ep_span_all_to_all`, raw)."""
        if ep <= 1 or not facts.a2a_bytes:
            return 0.0, 0.0
        share = scale / (cp * (tp if sp else 1))
        factor = self.moe_load_factor(facts, tp=tp, cp=cp, ep=ep, sp=sp, scale=scale)
        size = facts.a2a_bytes * share * factor
        # the ranks' stride is tp x the cp ranks between them (`stride`), not the share divisor
        stride = stride or tp * math.ceil(cp)
        if span is not None:
            t = self.ep_span_all_to_all(size, span, tp=tp, cp=stride // tp)
            return 2 * t, 2 * t
        path = group_path(self.cluster, g, ep, max(1, g.domain_gpus // stride))
        t = self.comm_choice(
            Collective.ALL_TO_ALL, size, ep, path, g.gpu, "activations", "ep"
        ).time_s
        return 2 * t, 2 * t

    def ep_span_all_to_all(self, size: float, span: EpSpan, *, tp: int, cp: int) -> float:
        """One all-to-all of `size` bytes per rank (`size / n` to each of the n ranks, itself
        included) over an ep group that spans device groups (seconds).

        Derivation. Let the n = sum_g c_g ranks sit c_g in group g. A rank of g sends
        (c_g - 1) size / n to the other ranks of g and c_h size / n to each group h != g: in
        all (n - 1) size / n, NCCL's all-to-all bus factor. Between groups g and h the link
        carries, in each direction, c_g c_h size / n bytes per ep group (c_g ranks sending
        c_h size / n each); with `span.streams` ep groups crossing at once, streams times that.
        For two groups split a | b, 2 a b size / n bytes cross (a b size / n each way) of the
        (n - 1) size the all-to-all moves in all: a fraction 2 a b / (n (n - 1)), e.g. 16/31
        for 16 | 16. The transfers run concurrently (one latency step, as inside a group), so
        the time is the base latency plus one step at the slowest path's latency plus the
        largest of

        - c_g's own part: (c_g - 1) size / n over the group's path for c_g ranks (`group_path`,
          as the all-to-all inside a group);
        - a rank's part leaving its group: sum_h c_h size / n over its NIC share towards h
          (`cross_group_path` with one rank per node: every rank drives its own share);
        - a shared GroupLink between g and h (a WAN): streams c_g c_h size / n over the whole
          link's bandwidth.

        Raw traffic only (lossless coding of a spanning all-to-all is not priced)."""
        n = span.ranks
        per_byte, latency = 0.0, 0.0
        for i, (a, ca) in enumerate(span.members):
            ga = self.groups[a]
            if ca > 1:
                inside = group_path(self.cluster, ga, ca, max(1, ga.domain_gpus // (tp * cp)))
                per_byte = max(per_byte, (ca - 1) / n / inside.bandwidth)
                latency = max(latency, inside.latency)
            out = 0.0
            for j, (b, cb) in enumerate(span.members):
                if b == a:
                    continue
                cross = self.cross_path(a, b, 1, 1)
                out += cb / n / cross.bandwidth
                latency = max(latency, cross.latency)
                if j > i and cross.shared_bandwidth is not None:
                    shared = span.streams * ca * cb / n / cross.shared_bandwidth
                    per_byte = max(per_byte, shared)
            per_byte = max(per_byte, out)
        return BASE_LATENCY_S + latency + size * per_byte
