"""Pipeline traffic of a stage: the point-to-point sends of a boundary activation between
consecutive stages, at equal or differing TP degrees (`Pricer`'s pipeline part).

`PipelineTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `cluster` and
`groups`, and calls its `comm_choice` and `cross_path` (dp_traffic.py).
"""

from __future__ import annotations

from .collectives import Collective, inter_node_path, intra_node_path
from .compression import CommChoice
from .dp_traffic import slower_gpu


class PipelineTraffic:
    """The pipeline-send methods of `pricer.Pricer` (see the module docstring)."""

    def p2p(self, size: float, a: str, b: str, streams: int) -> float:
        """Forward send + backward send of one boundary activation of `size` bytes per rank
        between a stage on group a and the next on group b; `streams` ranks send at once.
        Cached: it depends on nothing else (the pricer's options, dtype and cluster are
        fixed)."""
        key = (size, a, b, streams)
        got = self._p2p.get(key)
        if got is None:
            got = self._p2p[key] = 2 * self.p2p_choice(size, a, b, streams).time_s
        return got

    def handoff(
        self,
        activation: float,
        a: str,
        tp_a: int,
        b: str,
        tp_b: int,
        *,
        pipelines: int,
        cp: int,
    ) -> float:
        """Forward send + backward send of one micro-batch's boundary activation between a
        stage whose replica sits in group a at degree tp_a and the next stage's in group b at
        degree tp_b (seconds); `activation`: the tensor's bytes for one replica (all its cp
        ranks), `pipelines`: how many pipelines make this hand-off at once.

        Rule (Megatron's scatter/gather, Narayanan et al. SC'21 sec. 4.1, across degrees).
        Each of the tp_a sending ranks holds the activation whole (or, under sequence
        parallelism, its 1/tp_a sequence shard); each of the tp_b receiving ranks needs it
        whole (or its 1/tp_b shard). It crosses once, cut into pieces: every sender sends
        its 1/tp_a and every receiver receives its 1/tp_b, so a rank on the side with fewer
        ranks moves activation / (cp min(tp_a, tp_b)) and sets the time, on the path
        between the groups (`p2p`: the group's own link when a == b, else `cross_path` with
        one rank per node, each driving its NIC share). Streams crossing a shared GroupLink
        at once: pipelines * cp * min(tp_a, tp_b), which together carry pipelines x the
        activation. The all-gather that re-replicates the pieces inside a receiving TP
        group without sequence parallelism runs on that node's own link and is not priced,
        as for equal degrees, where this is the 1/tp per rank of `tables.plan_tables`. The
        gradient goes back the same way with the same bytes."""
        lanes = min(tp_a, tp_b)
        return self.p2p(activation / (cp * lanes), a, b, pipelines * cp * lanes)

    def p2p_choice(self, size: float, a: str, b: str, streams: int) -> CommChoice:
        """One boundary send of `p2p` at its fastest allowed method."""
        if a == b:
            g = self.groups[a]
            if g.domains == 1:
                path = intra_node_path(self.cluster, g)
            else:
                # Consecutive stages sit in different NVLink domains (nodes): stages fill
                # domains in order.
                path = inter_node_path(self.cluster, g)
        else:
            path = self.cross_path(a, b, 1, 1).path(streams)
        gpu = slower_gpu(self.groups[a].gpu, self.groups[b].gpu)
        return self.comm_choice(Collective.P2P, size, 2, path, gpu, "activations", "pp")
