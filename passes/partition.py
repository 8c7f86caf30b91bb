"""Pipeline partitioning: split a graph's units into stages and place stages on device groups.

`even_stages` is a pass `Graph -> Analysis` (the unit ranges of each stage); `place_stages`
gives the default placement that `estimate` uses when the user names only the degrees. The
planner makes its own placements (`meshplan.planner.solver`) over the same ranges.
"""

from __future__ import annotations

from collections.abc import Sequence

from meshplan.ir import Cluster, DeviceGroup, Graph, Parallel, StagePlacement


def replica_capacity(group: DeviceGroup, tp: int, cp: int = 1) -> int:
    """Replicas of tp * cp GPUs that `group` can hold with TP inside a node: tp must divide
    the node's GPU count (then replicas start at multiples of tp); CP may span nodes."""
    if group.gpus_per_node % tp:
        return 0
    return group.num_gpus // (tp * cp)


def even_stages(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    """Split `graph.units` into `pp` contiguous ranges [first, last) of near-equal layer counts.

    Requires: 1 <= pp <= number of layer units. Ensures: ranges cover every unit in order, each
    stage has floor(L/pp) or ceil(L/pp) layers, the first L % pp stages taking the extra one (so
    the last stage, which also runs the LM head and loss, is never the one with more layers);
    units before the first layer (the prologue) go with stage 0, units after the last layer (the
    epilogue) with the last stage, and a non-layer unit between layers goes with the stage of
    the layer that follows it.
    """
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp}")
    lookup = dict(graph.blocks)
    layer_pos = [i for i, u in enumerate(graph.units) if lookup[u.block].kind == "layer"]
    n_layers = len(layer_pos)
    if pp > n_layers:
        raise ValueError(f"pp={pp} exceeds the {n_layers} layer units of {graph.name}")
    base, extra = divmod(n_layers, pp)
    ranges = []
    first, taken = 0, 0
    for s in range(pp):
        taken += base + (1 if s < extra else 0)
        last = len(graph.units) if s == pp - 1 else layer_pos[taken - 1] + 1
        ranges.append((first, last))
        first = last
    return tuple(ranges)


def place_stages(
    cluster: Cluster, parallel: Parallel, ranges: Sequence[tuple[int, int]]
) -> tuple[StagePlacement, ...]:
    """Default placement: fill GPUs in rank order, stage by stage, each stage's dp replicas of
    tp*cp GPUs; a replica never straddles two device groups and a TP group never straddles
    two nodes (groups whose gpus_per_node tp does not divide are skipped; elsewhere replicas
    start at multiples of tp).

    On a mixed cluster this puts stage 0 on the first group, and so on. Raises ValueError when
    tp*pp*cp*dp exceeds the world size, tp divides no group's gpus_per_node, or the replicas
    do not fit the groups whole.
    """
    p = parallel
    tp, cp, dp = p.tp or 1, p.cp or 1, p.dp or 1
    pp = len(ranges)
    if p.pp is not None and p.pp != pp:
        raise ValueError(f"pp={p.pp} but {pp} stage ranges were given")
    need = tp * pp * cp * dp
    if need > cluster.world_size:
        raise ValueError(
            f"tp*pp*cp*dp = {tp}*{pp}*{cp}*{dp} = {need} GPUs exceeds the cluster's "
            f"{cluster.world_size}"
        )
    if all(g.gpus_per_node % tp for g in cluster.groups):
        per_node = ", ".join(sorted({str(g.gpus_per_node) for g in cluster.groups}))
        raise ValueError(
            f"tp={tp} does not divide gpus_per_node={per_node} (TP stays inside a node)"
        )
    free = [[g.name, replica_capacity(g, tp, cp)] for g in cluster.groups]  # replicas left
    gi = 0
    stages = []
    for s, (first, last) in enumerate(ranges):
        want, reps = dp, []
        while want:
            while gi < len(free) and free[gi][1] == 0:
                gi += 1
            if gi == len(free):
                raise ValueError(
                    f"stage {s}: no room for {want} more replicas of tp*cp={tp * cp} GPUs "
                    f"(replicas cannot straddle device groups)"
                )
            take = min(want, free[gi][1])
            reps.append((free[gi][0], take))
            free[gi][1] -= take
            want -= take
        stages.append(StagePlacement(s, first, last, tuple(reps)))
    return tuple(stages)
