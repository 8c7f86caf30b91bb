"""The parallel-configuration vocabulary shared by the planner, the cost model and the runtime.

- `Parallel`: the knobs of a configuration (degrees, micro-batching, recomputation, ZeRO).
  Any field may be None, meaning "let the planner choose"; `estimate` needs them all (it fills
  the obvious ones, e.g. `dp = world / (tp*pp*cp)`).
- `StageConfig`: what one rank of a stage runs per micro-batch, derived from a complete
  `Parallel` (`Parallel.stage`); the cost model prices a stage from it whole.
- `StagePlacement`: which units a pipeline stage runs and on which device groups its
  data-parallel replicas live (uneven DP shares across GPU types are expressed here).
- `Prediction`: what the cost model says about a placed configuration, with breakdowns.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass


class MeshAxis(enum.StrEnum):
    """Mesh axes, outermost first in the device mesh: pp, dp, cp, ep, tp."""

    PP = "pp"
    DP = "dp"
    CP = "cp"
    EP = "ep"
    TP = "tp"


class Recompute(enum.StrEnum):
    NONE = "none"
    SELECTIVE = "selective"  # recompute attention internals (Korthikanti et al.)
    FULL = "full"  # keep only each layer's input


class Schedule(enum.StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    ZERO_BUBBLE = "zero_bubble"


# How context-parallel attention exchanges the sequence (`runtime.context_parallel`):
# "allgather" (K/V all-gathered over cp, the default), "ring" (K/V passed around the cp ring;
# priced as "allgather") and "heads" (DeepSpeed-Ulysses head-parallel attention: all-to-alls
# to heads / cp whole heads over the whole sequence and back) and "usp" (the two-level split of
# USP / LoongTrain where cp does not divide the heads: head-parallel over `cp_head_degree`
# ranks, K/V all-gathered over the cp / cp_head_degree groups of them).
CP_MODES = ("allgather", "ring", "heads", "usp")

# Fields `Parallel.is_complete` does not require.
_OPTIONAL_FIELDS = frozenset(
    {
        "virtual_stages",
        "quantize_activations",
        "cp_mode",
        "cp_shares",
        "cp_head_shares",
        "cp_head_degree",
    }
)


def chunks_of(schedule: Schedule | None, virtual_stages: int | None) -> int:
    """Model chunks per pipeline rank: `virtual_stages` under interleaved 1F1B, 2 under the
    zero-bubble schedule (ZB-V: two chunks per rank in a V shape), else 1."""
    if schedule == Schedule.INTERLEAVED_1F1B:
        return virtual_stages or 1
    if schedule == Schedule.ZERO_BUBBLE:
        return 2
    return 1


@dataclass(frozen=True, slots=True)
class Parallel:
    """A (possibly partial) parallel configuration. None = free for the planner to choose.

    `global_batch` and `micro_batch` count sequences. `dp * micro_batch * num_microbatches ==
    global_batch` where num_microbatches is derived. `zero` is the ZeRO stage (0 = plain DDP,
    1 = sharded optimizer states, 2 = + gradients, 3 = FSDP / + parameters).
    `virtual_stages` is the number of model chunks each pipeline rank runs under the
    interleaved 1F1B schedule (Megatron-LM's virtual pipeline stages, Narayanan et al. SC'21);
    it is optional (None reads as 1) and is not needed for `is_complete`. The zero-bubble
    schedule is ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; torch's
    `ScheduleZBVZeroBubble`): always two chunks per rank, rank r holding chunks r and
    2 pp - 1 - r, so its `virtual_stages` is 2 (or None).
    `quantize_activations`: saved activations stored at AGoQ widths (4/8 bits by layer kind
    and stage, `meshplan.cost_model.compression.activation_bits`). It changes numerics, so
    None reads as False and the planner only turns it on when asked (`plan(quantize=...)`);
    not needed for `is_complete`.
    `cp_mode`: how context-parallel attention exchanges the sequence (`CP_MODES`); None reads
    as "allgather"; not needed for `is_complete`.
    `cp_shares`: asymmetric context parallelism (HexiSeq): the tokens of every sequence each cp
    rank holds, in cp-rank order (even, summing to the sequence length; `ir.rules.
    cp_shares_problem`); None: equal shares. `cp_head_shares`: under "heads", the query heads
    (of a tp rank's) each cp rank attends; None: equal. Neither is needed for `is_complete`.
    `cp_head_degree`: under "usp" (Fang and Zhao's USP, 2024; LoongTrain's 2D attention, Gu
    et al. 2024), how many consecutive cp ranks share the heads by all-to-alls (u, dividing
    cp and each tp rank's query heads, 1 < u < cp); the cp / u such groups all-gather K/V
    between them. None under the other modes; `complete_parallel` sets the largest u the
    heads allow (`ir.rules.usp_degree`).
    """

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    ep: int | None = None
    micro_batch: int | None = None
    global_batch: int | None = None
    recompute: Recompute | None = None
    zero: int | None = None
    schedule: Schedule | None = None
    sequence_parallel: bool | None = None
    virtual_stages: int | None = None
    quantize_activations: bool | None = None
    cp_mode: str | None = None
    cp_shares: tuple[int, ...] | None = None
    cp_head_shares: tuple[int, ...] | None = None
    cp_head_degree: int | None = None

    def __post_init__(self) -> None:
        for f in (
            "dp",
            "tp",
            "pp",
            "cp",
            "ep",
            "micro_batch",
            "global_batch",
            "virtual_stages",
            "cp_head_degree",
        ):
            v = getattr(self, f)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"Parallel.{f} must be a positive integer, got {v!r}")
        if self.zero is not None and self.zero not in (0, 1, 2, 3):
            raise ValueError(f"Parallel.zero must be 0, 1, 2 or 3, got {self.zero!r}")
        if self.recompute is not None:
            try:
                object.__setattr__(self, "recompute", Recompute(self.recompute))
            except ValueError:
                choices = ", ".join(r.value for r in Recompute)
                raise ValueError(
                    f"Parallel.recompute must be one of {choices}, got {self.recompute!r}"
                ) from None
        if self.schedule is not None:
            try:
                object.__setattr__(self, "schedule", Schedule(self.schedule))
            except ValueError:
                choices = ", ".join(s.value for s in Schedule)
                raise ValueError(
                    f"Parallel.schedule must be one of {choices}, got {self.schedule!r}"
                ) from None
        if self.cp_mode is not None and self.cp_mode not in CP_MODES:
            raise ValueError(
                f"Parallel.cp_mode must be one of {', '.join(CP_MODES)}, got {self.cp_mode!r}"
            )
        for f in ("cp_shares", "cp_head_shares"):
            v = getattr(self, f)
            if v is None:
                continue
            if not isinstance(v, (tuple, list)) or not all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v
            ):
                raise ValueError(f"Parallel.{f} must be a list of positive integers, got {v!r}")
            object.__setattr__(self, f, tuple(v))
        if self.schedule == Schedule.ZERO_BUBBLE and self.virtual_stages not in (None, 2):
            raise ValueError(
                "Parallel.virtual_stages must be 2 (or unset) with schedule 'zero_bubble' "
                f"(ZB-V runs two chunks per rank), got {self.virtual_stages}"
            )

    @property
    def is_complete(self) -> bool:
        """Every required field is set (`virtual_stages` is optional)."""
        return all(
            getattr(self, f.name) is not None
            for f in dataclasses.fields(self)
            if f.name not in _OPTIONAL_FIELDS
        )

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank (`chunks_of`)."""
        return chunks_of(self.schedule, self.virtual_stages)

    @property
    def model_parallel(self) -> int:
        """GPUs in one data-parallel replica: tp * pp * cp (EP reuses DP ranks)."""
        return (self.tp or 1) * (self.pp or 1) * (self.cp or 1)

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per pipeline per step (needs dp, micro_batch, global_batch)."""
        assert self.dp and self.micro_batch and self.global_batch
        return self.global_batch // (self.dp * self.micro_batch)

    def stage(self, tp: int | None = None) -> StageConfig:
        """The configuration one rank of a stage runs, for a complete Parallel. `tp`: the
        stage's own degree where it differs (per-group or per-stage TP); sequence parallelism
        then only where that degree is above 1."""
        own = self.tp if tp is None else tp
        return StageConfig(
            tp=own,  # type: ignore[arg-type]
            cp=self.cp,  # type: ignore[arg-type]
            ep=self.ep,  # type: ignore[arg-type]
            sequence_parallel=bool(self.sequence_parallel) and (tp is None or own > 1),
            micro_batch=self.micro_batch,  # type: ignore[arg-type]
            recompute=Recompute(self.recompute),
            quantize_activations=bool(self.quantize_activations),
            cp_mode=(self.cp_mode or "allgather") if (self.cp or 1) > 1 else "allgather",
            cp_shares=self.cp_shares if (self.cp or 1) > 1 else None,
            cp_head_shares=self.cp_head_shares if (self.cp or 1) > 1 else None,
            cp_head_degree=(self.cp_head_degree or 1) if self.cp_mode == "usp" else 1,
        )

    def pinned(self) -> dict[str, object]:
        """The fields the user fixed."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    def __str__(self) -> str:
        parts = [f"{k}={v}" for k, v in self.pinned().items()]
        return "Parallel(" + ", ".join(parts) + ")"


@dataclass(frozen=True, slots=True)
class StageConfig:
    """What one rank of a pipeline stage runs per micro-batch: the part of a complete
    configuration a stage's time and activations depend on (dp and ZeRO add the data-parallel
    part of its memory and traffic). Derived from a complete `Parallel` (`Parallel.stage`),
    passed whole to the cost model (`Pricer.stage_time`, `block_time`, `stage_memory`), and
    itself the key of their caches: a knob added here reaches every cache with it."""

    tp: int
    cp: int
    ep: int
    sequence_parallel: bool
    micro_batch: int
    recompute: Recompute
    quantize_activations: bool = False
    cp_mode: str = "allgather"  # `CP_MODES`; "allgather" whenever cp == 1
    # Asymmetric CP (`Parallel.cp_shares` / `cp_head_shares`; None: equal) and the cp ranks
    # this configuration prices (None: all of them; a device group's under a cp group that
    # spans groups).
    cp_shares: tuple[int, ...] | None = None
    cp_head_shares: tuple[int, ...] | None = None
    cp_ranks: tuple[int, ...] | None = None
    # Under "usp": the head-parallel degree inside the cp group (`Parallel.cp_head_degree`);
    # 1 otherwise.
    cp_head_degree: int = 1
    # A cp group spanning device groups (`StagePlacement.cp_groups`): its (group, cp ranks)
    # and how many such cp groups cross the groups' link at once (tp x dp).
    cp_span: tuple[tuple[str, int], ...] | None = None
    cp_streams: int = 1

    @property
    def seq_div(self) -> float:
        """What a rank's share of a sequence divides the whole by: cp under equal shares;
        under asymmetric token shares 1 / the largest fraction of the tokens any priced rank
        holds (`cp_ranks`; the slowest sets the pace, the cp collectives keep the ranks in
        lock-step). Every op but the attention core under "heads" scales so; under
        "allgather" the attention core does too (the uneven zig-zag keeps a rank's causal
        work in proportion to its tokens, `runtime.context_parallel.sequence_positions`)."""
        if self.cp_shares is None:
            return self.cp
        total = sum(self.cp_shares)
        return total / max(self.cp_shares[r] for r in self._priced())

    @property
    def attention_div(self) -> float:
        """What a rank's attention core divides the whole attention by: `seq_div`, but under
        "heads" with asymmetric shares the sum of the head shares over the largest head
        share any priced rank attends (cp when the heads are split equally): a rank there
        attends its heads over the whole sequence, whatever its tokens."""
        if self.cp_mode != "heads" or (self.cp_shares is None and self.cp_head_shares is None):
            return self.seq_div
        if self.cp_head_shares is None:
            return self.cp
        total = sum(self.cp_head_shares)
        return total / max(self.cp_head_shares[r] for r in self._priced())

    def _priced(self) -> range | tuple[int, ...]:
        return self.cp_ranks if self.cp_ranks is not None else range(self.cp)

    def rank_configs(self) -> tuple[StageConfig, ...]:
        """Under asymmetric shares, one configuration per distinct (token, head) share among
        the priced ranks (each priced alone: the slowest of them sets the stage's time);
        otherwise (self,)."""
        if self.cp_shares is None and self.cp_head_shares is None:
            return (self,)
        seen: dict[tuple, int] = {}
        for r in self._priced():
            key = (
                self.cp_shares[r] if self.cp_shares else None,
                self.cp_head_shares[r] if self.cp_head_shares else None,
            )
            seen.setdefault(key, r)
        if len(seen) == 1:
            return (self,)
        return tuple(dataclasses.replace(self, cp_ranks=(r,)) for r in seen.values())


@dataclass(frozen=True, slots=True)
class StagePlacement:
    """Pipeline stage `index` runs units [first_unit, last_unit) on `replicas` data-parallel
    replicas, spread over device groups as (group name, replica count) pairs. Each replica is
    tp * cp GPUs of one group (TP and CP stay inside a group).

    `microbatches` (optional; empty = every replica runs the same num_microbatches) gives
    uneven data-parallel batch shares across GPU types: (group name, micro-batches each replica
    in that group runs per step), one entry per group of `replicas`. The pipelines are then
    group-pure: every stage has the same `replicas` and `microbatches`, and the shares add up,
    sum over groups of replicas * micro-batches = dp * num_microbatches.

    `chunks` (optional; empty = the one range [first_unit, last_unit)) lists, in model order,
    the unit ranges of the model chunks this pipeline rank runs under interleaved 1F1B or ZB-V
    (`meshplan.passes.partition.rank_chunks`, or a framework's uneven split as read by
    `meshplan.configs`); [first_unit, last_unit) is then the rank's share of that split,
    which holds as many layers as its chunks.

    `group_tp` (optional; empty = every replica uses `Parallel.tp`) gives this stage's
    replicas in each device group their own tensor-parallel degree: (group name, tp) for
    exactly the groups of `replicas`. Stages may differ (a pipeline whose stages run at
    different degrees and on different GPU types, and stages that mix groups, as Sailor,
    Metis and AMP plan): the cost model prices any such layout at ZeRO-0 without EP
    (`stage_tp_problem`); the replicas of a stage whose degrees differ reduce their gradients
    piece by piece (`meshplan.cost_model.dp_traffic.DataParallelTraffic.dp_cross_hetero`).
    The runtime runs them too, under '1f1b' or 'gpipe' with even shares and cp = 1 where
    stages differ (`group_tp_problem`; the hand-off between TP groups of different degrees
    is `meshplan.runtime.pipeline_handoff`).
    `Parallel.tp` is the degree of stage 0's first group.

    `cp_groups` (optional; empty = each replica's cp ranks in its own group) lets every
    replica's cp group span device groups (HexiSeq's setting: one sequence over H100s and
    A100s together): (group name, cp ranks of each replica there) in cp-rank order, the
    counts adding up to cp; `replicas` is then the one entry (first group of `cp_groups`,
    dp). With asymmetric shares (`Parallel.cp_shares`) the faster group's ranks take more of
    the sequence. `cp_span_problem` says where it is priced and run (pp = 1 for now).
    """

    index: int
    first_unit: int
    last_unit: int
    replicas: tuple[tuple[str, int], ...]
    microbatches: tuple[tuple[str, int], ...] = ()
    chunks: tuple[tuple[int, int], ...] = ()
    group_tp: tuple[tuple[str, int], ...] = ()
    cp_groups: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.last_unit <= self.first_unit:
            raise ValueError(f"stage {self.index}: empty unit range")
        if not self.replicas or any(n < 1 for _, n in self.replicas):
            raise ValueError(f"stage {self.index}: replicas must be positive counts")
        if self.microbatches:
            if any(n < 1 for _, n in self.microbatches):
                raise ValueError(f"stage {self.index}: micro-batch shares must be positive")
            if sorted(g for g, _ in self.microbatches) != sorted(g for g, _ in self.replicas):
                raise ValueError(
                    f"stage {self.index}: micro-batch shares must name exactly the groups "
                    "of its replicas"
                )
        if any(b <= a for a, b in self.chunks):
            raise ValueError(f"stage {self.index}: empty chunk range in {list(self.chunks)}")
        if self.group_tp:
            if any(not isinstance(t, int) or t < 1 for _, t in self.group_tp):
                raise ValueError(f"stage {self.index}: per-group tp degrees must be positive")
            if sorted(g for g, _ in self.group_tp) != sorted(g for g, _ in self.replicas):
                raise ValueError(
                    f"stage {self.index}: per-group tp must name exactly the groups of its replicas"
                )
        if self.cp_groups:
            names = [g for g, _ in self.cp_groups]
            if any(not isinstance(n, int) or n < 1 for _, n in self.cp_groups):
                raise ValueError(f"stage {self.index}: cp_groups counts must be positive")
            if len(set(names)) != len(names) or len(names) < 2:
                raise ValueError(
                    f"stage {self.index}: cp_groups must name two or more distinct groups"
                )
            if len(self.replicas) != 1 or self.replicas[0][0] != names[0]:
                raise ValueError(
                    f"stage {self.index}: with cp_groups, replicas is one entry of the first "
                    f"group ({names[0]!r}, dp)"
                )
            if self.microbatches or self.group_tp:
                raise ValueError(
                    f"stage {self.index}: cp_groups cannot be combined with micro-batch shares "
                    "or per-group tp"
                )

    @property
    def num_units(self) -> int:
        return self.last_unit - self.first_unit

    @property
    def dp(self) -> int:
        return sum(n for _, n in self.replicas)

    @property
    def shares(self) -> dict[str, int]:
        """Micro-batches per replica by group ({} when every replica runs the same number)."""
        return dict(self.microbatches)

    def tp_of(self, group: str, default: int) -> int:
        """The tensor-parallel degree of `group`'s replicas (`default`: `Parallel.tp`)."""
        return dict(self.group_tp).get(group, default)

    @property
    def groups(self) -> tuple[str, ...]:
        """The device groups this stage's ranks sit in, in placement order."""
        if self.cp_groups:
            return tuple(g for g, _ in self.cp_groups)
        return tuple(g for g, _ in self.replicas)

    def gpus(self, tp: int, cp: int) -> dict[str, int]:
        """GPUs this stage takes in each group (`tp`, `cp`: `Parallel`'s)."""
        if self.cp_groups:
            return {g: self.dp * tp * c for g, c in self.cp_groups}
        out: dict[str, int] = {}
        for g, n in self.replicas:
            out[g] = out.get(g, 0) + n * self.tp_of(g, tp) * cp
        return out


def span_config(
    cfg: StageConfig, span: tuple[tuple[str, int], ...], group: str, streams: int
) -> StageConfig:
    """What a rank of `group` runs when its cp group spans device groups as `span`
    (`StagePlacement.cp_groups`: cp ranks per group, in cp-rank order): `cfg` priced at the
    cp ranks that sit in `group` (`StageConfig.cp_ranks`), its cp collectives on the spanning
    path with `streams` such cp groups crossing at once."""
    at = 0
    for g, c in span:
        if g == group:
            ranks = tuple(range(at, at + c))
            return dataclasses.replace(cfg, cp_ranks=ranks, cp_span=span, cp_streams=streams)
        at += c
    raise ValueError(f"group {group!r} holds no cp rank of {span}")


def cp_span_problem(parallel: Parallel, stages: tuple[StagePlacement, ...]) -> str | None:
    """What keeps cp groups that span device groups (`StagePlacement.cp_groups`) from being
    priced and run, or None: the counts add up to cp; under pipeline parallelism every stage
    spans the groups alike (the same cp ranks in each group, so cp rank r of every stage sits
    in one group and the stages' hand-offs stay inside it, as they are priced). Expert
    parallelism needs nothing more: an ep group is ep data-parallel replicas at one cp index,
    all in the group that holds that cp rank."""
    spans = [st for st in stages if st.cp_groups]
    if not spans:
        return None
    cp = parallel.cp or 1
    for st in spans:
        total = sum(c for _, c in st.cp_groups)
        if total != cp:
            return f"stages[{st.index}].cp_groups hold {total} cp ranks but cp={cp}"
    if parallel.cp_mode == "usp":
        return (
            "cp attention 'usp' with a cp group spanning device groups (cp_groups) is not "
            "priced; use cp attention 'allgather' or 'heads'"
        )
    if len(stages) > 1 and any(st.cp_groups != stages[0].cp_groups for st in stages):
        return (
            "cp groups spanning device groups (cp_groups) need every pipeline stage to span "
            "them alike (the same cp ranks in each group)"
        )
    return None


def stage_tp_problem(parallel: Parallel, stages: tuple[StagePlacement, ...]) -> str | None:
    """What keeps `stages` from being a per-group TP layout the cost model prices
    (`StagePlacement.group_tp`, on any stage), or None: ZeRO-0 and no EP (replicas whose
    shards differ in shape cannot share ZeRO shards or expert groups), `Parallel.tp` the
    degree of stage 0's first group, and, where the pipelines leave their group or change
    degree between stages, a schedule whose hand-offs run between neighbouring stages only
    (interleaved 1F1B also hands the last stage's output back to stage 0, which is not
    priced). `meshplan.cost_model.simulate.check_parallel` asks it; the runtime asks
    `group_tp_problem`, which adds what it does not run yet."""
    p, first = parallel, stages[0]
    if p.zero != 0:
        return (
            f"per-group tp needs zero=0, got zero={p.zero} (replicas with different tp cannot "
            "share optimizer or gradient shards)"
        )
    if (p.ep or 1) > 1:
        return f"per-group tp needs ep=1, got ep={p.ep}"
    lead = first.tp_of(first.replicas[0][0], p.tp)
    if lead != p.tp:
        return (
            f"Parallel.tp={p.tp} must be stage 0's first group's tp "
            f"({first.replicas[0][0]}: {lead})"
        )
    if p.schedule == Schedule.INTERLEAVED_1F1B and not group_pure(stages):
        return (
            "schedule 'interleaved_1f1b' over stages of different groups or tp degrees is not "
            "priced (its hand-off from the last stage back to stage 0 is not modelled); use "
            "'1f1b', 'gpipe' or 'zero_bubble'"
        )
    return None


def group_tp_problem(parallel: Parallel, stages: tuple[StagePlacement, ...]) -> str | None:
    """What keeps the runtime from running `stages` as a per-group TP plan, or None:
    `stage_tp_problem`, and, where the pipelines are not group-pure (stages at different
    degrees or in different groups, handed off between TP groups by
    `runtime.pipeline_handoff`), what that hand-off does not run yet: schedules other than
    '1f1b' and 'gpipe' (interleaved 1F1B and ZB-V hold several chunks per rank), uneven
    micro-batch shares (a pipeline crossing groups has no one group's share) and context
    parallelism. The runtime's `check_plan` and the plan JSON's `plan_problem` ask it."""
    if why := stage_tp_problem(parallel, stages):
        return why
    if group_pure(stages):
        return None
    if parallel.schedule not in (Schedule.ONE_F_ONE_B, Schedule.GPIPE):
        return (
            f"schedule={str(parallel.schedule)!r} with stages at different tp degrees or groups "
            "is not run (the tp-changing hand-off runs one chunk per rank); use '1f1b' or "
            "'gpipe'"
        )
    for st in stages:
        if len(set(st.shares.values())) > 1:
            return (
                f"stages[{st.index}].microbatches: uneven shares with stages at different tp "
                "degrees or groups are not run (a pipeline crossing groups has no one share)"
            )
    if (parallel.cp or 1) > 1:
        return (
            f"cp={parallel.cp} with stages at different tp degrees or groups is not run "
            "(the tp-changing hand-off is not written for context-parallel shards)"
        )
    return None


def group_pure(stages: tuple[StagePlacement, ...]) -> bool:
    """Every stage has the same replicas, shares and tp per group (each pipeline inside one
    group at one degree: per-group TP without a tp-changing hand-off)."""
    first = stages[0]
    return all(
        (st.replicas, dict(st.group_tp), dict(st.microbatches))
        == (first.replicas, dict(first.group_tp), dict(first.microbatches))
        for st in stages
    )


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Peak memory of the ranks of one (stage, group) pair, with its breakdown by kind."""

    stage: int
    group: str
    peak_bytes: int
    capacity_bytes: int
    breakdown: tuple[tuple[str, int], ...]  # (kind, bytes): params, grads, optimizer, ...

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= self.capacity_bytes


@dataclass(frozen=True, slots=True)
class Prediction:
    """The cost model's verdict on one placed configuration.

    `breakdown` splits the step time into named parts (seconds) that add up to
    `step_time_s`; `memory` lists peak memory per (stage, group).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    model_flops_per_step: float
    peak_memory_bytes: int
    fits: bool
    breakdown: tuple[tuple[str, float], ...]
    memory: tuple[RankMemory, ...]
    notes: tuple[str, ...] = ()
    # Which op-latency model priced compute: "learned (<file>, trained on <device>, <n> ops)"
    # or "analytic roofline" (cost_model.compute.latency_source); "" when not recorded.
    latency_source: str = ""

    def breakdown_dict(self) -> dict[str, float]:
        return dict(self.breakdown)
