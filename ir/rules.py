"""Validity rules: what makes a parallel configuration one that cannot run or cannot be
priced, each stated once.

Every rule is one function returning the reason in one line, or None. Callers add their own
prefix ("no plan: " in the solver, "runtime: " in the runtime) and decide what to do with it
(reject a candidate, raise a ValueError for `estimate`, refuse a plan file); none rewords a
reason. Who asks which rule (`tests/planner/test_validity_rules.py` holds one row per rule
and checks each layer named here against the rule's words):

    rule                         solver  estimate  predict  runtime
    tp_heads_problem               x        x                 (module attributes, at apply)
    ep_experts_problem             x        x                 x (expert modules, at apply)
    cp_sequence_problem            x        x                 x
    pp_layers_problem              x        x
    batch_split_problem            x        x         x       x
    ep_dp_problem                  x        x         x       x
    ep_tp_problem                  x        x         x       x
    microbatch_problem             x        x                 x
    zero_bubble_problem            x        x         x          (a pricing rule)
    zero_bubble_zero3_problem      x                          x  (a runtime rule)
    schedule_problem               x        x                 x
    cp_heads_problem               x        x                 (at apply: the first forward)
    cp_usp_problem                 x        x                 x (and at the first forward)
    cp_head_degree_problem                  x                 x
    cp_split_problem                        x         x       x

Rules that need more than degrees live beside what they read, one function each as well:
`ir.facts.blocked_dimension` (what the runtime cannot run on a model), `ir.parallel`'s
`stage_tp_problem` and `group_tp_problem` (stages at their own TP degrees),
`passes.partition`'s `chunk_layout_problem` and `tp_domain_problem` (layers per chunk, TP
inside an NVLink domain) and `ir.devices.precision_problem` (a precision the GPUs lack).
"""

from __future__ import annotations

import math

from .parallel import Parallel, Schedule


def microbatch_problem(schedule: Schedule | str, pp: int, n_microbatches: int) -> str | None:
    """What keeps torch's pipeline schedule `schedule` from running `n_microbatches`
    micro-batches per pipeline over `pp` pipeline ranks, or None. One rule for every layer:
    the solver's candidates and uneven shares, `estimate`'s `check_config` and the runtime's
    `check_plan` / `build_schedule` all ask it (under uneven shares, for each group's count).

    Exactly what the constructors in torch 2.13's torch/distributed/pipelining/schedules.py
    refuse (checked by building each schedule for pp 1-5, v 1-3, m 1-20):
    - `Schedule1F1B`: raises when `n_microbatches < num_stages`, and a single-stage schedule's
      num_stages is pp;
    - `ScheduleInterleaved1F1B` (any number of chunks per rank): rounds = max(1, m // pp) and
      raises when m % rounds != 0 (so m < pp is one round and runs; m = 5 with pp = 2 does
      not);
    - `ScheduleGPipe`, `ScheduleZBVZeroBubble`: any m >= 1 (ZB-V lays out max(2 pp - 1, m)
      micro-batches and drops the actions of those past m).
    With pp == 1 no schedule runs (the runner accumulates micro-batches itself)."""
    schedule, m = Schedule(schedule), n_microbatches
    if m < 1:
        return f"a pipeline needs at least one micro-batch, got {m}"
    if pp <= 1:
        return None
    if schedule == Schedule.ONE_F_ONE_B and m < pp:
        return (
            f"schedule '1f1b' needs at least pp={pp} micro-batches per pipeline (torch's "
            f"Schedule1F1B), got {m}; use schedule 'gpipe', a larger global_batch or a smaller "
            "micro_batch"
        )
    if schedule == Schedule.INTERLEAVED_1F1B and m % max(1, m // pp):
        rounds = m // pp
        return (
            f"schedule 'interleaved_1f1b' with pp={pp} needs the micro-batches per pipeline in "
            f"whole rounds (torch's ScheduleInterleaved1F1B: m % max(1, m // pp) == 0), got "
            f"{m} ({rounds} rounds)"
        )
    return None


def schedule_problem(parallel: Parallel) -> str | None:
    """What keeps `parallel`'s schedule from describing the pipeline it runs, or None: ZB-V
    needs a pipeline (pp >= 2: its V places two chunks on each of pp ranks); several chunks
    per rank (`virtual_stages` > 1) only under interleaved 1F1B or ZB-V, and only with a
    pipeline to interleave. With pp = 1 no schedule runs (the runner accumulates
    micro-batches), so 1f1b, gpipe and one-chunk interleaved 1F1B (which the planner writes
    when that schedule is pinned) run alike. How many micro-batches a schedule runs is
    `microbatch_problem`. pp None (not chosen yet) is not checked."""
    p = parallel
    v = p.virtual_stages or 1
    no_pipeline = p.pp is not None and p.pp < 2
    if p.schedule == Schedule.ZERO_BUBBLE and no_pipeline:
        return f"schedule zero_bubble needs a pipeline (pp >= 2), got pp={p.pp}"
    if v > 1 and p.schedule not in (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE):
        return f"virtual_stages={v} needs schedule interleaved_1f1b, got {p.schedule}"
    if v > 1 and no_pipeline:
        return f"virtual_stages={v} needs a pipeline to interleave (pp >= 2), got pp={p.pp}"
    return None


# -- degrees against the model -----------------------------------------------------------------


def tp_heads_problem(tp: int, heads: int, kv_heads: int) -> str | None:
    """Tensor parallelism splits attention by whole heads (Megatron-LM, Shoeybi et al. 2019,
    Sec. 3): tp must divide the query heads and the K/V heads. 0 = not known (a model without
    attention): no constraint."""
    for what, n in (("heads", heads), ("kv_heads", kv_heads)):
        if n and n % tp:
            return f"tp={tp} does not divide the model's {what} ({n})"
    return None


def ep_experts_problem(ep: int, experts: int) -> str | None:
    """Expert parallelism gives each ep rank experts / ep whole experts: the model must have
    experts, and ep must divide their number."""
    if ep > 1 and not experts:
        return f"ep={ep} but the model has no experts"
    if experts and experts % ep:
        return f"ep={ep} does not divide the model's experts ({experts})"
    return None


def cp_sequence_problem(cp: int, seq_len: int) -> str | None:
    """Context parallelism gives each cp rank an equal share of every sequence: cp must divide
    the sequence length (0 = not known). The zig-zag layout that balances a causal mask needs
    2 cp to divide it; with only cp dividing it the runtime splits contiguously
    (`runtime.context_parallel.sequence_layout`)."""
    if seq_len and seq_len % cp:
        return f"cp={cp} does not divide the sequence length ({seq_len})"
    return None


def cp_shares_problem(shares: tuple[int, ...], cp: int, seq_len: int) -> str | None:
    """Asymmetric context parallelism (HexiSeq; `Parallel.cp_shares`) gives cp rank r
    shares[r] tokens of every sequence, half from the front and half mirrored from the back
    (the zig-zag with uneven chunks, which keeps each rank's causal attention work in
    proportion to its tokens; `runtime.context_parallel.sequence_positions`): one share per
    cp rank, each even and at least 2, summing to the sequence length (0 = not known)."""
    if len(shares) != cp:
        return f"cp_shares has {len(shares)} entries but cp={cp} (one per cp rank)"
    if any(not isinstance(s, int) or s < 2 or s % 2 for s in shares):
        return f"cp_shares {list(shares)}: each share must be an even number of tokens >= 2"
    if seq_len and sum(shares) != seq_len:
        return (
            f"cp_shares {list(shares)} sum to {sum(shares)} tokens, not the sequence length "
            f"({seq_len})"
        )
    return None


def cp_head_shares_problem(shares: tuple[int, ...], cp: int, heads: int) -> str | None:
    """Head-parallel attention with asymmetric head shares (`Parallel.cp_head_shares`) gives
    cp rank r shares[r] of the query heads a tp rank holds (`heads`; 0 = not known): one
    share per cp rank, each at least 1, summing to those heads. K/V heads need not divide:
    each is repeated until every share reads whole copies (`kv_expansion`)."""
    if len(shares) != cp:
        return f"cp_head_shares has {len(shares)} entries but cp={cp} (one per cp rank)"
    if any(not isinstance(s, int) or s < 1 for s in shares):
        return f"cp_head_shares {list(shares)}: each share must be at least one head"
    if heads and sum(shares) != heads:
        return f"cp_head_shares {list(shares)} sum to {sum(shares)}, not the {heads} query heads"
    return None


def cp_split_problem(p: Parallel, seq_len: int, heads: int) -> str | None:
    """The asymmetric split of a configuration (HexiSeq; `Parallel.cp_shares` and
    `cp_head_shares`) is one the runtime runs: shares only with cp > 1, token shares as
    `cp_shares_problem` (not under "ring": its chunks travel in equal buffers), head shares
    only under "heads" and as `cp_head_shares_problem` (`heads`: the model's query heads,
    divided here by tp; 0 = not known)."""
    cp = p.cp or 1
    if cp == 1 and (p.cp_shares or p.cp_head_shares):
        return "cp_shares / cp_head_shares need cp > 1"
    if p.cp_shares is not None:
        if (p.cp_mode or "allgather") == "ring":
            return (
                "cp_shares with cp attention 'ring' is not run (ring chunks travel in equal "
                "buffers); use cp attention 'allgather' or 'heads'"
            )
        if why := cp_shares_problem(p.cp_shares, cp, seq_len):
            return why
    if p.cp_mode == "usp" and (p.cp_shares or p.cp_head_shares):
        return (
            "cp_shares / cp_head_shares under cp attention 'usp' are not run; use cp attention "
            "'allgather' or 'heads' for asymmetric shares"
        )
    if p.cp_head_shares is not None:
        if p.cp_mode != "heads":
            return "cp_head_shares need cp attention 'heads' (head-parallel)"
        if why := cp_head_shares_problem(p.cp_head_shares, cp, heads // (p.tp or 1)):
            return why
    return None


def kv_expansion(heads: int, kv_heads: int, shares: tuple[int, ...]) -> int:
    """Copies f of each K/V head so that every rank's query-head share reads whole expanded
    K/V heads: the fewest f dividing heads/kv_heads with each share a multiple of
    heads/(kv_heads f) (f = heads/kv_heads, every query head its own K/V copy, always
    works)."""
    group = heads // kv_heads
    for f in range(1, group + 1):
        if group % f == 0 and all(s % (group // f) == 0 for s in shares):
            return f
    return group


def pp_layers_problem(pp: int, layers: int) -> str | None:
    """Each pipeline stage holds at least one repeated layer (a model without repeated layers
    is one unit: one stage). `layers` 0 = not known."""
    if pp < 1:
        return f"pp={pp} must be at least 1"
    if layers and pp > layers:
        return f"pp={pp} exceeds the model's {layers} layers (pp <= layers)"
    return None


# -- degrees against each other ----------------------------------------------------------------


def batch_split_problem(
    global_batch: int, dp: int | None = None, micro_batch: int | None = None
) -> str | None:
    """Every dp replica runs whole micro-batches of the same size: dp x micro_batch must
    divide the global batch (in sequences), or rows would be dropped. Either factor may be
    None (not chosen yet): the one given must divide it."""
    factors = [(k, v) for k, v in (("dp", dp), ("micro_batch", micro_batch)) if v is not None]
    if not factors:
        return None
    n = 1
    for _, v in factors:
        n *= v
    if global_batch % n == 0:
        return None
    if len(factors) == 1:
        what = f"{factors[0][0]}={n}"
    else:
        what = f"dp*micro_batch = {dp}*{micro_batch} = {n}"
    return f"global_batch={global_batch} is not divisible by {what}"


def ep_dp_problem(ep: int, dp: int) -> str | None:
    """Expert parallelism reuses data-parallel ranks (an ep group is ep consecutive dp
    replicas, as Megatron-Core's expert data parallelism): ep must divide dp."""
    if ep > 1 and dp % ep:
        return f"ep={ep} does not divide dp={dp} (expert ranks reuse dp ranks)"
    return None


def ep_tp_problem(ep: int, tp: int, sequence_parallel: bool) -> str | None:
    """Expert parallelism with tensor parallelism needs sequence parallelism: each tp rank
    routes its own sequence shard to the experts (Megatron-Core's rule; meshplan's runtime
    does the same)."""
    if ep > 1 and tp > 1 and not sequence_parallel:
        return "ep > 1 with tp > 1 needs sequence parallelism (each tp rank routes its own tokens)"
    return None


def zero_bubble_problem(
    schedule: Schedule | str | None, pp: int, n_microbatches: int
) -> str | None:
    """ZB-V is priced with its full warm-up of 2 pp - 1 micro-batches in flight (Qi et al.
    2024, "Pipeline Parallelism with Controllable Memory"): the cost model has no timing for
    fewer, so the planner and `predict` ask for at least that many. torch runs fewer
    (`microbatch_problem`); this is a pricing rule, not a runtime one."""
    if schedule == Schedule.ZERO_BUBBLE and n_microbatches < 2 * pp - 1:
        return (
            f"schedule 'zero_bubble' (ZB-V) needs at least 2*pp - 1 = {2 * pp - 1} micro-batches "
            f"per pipeline, got {n_microbatches}; raise global_batch or lower micro_batch"
        )
    return None


def zero_bubble_zero3_problem(schedule: Schedule | str | None, pp: int, zero: int) -> str | None:
    """ZB-V with ZeRO-3 (FSDP2 resharding after forward) does not train correctly in torch
    2.13: measured on gloo ranks, gradients off by ~1e-2 after one step while ZeRO-2 and
    DDP match one process. The runtime refuses it, so the planner never emits it."""
    if pp > 1 and schedule == Schedule.ZERO_BUBBLE and zero == 3:
        return (
            "schedule zero_bubble with ZeRO-3 gives wrong gradients in torch's ZB-V + FSDP2 "
            "(measured); use zero <= 2 or schedule 1f1b / interleaved_1f1b"
        )
    return None


def cp_heads_problem(heads: int, cp: int) -> str | None:
    """Head-parallel context attention (DeepSpeed-Ulysses, Jacobs et al. 2023) gives each cp
    rank heads / cp whole query heads over the whole sequence: cp must divide the query heads
    a rank holds (`heads`: h / tp under tensor parallelism)."""
    if heads % cp:
        usp = usp_degree(heads, cp)
        also = f", or 'usp' (cp_head_degree {usp})" if usp > 1 else ""
        return (
            f"cp attention 'heads' needs the query heads divisible by cp, got heads={heads}, "
            f"cp={cp}; use cp attention 'allgather' or 'ring'{also}"
        )
    return None


def usp_degree(heads: int, cp: int) -> int:
    """The head-parallel degree of the two-level "usp" split (USP, Fang and Zhao 2024): the
    largest u dividing both cp and the query heads a rank holds (`heads`: h / tp), so the
    all-to-alls move as much of the attention as whole heads allow and the all-gather only
    the rest. 1 means no head parallelism is possible ("allgather"), cp means "heads"."""
    return math.gcd(heads, cp) if heads else 1


def cp_usp_problem(heads: int, cp: int, degree: int | None) -> str | None:
    """The two-level context attention "usp": u = `degree` consecutive cp ranks split the
    heads by all-to-alls (DeepSpeed-Ulysses inside the group) and the cp / u groups
    all-gather K/V of their heads between them. u must divide cp and the query heads a rank
    holds (`heads`: h / tp under tensor parallelism; 0 = not known) and lie strictly
    between 1 and cp (u = 1 is "allgather", u = cp is "heads")."""
    if degree is None:
        return "cp attention 'usp' needs cp_head_degree (the head-parallel ranks inside cp)"
    if not 1 < degree < cp or cp % degree:
        return (
            f"cp_head_degree={degree} must divide cp={cp} and lie strictly between 1 and cp "
            "(1 is cp attention 'allgather', cp is 'heads')"
        )
    if heads and heads % degree:
        return (
            f"cp attention 'usp' needs the query heads divisible by cp_head_degree, got "
            f"heads={heads}, cp_head_degree={degree}; use cp_head_degree "
            f"{usp_degree(heads, cp)} or cp attention 'allgather'"
        )
    return None


def cp_head_degree_problem(p: Parallel, heads: int) -> str | None:
    """`Parallel.cp_head_degree` only under "usp", and there as `cp_usp_problem` (`heads`:
    the model's query heads, divided here by tp; 0 = not known)."""
    if p.cp_head_degree is not None and p.cp_mode not in ("usp", None):
        return "cp_head_degree needs cp attention 'usp' (the two-level head x all-gather split)"
    if p.cp_head_degree is not None and (p.cp or 1) == 1:
        return "cp_head_degree needs cp > 1 (it splits the cp ranks)"
    if (p.cp_mode or ("usp" if p.cp_head_degree else None)) != "usp" or (p.cp or 1) == 1:
        return None
    return cp_usp_problem(heads // (p.tp or 1) if heads else 0, p.cp or 1, p.cp_head_degree)
