"""A stage layout given by the user: price someone else's plan (`meshplan estimate --layout`).

Another planner's plan (Sailor, Metis, AMP) or a hand-written one is a list of pipeline
stages, each with its layers, its data-parallel replicas per device group and each group's
tensor-parallel degree. A layout file says exactly that (YAML or JSON):

    stages:
      - layers: 7                  # layer units of the model; the embedding goes with the
        replicas: {v100: 9}        # first stage, the LM head and loss with the last
        tp: {v100: 4}              # per group; omitted groups run at tp 1
      - layers: 5
        replicas: {a100: 3, v100: 6}
        tp: {a100: 1, v100: 4}

`stages_from_layout` turns it into `StagePlacement`s (`passes.partition.stages_of` places
the non-layer units); the `Parallel` it implies has pp = the number of stages, dp = the
replicas of every stage (equal on each), tp = the first stage's first group's degree, ZeRO-0.
Errors name the stage and the field and say what to do, in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

from meshplan.ir import Cluster, Graph, Parallel, StagePlacement
from meshplan.passes.partition import stages_of


class LayoutError(ValueError):
    """A layout file or list that does not describe a stage layout."""


def read_layout(path: str | Path) -> list[dict]:
    """The stage list of a layout file (YAML or JSON with a top-level `stages` list)."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except OSError as e:
        raise LayoutError(f"{p}: cannot read the layout file ({e.strerror})") from None
    except yaml.YAMLError as e:
        raise LayoutError(f"{p}: not valid YAML or JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, Mapping) or not isinstance(data.get("stages"), list):
        raise LayoutError(f"{p}: needs a top-level 'stages' list (see `meshplan estimate --help`)")
    unknown = sorted(set(data) - {"stages"})
    if unknown:
        raise LayoutError(f"{p}: unknown top-level field {unknown[0]!r}; only 'stages' is read")
    return list(data["stages"])


def _counts(where: str, field: str, value: object, groups: set[str]) -> dict[str, int]:
    if not isinstance(value, Mapping) or not value:
        raise LayoutError(f"{where}: field {field} must map device groups to counts")
    out = {}
    for g, n in value.items():
        if str(g) not in groups:
            raise LayoutError(
                f"{where}: field {field}: no device group {g!r} in the cluster "
                f"(groups: {', '.join(sorted(groups))})"
            )
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LayoutError(f"{where}: field {field}.{g} must be a positive integer, got {n!r}")
        out[str(g)] = n
    return out


def stages_from_layout(
    graph: Graph, cluster: Cluster, stages: Sequence[Mapping]
) -> tuple[dict, tuple[StagePlacement, ...]]:
    """(the `Parallel` fields the layout implies, its `StagePlacement`s). Raises LayoutError."""
    if not stages:
        raise LayoutError("layout: the stage list is empty")
    groups = {g.name for g in cluster.groups}
    order = [g.name for g in cluster.groups]
    layers, reps, tps = [], [], []
    for i, st in enumerate(stages):
        where = f"layout stage {i}"
        if not isinstance(st, Mapping):
            raise LayoutError(f"{where}: must be a mapping with layers, replicas and tp")
        extra = sorted(set(st) - {"layers", "replicas", "tp"})
        if extra:
            raise LayoutError(f"{where}: unknown field {extra[0]!r} (layers, replicas, tp)")
        n = st.get("layers")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise LayoutError(f"{where}: field layers must be a positive integer, got {n!r}")
        r = _counts(where, "replicas", st.get("replicas"), groups)
        t = _counts(where, "tp", st.get("tp") or {g: 1 for g in r}, groups)
        missing = sorted(set(t) ^ set(r))
        if missing:
            raise LayoutError(
                f"{where}: field tp names group {missing[0]!r} but replicas does not, or the "
                "other way round; give each group of replicas its degree"
            )
        layers.append(n)
        reps.append(r)
        tps.append(t)
    dp = sum(reps[0].values())
    for i, r in enumerate(reps):
        if sum(r.values()) != dp:
            raise LayoutError(
                f"layout stage {i}: field replicas adds up to {sum(r.values())}, stage 0's to "
                f"{dp}; every stage needs the same number of replicas (one per pipeline)"
            )
    try:
        ranges = stages_of(graph, layers)
    except ValueError as e:
        raise LayoutError(f"layout: field layers: {e}") from None
    out = []
    for i, ((a, b), r, t) in enumerate(zip(ranges, reps, tps, strict=True)):
        placed = tuple((g, r[g]) for g in order if g in r)
        out.append(StagePlacement(i, a, b, placed, group_tp=tuple((g, t[g]) for g, _ in placed)))
    first = out[0]
    fields = dict(pp=len(out), dp=dp, tp=dict(first.group_tp)[first.replicas[0][0]], zero=0)
    return fields, tuple(out)


def layout_parallel(base: Parallel, fields: Mapping) -> Parallel:
    """`base` (the user's pins) with the layout's degrees; a pin that contradicts the layout
    is an error naming it."""
    for k, v in fields.items():
        pinned = getattr(base, k)
        if pinned is not None and pinned != v:
            raise LayoutError(f"--{k.replace('_', '-')} {pinned} contradicts the layout ({k}={v})")
    return dataclasses.replace(base, **fields)
