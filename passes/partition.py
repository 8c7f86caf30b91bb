"""Pipeline partitioning: split a graph's units into stages and place stages on device groups.

`even_stages` is a pass `Graph -> Analysis` (the unit ranges of each stage); `stages_of`
turns any per-stage layer counts into unit ranges (uneven splits); `balanced_counts` picks
the layer counts that minimise the slowest stage given per-stage layer and fixed costs (more
layers on faster GPUs, fewer on the stages holding the embedding and the LM head);
`compositions` lists every split (the planner searches all of them when they are few).
`rank_chunks` cuts the layers into the model chunks each rank runs under interleaved 1F1B or
ZB-V (meshplan's layout `chunk_layers`, or a framework's own layers per chunk), and
`listed_chunks_problem` checks the chunks a plan's stages list.
`place_stages` gives the default placement that `estimate` uses when the user names only the
degrees. The planner makes its own placements (`meshplan.planner.solver`) over these ranges.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator, Sequence

from meshplan.ir import Cluster, DeviceGroup, Graph, Parallel, StagePlacement


def tp_domain_problem(groups: Sequence[DeviceGroup], tp: int) -> str | None:
    """Why TP of degree `tp` fits none of `groups`, or None when it fits at least one.

    A TP group stays inside one NVLink domain (`DeviceGroup.domain_gpus`: a node, or all the
    GPUs of an NVLink switch fabric such as a GB200 NVL72 rack), where its every-layer
    collectives run on the intra-node link: tp must divide the domain's GPU count, and then
    replicas that start at multiples of tp never straddle two domains. Called by candidate
    enumeration, the default placement and the stage-placement check alike."""
    if any(g.domain_gpus % tp == 0 for g in groups):
        return None
    if all(g.domain_gpus == g.gpus_per_node for g in groups):
        per_node = ", ".join(sorted({str(g.gpus_per_node) for g in groups}, key=int))
        where = f" of group {groups[0].name}" if len(groups) == 1 else ""
        return f"tp={tp} does not divide gpus_per_node={per_node}{where} (TP stays inside a node)"
    sizes = ", ".join(sorted({str(g.domain_gpus) for g in groups}, key=int))
    where = f" of group {groups[0].name}" if len(groups) == 1 else ""
    return (
        f"tp={tp} does not divide the GPUs per NVLink domain ({sizes}){where} (TP stays "
        "inside a node or NVLink domain)"
    )


def replica_capacity(group: DeviceGroup, tp: int, cp: int = 1) -> int:
    """Replicas of tp * cp GPUs that `group` can hold with TP inside an NVLink domain (a node
    unless the group sets `nvlink_domain`): tp must divide the domain's GPU count
    (`tp_domain_problem`; then replicas start at multiples of tp); CP may span domains."""
    if tp_domain_problem((group,), tp) is not None:
        return 0
    return group.num_gpus // (tp * cp)


def even_stages(graph: Graph, pp: int) -> tuple[tuple[int, int], ...]:
    """Split `graph.units` into `pp` contiguous ranges [first, last) of near-equal layer counts.

    Requires: 1 <= pp <= max(1, layer units). Ensures: ranges cover every unit in order, each
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
    if n_layers == 0 and pp == 1:  # no repeated layers (a conv net): one stage of everything
        return ((0, len(graph.units)),)
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


def _layer_positions(graph: Graph) -> list[int]:
    lookup = dict(graph.blocks)
    return [i for i, u in enumerate(graph.units) if lookup[u.block].kind == "layer"]


def stages_of(graph: Graph, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Unit ranges [first, last) of stages with `counts[s]` layers each (an uneven split).

    Requires: every count >= 1 and sum(counts) = number of layer units. Ensures the same unit
    rules as `even_stages` (prologue with stage 0, epilogue with the last stage, a non-layer
    unit between layers with the stage of the layer that follows it)."""
    layer_pos = _layer_positions(graph)
    if not layer_pos and tuple(counts) == (0,):  # no repeated layers: one stage of everything
        return ((0, len(graph.units)),)
    if any(c < 1 for c in counts) or sum(counts) != len(layer_pos):
        raise ValueError(
            f"layer counts {tuple(counts)} must be positive and add up to the "
            f"{len(layer_pos)} layers of {graph.name}"
        )
    ranges, first, taken = [], 0, 0
    for s, c in enumerate(counts):
        taken += c
        last = len(graph.units) if s == len(counts) - 1 else layer_pos[taken - 1] + 1
        ranges.append((first, last))
        first = last
    return tuple(ranges)


def chunk_layers(n_layers: int, pp: int, chunks: int) -> tuple[int, ...] | None:
    """Layers in each of the pp * chunks model chunks, in model order, when a schedule runs
    `chunks` chunks per pipeline rank (interleaved 1F1B, ZB-V); None when the layers cannot
    be laid out so. The one rule the solver, `estimate`, the cost model and the plan share.

    Megatron-LM's two layouts: equal chunks when pp * chunks divides the layers; otherwise,
    when it divides the layers + 2, the embedding and the loss each count as one layer
    (Megatron-LM `--account-for-embedding-in-pipeline-split`,
    `--account-for-loss-in-pipeline-split`), so the first and the last chunk hold one layer
    fewer: Llama 3 405B's 126 layers on pp 16 ("we reduce one Transformer layer each from the
    first and the last stages", Llama 3 paper, Dubey et al. 2024, section 3.3.2), where with
    chunks of one layer the first chunk holds only the embedding and the last only the head."""
    total = pp * chunks
    if chunks < 1 or pp < 1:
        return None
    if n_layers % total == 0:
        return (n_layers // total,) * total
    if total >= 2 and (n_layers + 2) % total == 0:
        c = (n_layers + 2) // total
        return (c - 1, *([c] * (total - 2)), c - 1)
    return None


def chunk_layout_problem(
    n_layers: int, pp: int, chunks: int, v_shape: bool = False, counts: Sequence[int] = ()
) -> str:
    """Why `n_layers` cannot run as pp * chunks model chunks, or "": with `counts` (the
    layers of each chunk in model order, a framework's own split such as torchtitan's uneven
    virtual stages) when those are not pp * chunks counts adding up to the layers, a chunk
    other than the first and the last without a layer (those two may hold only the embedding
    or the loss), or a rank left without a layer; without them (`chunk_layers`) when there
    is no layout, or a rank left without a layer (ZB-V's rank 0 holds the first and the last
    chunk, both short under the uneven layout)."""
    total = pp * chunks
    if counts:
        inner = tuple(counts)[1:-1]
        if len(counts) != total or sum(counts) != n_layers or min(counts) < 0 or 0 in inner:
            return (
                f"layers per model chunk {tuple(counts)} must be {total} counts (pp={pp} x "
                f"{chunks} per rank) adding up to the {n_layers} layers, each at least 1 but "
                "the first and the last"
            )
        per_chunk = tuple(counts)
    else:
        got = chunk_layers(n_layers, pp, chunks)
        if got is None:
            return (
                f"{total} model chunks (pp={pp} x {chunks} per rank) need the {n_layers} "
                f"layers to be a multiple of {total}, or of {total} less 2 (the embedding and "
                "the loss counted as a layer each, Megatron-LM's uneven first and last stages)"
            )
        per_chunk = got
    if min(_per_rank(per_chunk, pp, chunks, v_shape)) < 1:
        return f"{total} model chunks of {n_layers} layers leave a pipeline rank without a layer"
    return ""


def rank_layers(
    n_layers: int, pp: int, chunks: int, v_shape: bool = False, counts: Sequence[int] = ()
) -> tuple[int, ...]:
    """Layers each pipeline rank runs when its chunks hold `counts` layers (model order;
    empty: `chunk_layers`), with the chunk-to-rank map of `rank_chunks` (ValueError with
    `chunk_layout_problem`'s reason when there is no such layout)."""
    if why := chunk_layout_problem(n_layers, pp, chunks, v_shape, counts):
        raise ValueError(why)
    per_chunk = tuple(counts) or chunk_layers(n_layers, pp, chunks) or ()
    return _per_rank(per_chunk, pp, chunks, v_shape)


def _per_rank(per_chunk, pp: int, chunks: int, v_shape: bool) -> tuple[int, ...]:
    out = [0] * pp
    for k, n in enumerate(per_chunk):
        out[_chunk_rank(k, pp, chunks, v_shape)] += n
    return tuple(out)


def _chunk_rank(k: int, pp: int, chunks: int, v_shape: bool) -> int:
    total = pp * chunks
    return (k if k < pp else total - 1 - k) if v_shape else k % pp


def rank_chunks(
    graph: Graph, pp: int, chunks: int, v_shape: bool = False, counts: Sequence[int] = ()
) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The unit ranges each pipeline rank runs when the layers are cut into pp * chunks model
    chunks (interleaved 1F1B and ZB-V) of `counts` layers each in model order (empty:
    `chunk_layers`), per rank in model order.

    Chunk k (the prologue goes with chunk 0, the epilogue with the last; a first or last chunk
    without layers holds only them) runs on rank k mod pp (Megatron-LM's interleaved layout,
    Narayanan et al. SC'21), or with `v_shape` on rank k for k < pp and 2 pp - 1 - k after
    (ZB-V, Qi et al. 2024; torch `ScheduleZBVZeroBubble`), so rank 0 holds both the embedding
    and the LM head. Raises ValueError with `chunk_layout_problem`'s reason when there is no
    such layout."""
    n_layers = len(_layer_positions(graph))
    if why := chunk_layout_problem(n_layers, pp, chunks, v_shape, counts):
        raise ValueError(why)
    ranges = _chunk_ranges(graph, tuple(counts) or chunk_layers(n_layers, pp, chunks) or ())
    out: list[list[tuple[int, int]]] = [[] for _ in range(pp)]
    for k, r in enumerate(ranges):
        out[_chunk_rank(k, pp, chunks, v_shape)].append(r)
    return tuple(tuple(c) for c in out)


def listed_chunks_problem(
    graph: Graph, stages: Sequence[StagePlacement], chunks: int, v_shape: bool = False
) -> str:
    """Why the chunk ranges the stages list (`StagePlacement.chunks`: the model chunks each
    pipeline rank runs, in model order) are not a layout of `chunks` chunks per rank, or "":
    every stage lists `chunks` ranges (none when the schedule runs one chunk per rank); taken
    in the schedule's order (chunk k on rank k mod pp, or ZB-V's V, `rank_chunks`) they tile
    the units in order; and each stage's [first_unit, last_unit) holds as many layers as its
    chunks. The chunks' sizes are free (a framework's uneven virtual stages): the cost model
    prices the chunks as listed and the runtime cuts them so."""
    listed = [st for st in stages if st.chunks]
    if not listed:
        return ""
    pp = len(stages)
    if pp < 2 or chunks < 2:
        return (
            f"stage {listed[0].index} lists model chunks but the schedule runs one per rank "
            f"(pp={pp})"
        )
    for st in stages:
        if len(st.chunks) != chunks:
            return (
                f"stage {st.index} lists {len(st.chunks)} model chunks, the schedule runs {chunks}"
            )
    where = [0] * pp  # chunks of each rank seen so far
    first = 0
    for k in range(pp * chunks):
        r = _chunk_rank(k, pp, chunks, v_shape)
        a, b = stages[r].chunks[where[r]]
        where[r] += 1
        if a != first:
            return (
                f"model chunk {k} (stage {r}'s chunk {where[r] - 1}) starts at unit {a}, the one "
                f"before it ends at {first}: the chunks must tile the model in the schedule's order"
            )
        first = b
    if first != len(graph.units):
        return f"the model chunks cover units [0, {first}) of {len(graph.units)}"
    for st in stages:
        held = sum(layer_counts(graph, st.chunks))
        (own,) = layer_counts(graph, ((st.first_unit, st.last_unit),))
        if held != own:
            return (
                f"stage {st.index} holds {own} layers in units [{st.first_unit}, "
                f"{st.last_unit}) but its model chunks hold {held}"
            )
    return ""


def _chunk_ranges(graph: Graph, counts: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """`stages_of`, with a first chunk of only the prologue and a last of only the epilogue
    allowed (no layers)."""
    if all(c >= 1 for c in counts):
        return stages_of(graph, counts)
    layer_pos = _layer_positions(graph)
    n = len(graph.units)
    ranges, first, taken = [], 0, 0
    for s, c in enumerate(counts):
        taken += c
        if s == len(counts) - 1:
            last = n
        elif c == 0 and s == 0:
            last = layer_pos[0]  # the units before the first layer
        else:
            last = layer_pos[taken - 1] + 1
        if last <= first:
            raise ValueError(
                f"chunk {s} of {graph.name} would hold no unit: a chunk without layers needs "
                "a prologue or epilogue unit"
            )
        ranges.append((first, last))
        first = last
    return tuple(ranges)


def layer_counts(graph: Graph, ranges: Sequence[tuple[int, int]]) -> tuple[int, ...]:
    """The layers per stage of a split given as unit ranges."""
    layer_pos = _layer_positions(graph)
    return tuple(sum(1 for i in layer_pos if a <= i < b) for a, b in ranges)


def compositions(n_layers: int, pp: int) -> Iterator[tuple[int, ...]]:
    """Every split of `n_layers` layers into `pp` non-empty stages, in lexicographic order
    (there are C(n_layers - 1, pp - 1) of them)."""
    for cuts in itertools.combinations(range(1, n_layers), pp - 1):
        bounds = (0, *cuts, n_layers)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(pp))


def count_compositions(n_layers: int, pp: int) -> int:
    """C(n_layers - 1, pp - 1): how many splits `compositions` yields."""
    return math.comb(n_layers - 1, pp - 1) if 1 <= pp <= n_layers else 0


def balanced_counts(
    n_layers: int, layer_cost: Sequence[float], fixed_cost: Sequence[float]
) -> tuple[int, ...]:
    """Layer counts l_s >= 1, sum l_s = n_layers, minimising max_s fixed_cost[s] + l_s *
    layer_cost[s] (stage s's time: its non-layer units plus its layers on its GPUs).

    Exact: starting from one layer each, every further layer goes to the stage whose time
    grows least (a min-max of increasing linear costs is solved by this greedy); ties go to
    the earlier stage, so the result is deterministic."""
    pp = len(layer_cost)
    if not 1 <= pp <= n_layers or len(fixed_cost) != pp:
        raise ValueError(f"cannot split {n_layers} layers over {pp} stages")
    counts = [1] * pp
    inv = [1.0 / c if c > 0 else 0.0 for c in layer_cost]
    if all(inv):
        # Start below the optimum: the continuous balance point T (sum_s (T - f_s) / a_s = L),
        # minus one layer per stage; the greedy then places the rest (at most ~2 pp layers).
        t = (n_layers + sum(f * i for f, i in zip(fixed_cost, inv))) / sum(inv)
        start = [max(1, math.floor((t - f) * i) - 1) for f, i in zip(fixed_cost, inv)]
        if sum(start) <= n_layers:
            counts = start
    heap = [(fixed_cost[s] + (counts[s] + 1) * layer_cost[s], s) for s in range(pp)]
    heapq.heapify(heap)
    for _ in range(n_layers - sum(counts)):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        heapq.heappush(heap, (fixed_cost[s] + (counts[s] + 1) * layer_cost[s], s))
    return tuple(counts)


def _spanning_stages(
    cluster: Cluster, tp: int, cp: int, dp: int, ranges: Sequence[tuple[int, int]]
) -> tuple[StagePlacement, ...] | None:
    """The stages of dp replicas each whose cp groups span device groups, when no group
    holds a stage's dp replicas whole but the cluster holds the pp stages with each replica's
    cp ranks taken group by group (tp GPUs per cp rank, each group giving every replica of
    every stage the same count, so cp rank r of each stage is in one group); None otherwise."""
    pp = len(ranges)
    if sum(replica_capacity(g, tp, cp) for g in cluster.groups) >= dp * pp:
        return None
    split, left = [], cp
    for g in cluster.groups:
        if left == 0:
            break
        if tp_domain_problem((g,), tp) is not None:
            continue
        take = min(left, g.num_gpus // (tp * dp * pp))
        if take:
            split.append((g.name, take))
            left -= take
    if left or len(split) < 2:
        return None
    return tuple(
        StagePlacement(s, first, last, ((split[0][0], dp),), cp_groups=tuple(split))
        for s, (first, last) in enumerate(ranges)
    )


def place_stages(
    cluster: Cluster, parallel: Parallel, ranges: Sequence[tuple[int, int]]
) -> tuple[StagePlacement, ...]:
    """Default placement: fill GPUs in rank order, stage by stage, each stage's dp replicas of
    tp*cp GPUs; a replica never straddles two device groups and a TP group never straddles
    two NVLink domains (nodes; groups whose domain size tp does not divide are skipped,
    `tp_domain_problem`; elsewhere replicas start at multiples of tp).

    On a mixed cluster this puts stage 0 on the first group, and so on. Raises ValueError when
    tp*pp*cp*dp exceeds the world size, tp divides no group's domain (gpus_per_node unless
    nvlink_domain is set), or the replicas do not fit the groups whole.

    One exception: with cp > 1 and replicas that fit no group whole, every replica's cp
    group spans the groups (`StagePlacement.cp_groups`, HexiSeq's setting): each group gives
    each replica of every stage as many cp ranks as its GPUs allow, in group order
    (`_spanning_stages`).
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
    if (why := tp_domain_problem(cluster.groups, tp)) is not None:
        raise ValueError(why)
    if cp > 1 and (span := _spanning_stages(cluster, tp, cp, dp, ranges)):
        return span
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
