"""The execution plan: the contract between the planner and the runtime (plan JSON v1).

A `Plan` says how one model trains on one cluster: the parallel degrees, which units each
pipeline stage runs and on which device groups, which global rank plays which mesh
coordinates, the schedule, recomputation, ZeRO stage, quantization and compression decisions
(all off in v1 unless stated), and what the cost model predicts for it.

JSON form (keys sorted, 2-space indent, trailing newline; identical inputs give identical
bytes, so the solver's wall time is deliberately not recorded):

    {
      "version": "meshplan.plan/v1",
      "meshplan_version": "0.1.0",
      "model": {"name", "fingerprint", "num_params", "units": [unit names], "seq_len", ...},
      "cluster": {"name", "fingerprint", "world_size", "spec": <cluster as Cluster.load reads>},
      "degrees": {"dp", "tp", "pp", "cp", "ep"},
      "mesh": {"axes": ["pp", "dp", "cp", "tp"], "shape": [...]},
      "ranks": [[rank, node, local_rank, group, pp, dp, cp, tp] or [rank, node, local, group] idle],
      "stages": [{"index", "first_unit", "last_unit", "units": [first, last name], "replicas",
                  "microbatches", "chunks", "tp" (per-group tp degrees, [] = degrees.tp)}],
      "schedule", "micro_batch", "global_batch", "num_microbatches", "recompute", "zero",
      "sequence_parallel", "virtual_stages" (interleaved 1F1B chunks per rank, or null),
      "cp_mode" (with cp > 1: allgather, ring, heads or usp; absent reads as allgather),
      "cp_head_degree" (under usp: the head-parallel ranks of a cp group),
      "placements", "quantization", "compression", "precision" (fp32, tf32, bf16, fp16, fp8),
      "predicted": {"step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes", "fits",
                    "breakdown": {...}, "memory": [...]},
      "solver": {"status", "gap", "candidates", "objective"},
      "digests": {field: 12 hex digits of sha256 of its JSON, for every field but version,
                  meshplan_version, predicted and solver; model and degrees key by key}
    }

A plan file means what it says or is refused. Loading (`Plan.from_json`, and so `meshplan
validate` and `meshplan launch`) refuses, each with a one-line `PlanError` naming the field:
an unknown version, a corrupt file, a schema violation (integers are ints: 2.0 is not a
count), a cluster spec that does not match its fingerprint (or, when a cluster is given, a
cluster mismatch), a restated fact that disagrees with what it restates (cluster.world_size,
mesh.shape from the degrees, num_microbatches, each stage's unit names), a broken rule
(`plan_problem`: stages, batch arithmetic, schedule, per-group TP, blocked dimensions, ranks
against `assign_ranks`, the model fingerprint's form), and a field whose digest differs: the
plan's prediction and checks were made for the values it was written with, so an edit is
refused rather than run with a stale prediction. Plans written before digests load without
that last check. "predicted", "solver" and "meshplan_version" are free: the runtime never
reads them.

`write_text_file` is how plans (and other output files) are written: atomically for
regular files, in place for devices and FIFOs, with the umask's permissions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .cluster import Cluster
from .devices import HYBRID_PEAKS, PRECISIONS, precision_problem
from .files import PlanError, write_text_file
from .parallel import (
    CP_MODES,
    Parallel,
    Prediction,
    RankMemory,
    Recompute,
    Schedule,
    StagePlacement,
    cp_span_problem,
    group_tp_problem,
)
from .rules import (
    batch_split_problem,
    cp_head_degree_problem,
    cp_split_problem,
    ep_dp_problem,
    microbatch_problem,
    schedule_problem,
)

PLAN_VERSION = "meshplan.plan/v1"
MESH_AXES = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True, slots=True)
class RankAssignment:
    """Global rank -> machine position and mesh coordinates (None coords: rank is idle)."""

    rank: int
    node: int
    local_rank: int
    group: str
    coords: tuple[int, int, int, int] | None  # (pp, dp, cp, tp)


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The model a plan is for. `blockers`: (dimension, reason) for every parallel dimension
    the runtime cannot run on it (`ModelInfo.blockers`, `ir.facts`), so that a plan edited
    by hand to use one is refused by `runtime.check_plan` before launch."""

    name: str
    fingerprint: str
    num_params: int
    units: tuple[str, ...]
    seq_len: int
    dtype: str = "bfloat16"
    blockers: tuple[tuple[str, str], ...] = ()
    positions: tuple[str, ...] = ()  # module paths of learned position tables (`ir.facts`)
    # The model's (first) input as traced: dtype and shape of one sample (no batch dim). The
    # runtime exports models it cuts from their graph with it (`runtime.graph_stages`).
    input: tuple[str, tuple[int, ...]] | None = None

    def blocker(self, dim: str) -> str:
        """Why dimension `dim` cannot run on the model, or "" (as `ModelInfo.blocker`)."""
        return dict(self.blockers).get(dim, "")


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: str  # "optimal", "feasible", "fixed" (estimate of a user-given configuration)
    gap: float  # relative gap between the plan's objective and the solver's proven bound
    candidates: int  # configurations priced
    objective: str = "throughput"


# `explain` suggests a larger budget when a plan's proven gap is at least this (session 31:
# Llama 3 70B on 32 A100-40GB + 32 V100-16GB + 32 T4 over 25 GbE, gap 98.6% at the default
# budget, is 46x faster at `--time-limit 60`).
UNPROVEN_GAP_HINT = 0.10

COMM_METHODS = ("raw", "lossless", "int8")
_DECISION_KEYS = ("group", "collective", "tensor", "method", "raw_s", "lossless_s", "int8_s")
_DECISION_KEYS += ("ratio", "chunks", "reason")
_DECISION_TEXT = ("group", "collective", "tensor", "reason")


@dataclass(frozen=True, slots=True)
class CommDecision:
    """How one collective group's traffic travels and why (`cost_model.compression`).

    `group` names where it runs ("dp stage 0 in h100", "dp stage 0 across a+b",
    "pp boundary 0 a->b", "tp in h100", "cp in h100", "ep in h100"); `method` is "raw",
    "lossless" (ZipCCL-style coding, bit-exact) or "int8" (AGoQ block-scaled gradients);
    times are the predicted seconds of one occurrence for each method (None: not allowed);
    `ratio` and `chunks` those of the chosen method (the runtime pipelines that many chunks)."""

    group: str
    collective: str
    tensor: str
    method: str
    raw_s: float
    lossless_s: float | None
    int8_s: float | None
    ratio: float = 1.0
    chunks: int = 1
    reason: str = ""

    def __post_init__(self) -> None:
        if self.method not in COMM_METHODS:
            raise PlanError(f"plan: compression method must be one of {COMM_METHODS}")


@dataclass(frozen=True, slots=True)
class CompressionPlan:
    """Traffic decisions of a plan: `mode` "off" (raw everywhere, plan JSON v1's default) or
    "auto" (each collective at its fastest allowed method); `codec` the codec speed assumed."""

    mode: str = "off"
    codec: str = ""
    decisions: tuple[CommDecision, ...] = ()


@dataclass(frozen=True, slots=True)
class QuantizationPlan:
    """Numerics-changing decisions (off unless the user enabled them).

    `mode`: "off", "auto", "activations" or "gradients" (what the planner was allowed).
    `activation_bits`: per pipeline stage, (layer kind, bits or None = exact) pairs; empty
    when activations are kept exact. `gradient_bits`: 8 when some data-parallel gradient
    reduction runs int8 (see the "int8" entries of the compression decisions), else None.
    `error`: (bits, relative RMS error of block quantization of a Gaussian) pairs."""

    mode: str = "off"
    activation_bits: tuple[tuple[int, tuple[tuple[str, int | None], ...]], ...] = ()
    gradient_bits: int | None = None
    error: tuple[tuple[int, float], ...] = ()
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Plan:
    """A complete, placed, predicted parallel configuration."""

    model: ModelRef
    cluster: Cluster
    parallel: Parallel
    stages: tuple[StagePlacement, ...]
    ranks: tuple[RankAssignment, ...]
    predicted: Prediction
    solver: SolverInfo
    placements: tuple[tuple[str, str], ...] = ()  # (block/op, placement string) pairs
    version: str = PLAN_VERSION
    compression: CompressionPlan = CompressionPlan()
    quantization: QuantizationPlan = QuantizationPlan()
    # The training precision (`ir.cluster.PRECISIONS`: fp32, tf32, bf16, fp16, fp8) the plan
    # was priced in and the runtime applies; "" in plans written before it was recorded.
    precision: str = ""
    # Per-group precision (QSync; `cost_model.engine.Engine.hybrid`): (device group, "int8" |
    # "fp8") pairs whose replicas run the forward GEMMs of the transformer blocks' linears in
    # that precision, priced so and applied by the runtime to those ranks only
    # (`runtime.hybrid_precision`); backward and gradients stay full precision. () = none.
    hybrid_precision: tuple[tuple[str, str], ...] = ()
    # Which linears of the repeated units it lowers, by path inside the unit ("mlp.up_proj";
    # `cost_model.engine.Engine.hybrid_linears`); () = every one.
    hybrid_linears: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.parallel.is_complete:
            missing = [k for k in _PARALLEL_KEYS if getattr(self.parallel, k) is None]
            raise PlanError(f"plan: parallel configuration incomplete, missing {missing}")
        if len(self.stages) != self.parallel.pp:
            raise PlanError(f"plan: {len(self.stages)} stages but pp={self.parallel.pp}")

    # -- derived ------------------------------------------------------------------------------
    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        p = self.parallel
        return (p.pp or 1, p.dp or 1, p.cp or 1, p.tp or 1)

    @property
    def world_size(self) -> int:
        """GPUs the plan uses (may be fewer than the cluster has)."""
        return sum(1 for r in self.ranks if r.coords is not None)

    # -- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan's JSON form (module docstring), with the `digests` of its fields."""
        p, pr = self.parallel, self.predicted
        d = {
            "version": self.version,
            "meshplan_version": _meshplan_version(),
            "model": {
                "name": self.model.name,
                "fingerprint": self.model.fingerprint,
                "num_params": self.model.num_params,
                "units": list(self.model.units),
                "seq_len": self.model.seq_len,
                "dtype": self.model.dtype,
                **({"blockers": dict(self.model.blockers)} if self.model.blockers else {}),
                **({"positions": list(self.model.positions)} if self.model.positions else {}),
                **(
                    {"input": {"dtype": self.model.input[0], "shape": list(self.model.input[1])}}
                    if self.model.input
                    else {}
                ),
            },
            "cluster": {
                "name": self.cluster.name,
                "fingerprint": self.cluster.fingerprint(),
                "world_size": self.cluster.world_size,
                "spec": self.cluster.to_dict(),
            },
            "degrees": {"dp": p.dp, "tp": p.tp, "pp": p.pp, "cp": p.cp, "ep": p.ep},
            "mesh": {"axes": list(MESH_AXES), "shape": list(self.mesh_shape)},
            "ranks": [
                [r.rank, r.node, r.local_rank, r.group, *r.coords]
                if r.coords is not None
                else [r.rank, r.node, r.local_rank, r.group]
                for r in self.ranks
            ],
            "stages": [
                {
                    "index": s.index,
                    "first_unit": s.first_unit,
                    "last_unit": s.last_unit,
                    "units": [self.model.units[s.first_unit], self.model.units[s.last_unit - 1]],
                    "replicas": [{"group": g, "count": n} for g, n in s.replicas],
                    # micro-batches per replica by group; [] = the same on every replica
                    "microbatches": [[g, n] for g, n in s.microbatches],
                    # unit ranges of the chunks this rank runs (interleaved 1F1B, ZB-V); [] = one
                    "chunks": [[a, b] for a, b in s.chunks],
                    # tp degree by group (group-pure pipelines); [] = degrees.tp everywhere
                    "tp": [[g, t] for g, t in s.group_tp],
                    # cp ranks of each replica per group when its cp group spans groups
                    **({"cp_groups": [[g, c] for g, c in s.cp_groups]} if s.cp_groups else {}),
                }
                for s in self.stages
            ],
            "schedule": str(p.schedule),
            "micro_batch": p.micro_batch,
            "global_batch": p.global_batch,
            "num_microbatches": p.num_microbatches,
            "recompute": str(p.recompute),
            "zero": p.zero,
            "sequence_parallel": p.sequence_parallel,
            "virtual_stages": p.virtual_stages,
            # how CP attention exchanges the sequence; only with cp > 1 (absent: allgather)
            **({"cp_mode": p.cp_mode} if (p.cp or 1) > 1 and p.cp_mode else {}),
            # asymmetric CP (HexiSeq): tokens / query heads per cp rank; only when set
            **({"cp_shares": list(p.cp_shares)} if p.cp_shares else {}),
            **({"cp_head_shares": list(p.cp_head_shares)} if p.cp_head_shares else {}),
            # under "usp": the head-parallel ranks inside each cp group
            **({"cp_head_degree": p.cp_head_degree} if p.cp_head_degree else {}),
            "placements": {k: v for k, v in self.placements},
            # v1 records the decisions explicitly even while they are always off.
            # "none" when off: the v1 form, so plans without these decisions read as before.
            "quantization": _quantization_json(self.quantization),
            "compression": _compression_json(self.compression),
            **({"precision": self.precision} if self.precision else {}),
            **({"hybrid_precision": dict(self.hybrid_precision)} if self.hybrid_precision else {}),
            **({"hybrid_linears": list(self.hybrid_linears)} if self.hybrid_linears else {}),
            "predicted": {
                "step_time_s": pr.step_time_s,
                "tokens_per_s": pr.tokens_per_s,
                "mfu": pr.mfu,
                "model_flops_per_step": pr.model_flops_per_step,
                "peak_memory_bytes": pr.peak_memory_bytes,
                "fits": pr.fits,
                "breakdown": {k: v for k, v in pr.breakdown},
                "memory": [
                    {
                        "stage": m.stage,
                        "group": m.group,
                        "peak_bytes": m.peak_bytes,
                        "capacity_bytes": m.capacity_bytes,
                        "breakdown": {k: v for k, v in m.breakdown},
                    }
                    for m in pr.memory
                ],
                "notes": list(pr.notes),
            },
            "solver": {
                "status": self.solver.status,
                "gap": self.solver.gap,
                "candidates": self.solver.candidates,
                "objective": self.solver.objective,
            },
        }
        d["digests"] = _digests(d)
        return d

    def to_json(self, path: str | os.PathLike | None = None) -> str:
        """The plan as canonical JSON text; with `path`, also written there atomically."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        if path is not None:
            write_text_file(path, text)
        return text

    @classmethod
    def from_json(cls, source: str | os.PathLike, cluster: Cluster | None = None) -> Plan:
        """Load a plan from a path or a JSON string; validates it (see module docstring)."""
        where = "plan"
        text: str
        if isinstance(source, os.PathLike) or (
            isinstance(source, str) and not source.lstrip().startswith("{")
        ):
            path = Path(source)
            where = str(path)
            try:
                text = path.read_text()
            except OSError as e:
                raise PlanError(f"{where}: cannot read plan file ({e.strerror})") from None
        else:
            text = str(source)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(
                f"{where}: not valid JSON (line {e.lineno}: {e.msg}); the file is corrupt, "
                "re-run `meshplan plan -o ...`"
            ) from None
        return plan_from_dict(data, where=where, cluster=cluster)

    # -- human view ---------------------------------------------------------------------------
    def explain(self) -> str:
        """A readable account: mesh, stages, per-rank memory, step time and its breakdown."""
        p, pr = self.parallel, self.predicted
        gib = 1024**3
        cp_mode = f" ({p.cp_mode or 'allgather'} attention)" if (p.cp or 1) > 1 else ""
        if p.cp_shares:
            cp_mode += f" tokens per cp rank {list(p.cp_shares)}"
        if p.cp_head_shares:
            cp_mode += f" heads per cp rank {list(p.cp_head_shares)}"
        if p.cp_head_degree:
            cp_mode = (
                f" (usp attention: heads over {p.cp_head_degree} ranks, K/V all-gathered "
                f"over {(p.cp or 1) // p.cp_head_degree})"
            )
        lines = [
            f"Plan for {self.model.name} ({self.model.num_params / 1e9:.2f}B params) on "
            f"{self.cluster.name} ({self.world_size} of {self.cluster.world_size} GPUs)",
            f"  degrees: dp={p.dp} tp={_tp_text(p.tp, self.stages)} pp={p.pp} cp={p.cp}{cp_mode} "
            f"ep={p.ep}; mesh {dict(zip(MESH_AXES, self.mesh_shape))}"
            + (" (the first group's; each group has its own)" if self.stages[0].group_tp else ""),
            f"  batch: global {p.global_batch} = dp {p.dp} x micro-batch {p.micro_batch} x "
            f"{p.num_microbatches} micro-batches; schedule {p.schedule}"
            f"{f' ({p.chunks} chunks per rank)' if p.chunks > 1 else ''}; recompute "
            f"{p.recompute}; ZeRO-{p.zero}; "
            f"sequence parallel {'on' if p.sequence_parallel else 'off'}"
            f"{f'; precision {self.precision}' if self.precision else ''}"
            + (
                "; per-group precision "
                + ", ".join(f"{g} {m} linears" for g, m in self.hybrid_precision)
                + (f" ({', '.join(self.hybrid_linears)})" if self.hybrid_linears else "")
                if self.hybrid_precision
                else ""
            ),
            "  stages:",
        ]
        for s in self.stages:
            where = ", ".join(f"{n}x {g}" for g, n in s.replicas)
            if s.microbatches:
                where += (
                    " (micro-batches per replica: "
                    + ", ".join(f"{g} {n}" for g, n in s.microbatches)
                    + ")"
                )
            if s.group_tp:
                where += " (tp per group: " + ", ".join(f"{g} {t}" for g, t in s.group_tp) + ")"
            if s.cp_groups:  # each replica's cp group spans device groups
                where = "cp groups spanning " + " + ".join(
                    f"{c} cp ranks of {g}" for g, c in s.cp_groups
                )
            if s.chunks:
                held = "chunks " + ", ".join(
                    f"{self.model.units[a]} .. {self.model.units[b - 1]}" for a, b in s.chunks
                )
            else:
                held = (
                    f"units {s.first_unit}..{s.last_unit - 1} "
                    f"({self.model.units[s.first_unit]} .. {self.model.units[s.last_unit - 1]})"
                )
            lines.append(f"    stage {s.index}: {held}, {s.dp} replica(s) on {where}")
        for dim, why in self.model.blockers:
            lines.append(f"  not planned on this model: {dim} ({why})")
        lines.append("  memory per rank (peak / capacity):")
        for m in pr.memory:
            parts = ", ".join(f"{k} {v / gib:.1f}" for k, v in m.breakdown if v)
            lines.append(
                f"    stage {m.stage} on {m.group}: {m.peak_bytes / gib:.1f} / "
                f"{m.capacity_bytes / gib:.1f} GiB ({parts})"
            )
        lines.append(
            f"  predicted: step {pr.step_time_s:.3f} s, {pr.tokens_per_s:,.0f} tokens/s, "
            f"MFU {pr.mfu * 100:.1f}%, fits={'yes' if pr.fits else 'NO'}"
        )
        total = pr.step_time_s or 1.0
        for k, v in pr.breakdown:
            lines.append(f"    {k:<18} {v:9.4f} s  {100 * v / total:5.1f}%")
        lines += _explain_decisions(self.compression, self.quantization)
        for note in pr.notes:
            lines.append(f"  note: {note}")
        lines.append(
            f"  solver: {self.solver.status}, gap {self.solver.gap * 100:.2f}%, "
            f"{self.solver.candidates} configurations priced"
        )
        if self.solver.status == "feasible" and self.solver.gap >= UNPROVEN_GAP_HINT:
            lines.append(
                "  note: not proven optimal: the best plan may take as little as "
                f"{1 - self.solver.gap:.0%} of this step time; a larger --time-limit "
                "(time_limit_s) searches further"
            )
        return "\n".join(lines)


def _tp_text(tp: int | None, stages: tuple[StagePlacement, ...]) -> str:
    """`8`, or under per-group TP `a100 4 / h100 2`."""
    group_tp = stages[0].group_tp if stages else ()
    return " / ".join(f"{g} {t}" for g, t in group_tp) if group_tp else str(tp)


_PARALLEL_KEYS = (
    "dp",
    "tp",
    "pp",
    "cp",
    "ep",
    "micro_batch",
    "global_batch",
    "recompute",
    "zero",
    "schedule",
    "sequence_parallel",
)


def _meshplan_version() -> str:
    try:
        from importlib.metadata import version

        return version("meshplan")
    except Exception:  # not installed (e.g. running from a source tree)
        return "0.0.0"


# -- rank assignment ----------------------------------------------------------------------------


def assign_ranks(
    cluster: Cluster, parallel: Parallel, stages: tuple[StagePlacement, ...]
) -> tuple[RankAssignment, ...]:
    """Give every GPU its mesh coordinates (pp, dp, cp, tp).

    Each group's GPUs are handed out in rank order: stage by stage, replica by replica, a
    replica taking tp*cp consecutive GPUs (so TP groups stay inside a node, or NVLink domain,
    whenever tp divides its GPU count, `DeviceGroup.domain_gpus`; tp is the group's own under
    per-group TP, `StagePlacement.group_tp`). DP indices are numbered across groups in
    stage-placement order. GPUs left over are idle (coords None).
    """
    cp = parallel.cp or 1
    free: dict[str, list] = {g.name: [] for g in cluster.groups}
    for r in cluster.ranks():
        free[r.group].append(r)
    cursor = {g: 0 for g in free}
    coords: dict[int, tuple[int, int, int, int]] = {}
    for stage in stages:
        if stage.cp_groups:  # each replica's cp ranks from several groups, in cp order
            tp = parallel.tp or 1
            for dp_index in range(stage.dp):
                cp_at = 0
                for group, c in stage.cp_groups:
                    if group not in free:
                        raise PlanError(
                            f"plan: stage {stage.index} names unknown device group {group!r}"
                        )
                    start = cursor[group]
                    block = free[group][start : start + tp * c]
                    if len(block) < tp * c:
                        raise PlanError(
                            f"plan: stage {stage.index} needs more GPUs of group {group!r} than "
                            f"the cluster has ({len(free[group])})"
                        )
                    cursor[group] += tp * c
                    for i, info in enumerate(block):
                        coords[info.rank] = (stage.index, dp_index, cp_at + i // tp, i % tp)
                    cp_at += c
            continue
        dp_index = 0
        for group, count in stage.replicas:
            if group not in free:
                raise PlanError(f"plan: stage {stage.index} names unknown device group {group!r}")
            tp = stage.tp_of(group, parallel.tp or 1)
            per_replica = tp * cp
            for _ in range(count):
                start = cursor[group]
                block = free[group][start : start + per_replica]
                if len(block) < per_replica:
                    raise PlanError(
                        f"plan: stage {stage.index} needs more GPUs of group {group!r} than the "
                        f"cluster has ({len(free[group])})"
                    )
                cursor[group] += per_replica
                for i, info in enumerate(block):
                    coords[info.rank] = (stage.index, dp_index, i // tp, i % tp)
                dp_index += 1
    return tuple(
        RankAssignment(r.rank, r.node, r.local_rank, r.group, coords.get(r.rank))
        for r in cluster.ranks()
    )


# -- loading ----------------------------------------------------------------------------------

_POS_INT = {"type": "integer", "minimum": 1}
_NAT = {"type": "integer", "minimum": 0}
_NUMBERS = {"type": "object", "additionalProperties": {"type": "number"}}
_PREDICTED_NUMBERS = ("step_time_s", "tokens_per_s", "mfu", "model_flops_per_step")
# [[group name, positive integer], ...]: per-group micro-batch shares and TP degrees
_GROUP_INTS = {
    "type": "array",
    "items": {
        "type": "array",
        "prefixItems": [{"type": "string"}, _POS_INT],
        "minItems": 2,
        "maxItems": 2,
    },
}
PLAN_SCHEMA: dict = {
    "type": "object",
    "required": [
        "version",
        "model",
        "cluster",
        "degrees",
        "mesh",
        "ranks",
        "stages",
        "schedule",
        "micro_batch",
        "global_batch",
        "recompute",
        "zero",
        "sequence_parallel",
        "predicted",
        "solver",
    ],
    "properties": {
        "version": {"type": "string"},
        "model": {
            "type": "object",
            "required": ["name", "fingerprint", "num_params", "units", "seq_len"],
            "properties": {
                "name": {"type": "string"},
                "fingerprint": {"type": "string"},
                "num_params": {"type": "integer", "minimum": 0},
                "units": {"type": "array", "items": {"type": "string"}, "minItems": 1},
                "seq_len": _POS_INT,
                "dtype": {"type": "string"},
                "positions": {"type": "array", "items": {"type": "string"}},
                "input": {
                    "type": "object",
                    "required": ["dtype", "shape"],
                    "additionalProperties": False,
                    "properties": {
                        "dtype": {"type": "string"},
                        "shape": {"type": "array", "items": {"type": "integer", "minimum": 1}},
                    },
                },
                "blockers": {
                    "type": "object",
                    "propertyNames": {"enum": ["tp", "sp", "cp", "pp", "ep", "zb"]},
                    "additionalProperties": {"type": "string", "minLength": 1},
                },
            },
        },
        "cluster": {
            "type": "object",
            "required": ["name", "fingerprint", "world_size", "spec"],
            "properties": {"world_size": _POS_INT, "spec": {"type": "object"}},
        },
        "degrees": {
            "type": "object",
            "required": ["dp", "tp", "pp", "cp", "ep"],
            "properties": {k: _POS_INT for k in ("dp", "tp", "pp", "cp", "ep")},
        },
        "mesh": {
            "type": "object",
            "required": ["axes", "shape"],
            "properties": {
                "axes": {"type": "array", "items": {"type": "string"}},
                "shape": {"type": "array", "items": _POS_INT},
            },
        },
        "ranks": {
            "type": "array",
            # [rank, node, local_rank, group] (idle) or that and [pp, dp, cp, tp]
            "items": {
                "type": "array",
                "minItems": 4,
                "maxItems": 8,
                "prefixItems": [_NAT, _NAT, _NAT, {"type": "string"}, _NAT, _NAT, _NAT, _NAT],
            },
        },
        "stages": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["index", "first_unit", "last_unit", "replicas"],
                "properties": {
                    "index": {"type": "integer", "minimum": 0},
                    "first_unit": {"type": "integer", "minimum": 0},
                    "last_unit": _POS_INT,
                    "replicas": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["group", "count"],
                            "properties": {"group": {"type": "string"}, "count": _POS_INT},
                        },
                    },
                    "microbatches": _GROUP_INTS,
                    "chunks": {
                        "type": "array",
                        "items": {
                            "type": "array",
                            "prefixItems": [{"type": "integer", "minimum": 0}, _POS_INT],
                            "minItems": 2,
                            "maxItems": 2,
                        },
                    },
                    "tp": _GROUP_INTS,
                    "cp_groups": _GROUP_INTS,
                },
            },
        },
        "schedule": {"enum": [s.value for s in Schedule]},
        "micro_batch": _POS_INT,
        "global_batch": _POS_INT,
        "recompute": {"enum": [r.value for r in Recompute]},
        "zero": {"type": "integer", "enum": [0, 1, 2, 3]},
        "sequence_parallel": {"type": "boolean"},
        "virtual_stages": {"type": ["integer", "null"], "minimum": 1},
        "cp_mode": {"enum": list(CP_MODES)},
        "cp_shares": {"type": "array", "items": _POS_INT, "minItems": 2},
        "cp_head_shares": {"type": "array", "items": _POS_INT, "minItems": 2},
        "cp_head_degree": {"type": "integer", "minimum": 2},
        "predicted": {
            "type": "object",
            "required": [
                "step_time_s",
                "tokens_per_s",
                "mfu",
                "peak_memory_bytes",
                "fits",
                "breakdown",
                "memory",
            ],
            "properties": {
                **{k: {"type": "number"} for k in _PREDICTED_NUMBERS},
                "peak_memory_bytes": _NAT,
                "fits": {"type": "boolean"},
                "breakdown": _NUMBERS,
                "memory": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["stage", "group", "peak_bytes", "capacity_bytes"],
                        "properties": {
                            "stage": _NAT,
                            "group": {"type": "string"},
                            "peak_bytes": _NAT,
                            "capacity_bytes": _NAT,
                            "breakdown": {"type": "object", "additionalProperties": _NAT},
                        },
                    },
                },
                "notes": {"type": "array", "items": {"type": "string"}},
            },
        },
        "precision": {"enum": list(PRECISIONS)},
        "hybrid_precision": {
            "type": "object",
            "description": "device group -> int8 or fp8 (the transformer blocks' linears)",
            "additionalProperties": {"enum": ["int8", "fp8"]},
        },
        "hybrid_linears": {
            "type": "array",
            "description": "the linears per-group precision lowers, by path inside a layer",
            "items": {"type": "string", "minLength": 1},
            "minItems": 1,
        },
        "solver": {
            "type": "object",
            "required": ["status", "gap", "candidates"],
            "properties": {
                "status": {"type": "string"},
                "gap": {"type": "number"},
                "candidates": _NAT,
                "objective": {"type": "string"},
            },
        },
        "placements": {"type": "object", "additionalProperties": {"type": "string"}},
        "num_microbatches": _NAT,  # derived: checked against the batch (`_derived_problem`)
        "meshplan_version": {"type": "string"},
        # Per-field digests of what the plan was made with (`_digests`); absent in old plans.
        "digests": {"type": "object", "additionalProperties": {"type": "string"}},
        # Optional (v1 plans written before these decisions say "none" or lack them).
        "quantization": {
            "type": "object",
            "properties": {
                "mode": {"enum": ["off", "auto", "activations", "gradients"]},
                "reason": {"type": "string"},
                "error": {
                    "type": "object",
                    "propertyNames": {"pattern": "^[0-9]+$"},
                    "additionalProperties": {"type": "number"},
                },
                "activations": {
                    "if": {"type": "string"},
                    "then": {"const": "none"},
                    "else": {
                        "type": "object",
                        "required": ["stages"],
                        "properties": {
                            "stages": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["stage", "bits"],
                                    "properties": {
                                        "stage": {"type": "integer", "minimum": 0},
                                        "bits": {
                                            "type": "object",
                                            "additionalProperties": {"enum": [4, 8, None]},
                                        },
                                    },
                                },
                            }
                        },
                    },
                },
                "gradients": {
                    "if": {"type": "string"},
                    "then": {"const": "none"},
                    "else": {"type": "object", "properties": {"bits": {"enum": [8]}}},
                },
            },
        },
        "compression": {
            "type": "object",
            "properties": {
                "mode": {"enum": ["off", "auto"]},
                "codec": {"type": "string"},
                "collectives": {
                    "if": {"type": "string"},
                    "then": {"const": "none"},
                    "else": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": list(_DECISION_KEYS),
                            "properties": {
                                **{k: {"type": "string"} for k in _DECISION_TEXT},
                                "method": {"enum": list(COMM_METHODS)},
                                "raw_s": {"type": "number", "minimum": 0},
                                "lossless_s": {"type": ["number", "null"]},
                                "int8_s": {"type": ["number", "null"]},
                                "ratio": {"type": "number", "minimum": 1},
                                "chunks": _POS_INT,
                            },
                        },
                    },
                },
            },
        },
    },
}


def _quantization_json(q: QuantizationPlan) -> dict:
    out: dict = {"activations": "none", "gradients": "none"}
    if q.mode != "off":
        out["mode"] = q.mode
        out["reason"] = q.reason
        out["error"] = {str(b): e for b, e in q.error}
    if q.activation_bits:
        out["activations"] = {
            "stages": [{"stage": s, "bits": dict(bits)} for s, bits in q.activation_bits]
        }
    if q.gradient_bits is not None:
        out["gradients"] = {"bits": q.gradient_bits}
    return out


def _quantization_from_json(d: dict | None) -> QuantizationPlan:
    if not d:
        return QuantizationPlan()
    acts = d.get("activations", "none")
    grads = d.get("gradients", "none")
    return QuantizationPlan(
        mode=d.get("mode", "off"),
        activation_bits=tuple(
            (st["stage"], tuple(sorted(st["bits"].items()))) for st in acts.get("stages", [])
        )
        if isinstance(acts, dict)
        else (),
        gradient_bits=grads.get("bits") if isinstance(grads, dict) else None,
        error=tuple(sorted((int(b), float(e)) for b, e in d.get("error", {}).items())),
        reason=d.get("reason", ""),
    )


def _compression_json(c: CompressionPlan) -> dict:
    if c.mode == "off" and not c.decisions:
        return {"collectives": "none"}
    return {
        "mode": c.mode,
        "codec": c.codec,
        "collectives": [{k: getattr(d, k) for k in _DECISION_KEYS} for d in c.decisions],
    }


def _compression_from_json(d: dict | None) -> CompressionPlan:
    if not d or d.get("collectives", "none") == "none":
        return CompressionPlan()
    return CompressionPlan(
        mode=d.get("mode", "auto"),
        codec=d.get("codec", ""),
        decisions=tuple(
            CommDecision(**{k: x[k] for k in _DECISION_KEYS}) for x in d["collectives"]
        ),
    )


def _explain_decisions(c: CompressionPlan, q: QuantizationPlan) -> list[str]:
    """The explain() lines of the compression and quantization decisions."""
    lines = []
    if c.mode != "off" or c.decisions:
        coded = sum(1 for d in c.decisions if d.method != "raw")
        lines.append(
            f"  compression ({c.mode}; codec {c.codec}): {coded} of {len(c.decisions)} "
            "collective groups coded"
        )
        for d in c.decisions:
            alt = [f"raw {d.raw_s * 1e3:.3f} ms"]
            if d.lossless_s is not None:
                alt.append(f"lossless {d.lossless_s * 1e3:.3f} ms")
            if d.int8_s is not None:
                alt.append(f"int8 {d.int8_s * 1e3:.3f} ms")
            how = d.method if d.method == "raw" else f"{d.method} {d.ratio:.2f}x, {d.chunks} chunks"
            lines.append(
                f"    {d.group}: {d.collective} of {d.tensor} -> {how} ({', '.join(alt)}): "
                f"{d.reason}"
            )
    if q.mode != "off":
        lines.append(f"  quantization ({q.mode}): {q.reason}")
        for s, bits in q.activation_bits:
            shown = ", ".join(f"{k} {b if b is not None else 'exact'}" for k, b in bits)
            lines.append(f"    stage {s} activation bits: {shown}")
        if q.gradient_bits is not None:
            lines.append(f"    gradients: int{q.gradient_bits} block-scaled where marked int8")
        if q.error:
            shown = ", ".join(f"{b}-bit {e * 100:.2f}%" for b, e in q.error)
            lines.append(f"    error proxy (relative RMS, Gaussian, 64-value blocks): {shown}")
    return lines


def _schema_error(data: dict, where: str) -> str | None:
    errors = sorted(
        _validator().iter_errors(data),
        key=lambda e: [(isinstance(p, str), p) for p in e.absolute_path],
    )
    if not errors:
        return None
    e = errors[0]
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
    message = e.message if len(e.message) <= 200 else e.message[:200] + "..."
    return f"{where}: field {field.lstrip('.') or '(top level)'}: {message}"


@functools.cache
def _validator():
    """The schema's validator, with "integer" meaning an int: JSON Schema also counts 2.0,
    which no count, degree or coordinate of a plan may be (nor a bool)."""
    import jsonschema

    base = jsonschema.Draft202012Validator
    checker = base.TYPE_CHECKER.redefine(
        "integer", lambda _, x: isinstance(x, int) and not isinstance(x, bool)
    )
    return jsonschema.validators.extend(base, type_checker=checker)(PLAN_SCHEMA)


# -- what a plan means: the rules every layer asks ---------------------------------------------


def stages_problem(
    parallel: Parallel, stages: tuple[StagePlacement, ...], n_units: int
) -> str | None:
    """What keeps `stages` from being the pipeline of `parallel` over a model of `n_units`
    units, or None: pp stages in order, covering units [0, n_units) in order without gaps or
    overlaps, each with replicas adding up to dp; chunk ranges (interleaved 1F1B, ZB-V) only
    where the schedule runs several chunks per rank, that many per stage, covering the units
    exactly once between them."""
    p = parallel
    if len(stages) != p.pp:
        return f"stages lists {len(stages)} stages but degrees.pp={p.pp}"
    expect = 0
    for i, st in enumerate(stages):
        if st.index != i:
            return f"stages[{i}].index is {st.index}; stages are listed in pipeline order"
        if st.first_unit != expect:
            before = f"stage {i - 1} ends at unit {expect}" if i else "the first starts at 0"
            return (
                f"stages[{i}].first_unit is {st.first_unit} but {before} (stages cover the "
                "units in order, without gaps or overlaps)"
            )
        if st.dp != p.dp:
            return f"stages[{i}].replicas add up to {st.dp} but degrees.dp={p.dp}"
        expect = st.last_unit
    if expect != n_units:
        return f"stages cover units [0, {expect}) but model.units lists {n_units}"
    listed = [st for st in stages if st.chunks]
    if listed:
        if p.pp < 2 or p.chunks < 2:
            return (
                f"stages[{listed[0].index}].chunks lists chunks but schedule {p.schedule} "
                f"with pp={p.pp} runs one per rank"
            )
        for st in stages:
            if len(st.chunks) != p.chunks:
                return (
                    f"stages[{st.index}].chunks lists {len(st.chunks)} chunks but schedule "
                    f"{p.schedule} runs {p.chunks} per rank"
                )
        covered = 0
        for a, b in sorted(c for st in stages for c in st.chunks):
            if a != covered:
                return f"stages' chunks do not cover the units exactly once (unit {covered})"
            covered = b
        if covered != n_units:
            return f"stages' chunks cover units [0, {covered}) of {n_units}"
    return None


def batch_problem(parallel: Parallel, stages: tuple[StagePlacement, ...]) -> str | None:
    """What keeps the batch arithmetic of `parallel` and `stages` from adding up, or None:
    global_batch = dp x micro_batch x num_microbatches; uneven micro-batch shares
    (`StagePlacement.microbatches`) the same on every stage and adding up to
    dp x num_microbatches; every replica's micro-batch count one its schedule runs
    (`microbatch_problem`)."""
    p = parallel
    if why := batch_split_problem(p.global_batch, p.dp, p.micro_batch):
        return why
    counts = {p.num_microbatches}
    if any(st.microbatches for st in stages):
        first = stages[0]
        for st in stages:
            if (st.replicas, dict(st.microbatches)) != (first.replicas, dict(first.microbatches)):
                return (
                    f"stages[{st.index}].microbatches differ from stage 0's; uneven shares need "
                    "every stage to have the same replicas and shares"
                )
        shares = dict(first.microbatches)
        total = sum(n * shares[g] for g, n in first.replicas)
        if total != p.dp * p.num_microbatches:
            return (
                f"stages[0].microbatches add up to {total} micro-batches but global_batch / "
                f"micro_batch = {p.global_batch} / {p.micro_batch} = "
                f"{p.dp * p.num_microbatches}"
            )
        counts = set(shares.values())
    for m in sorted(counts):
        if why := microbatch_problem(p.schedule, p.pp, m):
            return why
    return None


def ranks_problem(plan: Plan) -> str | None:
    """What keeps `plan.ranks` from being the rank assignment its cluster, degrees and stages
    give (`assign_ranks`: every GPU of the cluster once, in order, with its node, local rank
    and group; the dp x tp x pp x cp active ones at unique mesh coordinates), or None."""
    try:
        expected = assign_ranks(plan.cluster, plan.parallel, plan.stages)
    except PlanError as e:
        return str(e).removeprefix("plan: ")
    if len(plan.ranks) != len(expected):
        return f"ranks lists {len(plan.ranks)} GPUs but the cluster has {len(expected)}"
    for i, (got, want) in enumerate(zip(plan.ranks, expected)):
        if got != want:
            return (
                f"ranks[{i}] is {_rank_row(got)} but the cluster, degrees and stages give "
                f"{_rank_row(want)} ([rank, node, local_rank, group, pp, dp, cp, tp])"
            )
    return None


def _precision_problem(plan: Plan) -> str | None:
    if not plan.precision:
        return None
    why = precision_problem(plan.precision, [g.gpu for g in plan.cluster.groups])
    return f"precision: {why}" if why else None


def hybrid_problem(plan: Plan) -> str | None:
    """Why the plan's per-group precision cannot run, in one line, or None: a group the
    cluster lacks, a GPU without that precision's tensor cores, or a group whose replicas run
    tensor parallelism (the runtime's quantized linears take whole weights)."""
    groups = {g.name: g for g in plan.cluster.groups}
    if plan.hybrid_linears and not plan.hybrid_precision:
        return "hybrid_linears without hybrid_precision: name the groups to lower, or drop it"
    for group, mode in plan.hybrid_precision:
        where = f"hybrid_precision.{group}"
        if group not in groups:
            return f"{where}: no device group {group!r} in the cluster ({', '.join(groups)})"
        if mode not in HYBRID_PEAKS:
            return f"{where}: {mode!r} is not int8 or fp8"
        gpu = groups[group].gpu
        if HYBRID_PEAKS[mode] not in dict(gpu.peak_flops):
            return f"{where}: {gpu.name} has no {mode} tensor cores; use another mode or none"
        if (tp := group_tp_degree(plan.parallel, plan.stages, group)) > 1:
            return (
                f"{where}: the group's replicas run tp={tp}; per-group precision runs "
                "with tp 1 on that group only (the quantized linears take whole weights)"
            )
    return None


def group_tp_degree(parallel: Parallel, stages: tuple[StagePlacement, ...], group: str) -> int:
    """The widest TP degree `group`'s replicas run at in `stages`; 0 when none runs there."""
    return max(
        (st.tp_of(group, parallel.tp) for st in stages if any(g == group for g, _ in st.replicas)),
        default=0,
    )


def plan_problem(plan: Plan) -> str | None:
    """Why `plan` does not mean what it says, in one line naming the field, or None: its
    stages (`stages_problem`), batch arithmetic (`batch_problem`), schedule
    (`schedule_problem`), per-group TP (`group_tp_problem`), degrees (ep divides dp) and the
    dimensions its model cannot run (`ir.facts.blocked_dimension`), its ranks
    (`ranks_problem`), its precision on its GPUs (`cluster.precision_problem`) and the form
    of its model fingerprint. `Plan.from_json` refuses a plan
    with a problem, so `meshplan validate` and `meshplan launch` do."""
    from .facts import blocked_dimension

    p = plan.parallel
    if not _FINGERPRINT.fullmatch(plan.model.fingerprint):
        return (
            f"model.fingerprint {plan.model.fingerprint!r} is not a model fingerprint "
            "(16 lowercase hex digits)"
        )
    if why := ep_dp_problem(p.ep or 1, p.dp):
        return why
    tps = [t for st in plan.stages for _, t in st.group_tp]  # any stage may set its own
    widest = dataclasses.replace(p, tp=max([p.tp, *tps]))
    checks = (
        lambda: stages_problem(p, plan.stages, len(plan.model.units)),
        lambda: batch_problem(p, plan.stages),
        lambda: schedule_problem(p),
        lambda: cp_split_problem(p, plan.model.seq_len, 0),
        lambda: cp_head_degree_problem(p, 0),
        lambda: cp_span_problem(p, plan.stages),
        lambda: group_tp_problem(p, plan.stages) if tps else None,
        lambda: blocked_dimension(plan.model, widest),
        lambda: ranks_problem(plan),
        lambda: _precision_problem(plan),
        lambda: hybrid_problem(plan),
    )
    for check in checks:
        if why := check():
            return why
    return None


_FINGERPRINT = re.compile(r"[0-9a-f]{16}")


def _rank_row(r: RankAssignment) -> str:
    row = [r.rank, r.node, r.local_rank, r.group, *(r.coords or ())]
    return json.dumps(row, ensure_ascii=False)


# -- loading ----------------------------------------------------------------------------------

# Keys whose value the runtime never reads: free to differ (and to edit).
_FREE_KEYS = frozenset({"version", "meshplan_version", "predicted", "solver", "digests"})
_KEYED = ("model", "degrees")  # digested key by key, so an edit names its field


def _digests(d: dict) -> dict[str, str]:
    """A short hash of every field of plan JSON `d` but the free ones (`_FREE_KEYS`).

    A plan's prediction, its checks and its runtime behaviour are for the values it was made
    with; `plan_from_dict` recomputes the digests of what it loaded and refuses a field
    whose digest differs, naming it. (A guard against edits and corruption, not a signature:
    a deliberate edit rewrites the digest too.)"""
    out = {}
    for key, value in d.items():
        if key in _FREE_KEYS:
            continue
        fields = (
            {f"{key}.{k}": v for k, v in value.items()}
            if key in _KEYED and isinstance(value, dict)
            else {key: value}
        )
        for name, v in fields.items():
            out[name] = hashlib.sha256(json.dumps(v, sort_keys=True).encode()).hexdigest()[:12]
    return out


def _restated_problem(data: dict, plan: Plan) -> str | None:
    """Where the JSON restates a fact of `plan` (cluster.name and world_size, the mesh)
    differently, or None."""
    c, mesh = data["cluster"], data["mesh"]
    if c["name"] != plan.cluster.name:
        return f"cluster.name {c['name']!r} but cluster.spec names {plan.cluster.name!r}"
    if c["world_size"] != plan.cluster.world_size:
        return (
            f"cluster.world_size is {c['world_size']} but cluster.spec has "
            f"{plan.cluster.world_size} GPUs"
        )
    if mesh["axes"] != list(MESH_AXES):
        return f"mesh.axes is {mesh['axes']} but plans use {list(MESH_AXES)}"
    if mesh["shape"] != list(plan.mesh_shape):
        degrees = " ".join(f"{a}={n}" for a, n in zip(MESH_AXES, plan.mesh_shape))
        return f"mesh.shape is {mesh['shape']} but degrees give {list(plan.mesh_shape)} ({degrees})"
    return None


def _derived_problem(data: dict, plan: Plan) -> str | None:
    """Where the JSON's derived counts and names (num_microbatches, each stage's unit names)
    disagree with `plan` (checked once its batch and stages are known good), or None."""
    m = plan.parallel.num_microbatches
    if "num_microbatches" in data and data["num_microbatches"] != m:
        p = plan.parallel
        return (
            f"num_microbatches is {data['num_microbatches']} but global_batch / (dp x "
            f"micro_batch) = {p.global_batch} / ({p.dp} x {p.micro_batch}) = {m}"
        )
    units = plan.model.units
    for i, (st, raw) in enumerate(zip(plan.stages, data["stages"])):
        names = [units[st.first_unit], units[st.last_unit - 1]]
        if "units" in raw and raw["units"] != names:
            return (
                f"stages[{i}].units is {raw['units']} but its units {st.first_unit}.."
                f"{st.last_unit - 1} are {names}"
            )
    return None


def _digest_problem(data: dict, plan: Plan) -> str | None:
    """A field whose digest (`_digests`) differs from the one recorded, or None (and None
    for plans written before digests)."""
    recorded = data.get("digests")
    if recorded is None:
        return None
    expected = _digests(plan.to_dict())
    for key in sorted(set(recorded) | set(expected)):
        if key not in expected:
            return f"digests.{key} names no field of the plan"
        if recorded.get(key) != expected[key]:
            return (
                f"field {key} does not match what the plan was made with (digests.{key}); its "
                "prediction and checks are for the original: re-run `meshplan plan` or "
                "`meshplan estimate` for the configuration you want instead of editing"
            )
    return None


def plan_from_dict(data: object, *, where: str = "plan", cluster: Cluster | None = None) -> Plan:
    """Rebuild a Plan from its JSON dict, refusing with a one-line `PlanError` that names the
    field a plan that does not mean what it says: an unknown version, a schema violation, a
    cluster spec that does not match its fingerprint (or `cluster`), a restated fact that
    disagrees (`_restated_problem`, `_derived_problem`), a broken rule (`plan_problem`), or a
    field changed after the plan was made (`_digest_problem`)."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: a plan is a JSON object, got {type(data).__name__}")
    version = data.get("version")
    if version != PLAN_VERSION:
        raise PlanError(
            f"{where}: unsupported plan version {version!r} (this meshplan reads "
            f"{PLAN_VERSION}); re-run `meshplan plan` to regenerate it"
        )
    problem = _schema_error(data, where)
    if problem:
        raise PlanError(problem)
    from .cluster_io import cluster_from_dict  # local: cluster_io pulls in yaml

    try:
        plan_cluster = cluster_from_dict(data["cluster"]["spec"], source=f"{where}: cluster.spec")
    except ValueError as e:
        raise PlanError(str(e)) from None
    if plan_cluster.fingerprint() != data["cluster"]["fingerprint"]:
        raise PlanError(
            f"{where}: cluster.spec does not match its fingerprint (the file was edited or is "
            "corrupt); re-run `meshplan plan`"
        )
    if cluster is not None and cluster.fingerprint() != plan_cluster.fingerprint():
        raise PlanError(
            f"{where}: plan was made for cluster {plan_cluster.name!r} "
            f"({plan_cluster.world_size} GPUs, fingerprint {plan_cluster.fingerprint()}) but "
            f"this cluster is {cluster.name!r} ({cluster.world_size} GPUs, fingerprint "
            f"{cluster.fingerprint()}); re-plan for this cluster"
        )
    try:
        plan = _plan_of(data, plan_cluster)
    except PlanError as e:
        raise PlanError(f"{where}: {str(e).removeprefix('plan: ')}") from None
    except (ValueError, TypeError, KeyError) as e:  # a shape the schema lets through
        raise PlanError(f"{where}: malformed plan ({type(e).__name__}: {e})") from None
    for check in (_restated_problem, lambda _, p: plan_problem(p), _derived_problem):
        if why := check(data, plan):
            raise PlanError(f"{where}: {why}")
    if why := _digest_problem(data, plan):
        raise PlanError(f"{where}: {why}")
    return plan


def _plan_of(data: dict, plan_cluster: Cluster) -> Plan:
    """The Plan object a schema-valid plan dict describes (`plan_from_dict` checks it)."""
    d, m = data["degrees"], data["model"]
    try:
        parallel = Parallel(
            dp=d["dp"],
            tp=d["tp"],
            pp=d["pp"],
            cp=d["cp"],
            ep=d["ep"],
            micro_batch=data["micro_batch"],
            global_batch=data["global_batch"],
            recompute=Recompute(data["recompute"]),
            zero=data["zero"],
            schedule=Schedule(data["schedule"]),
            sequence_parallel=data["sequence_parallel"],
            virtual_stages=data.get("virtual_stages"),
            cp_mode=data.get("cp_mode"),
            cp_shares=tuple(data["cp_shares"]) if "cp_shares" in data else None,
            cp_head_shares=tuple(data["cp_head_shares"]) if "cp_head_shares" in data else None,
            cp_head_degree=data.get("cp_head_degree"),
            quantize_activations=(
                True
                if isinstance((data.get("quantization") or {}).get("activations"), dict)
                else None
            ),
        )
    except ValueError as e:
        raise PlanError(str(e).replace("Parallel.", "")) from None
    try:
        stages = tuple(
            StagePlacement(
                s["index"],
                s["first_unit"],
                s["last_unit"],
                tuple((r["group"], r["count"]) for r in s["replicas"]),
                microbatches=tuple((g, n) for g, n in s.get("microbatches", [])),
                chunks=tuple((a, b) for a, b in s.get("chunks", [])),
                group_tp=tuple((g, t) for g, t in s.get("tp", [])),
                cp_groups=tuple((g, c) for g, c in s.get("cp_groups", [])),
            )
            for s in data["stages"]
        )
    except ValueError as e:
        raise PlanError(f"stages: {e}") from None
    ranks = []
    for i, row in enumerate(data["ranks"]):
        if len(row) not in (4, 8):
            raise PlanError(
                f"ranks[{i}] has {len(row)} entries; a rank is [rank, node, local_rank, group] "
                "(idle) or that and its [pp, dp, cp, tp]"
            )
        coords = tuple(row[4:8]) if len(row) == 8 else None
        ranks.append(RankAssignment(row[0], row[1], row[2], row[3], coords))  # type: ignore[arg-type]
    pr = data["predicted"]
    prediction = Prediction(
        step_time_s=float(pr["step_time_s"]),
        tokens_per_s=float(pr["tokens_per_s"]),
        mfu=float(pr["mfu"]),
        model_flops_per_step=float(pr.get("model_flops_per_step", 0.0)),
        peak_memory_bytes=int(pr["peak_memory_bytes"]),
        fits=bool(pr["fits"]),
        breakdown=tuple((k, float(v)) for k, v in pr["breakdown"].items()),
        memory=tuple(
            RankMemory(
                mm["stage"],
                mm["group"],
                int(mm["peak_bytes"]),
                int(mm["capacity_bytes"]),
                tuple((k, int(v)) for k, v in mm.get("breakdown", {}).items()),
            )
            for mm in pr["memory"]
        ),
        notes=tuple(pr.get("notes", ())),
    )
    s = data["solver"]
    return Plan(
        model=ModelRef(
            m["name"],
            m["fingerprint"],
            m["num_params"],
            tuple(m["units"]),
            m["seq_len"],
            m.get("dtype", "bfloat16"),
            tuple(sorted((m.get("blockers") or {}).items())),
            tuple(m.get("positions") or ()),
            (m["input"]["dtype"], tuple(m["input"]["shape"])) if m.get("input") else None,
        ),
        cluster=plan_cluster,
        parallel=parallel,
        stages=stages,
        ranks=tuple(ranks),
        predicted=prediction,
        solver=SolverInfo(
            s["status"], float(s["gap"]), int(s["candidates"]), s.get("objective", "throughput")
        ),
        placements=tuple(sorted(data.get("placements", {}).items())),
        version=data["version"],
        compression=_compression_from_json(data.get("compression")),
        quantization=_quantization_from_json(data.get("quantization")),
        precision=data.get("precision", ""),
        hybrid_precision=tuple(sorted((data.get("hybrid_precision") or {}).items())),
        hybrid_linears=tuple(data.get("hybrid_linears") or ()),
    )
