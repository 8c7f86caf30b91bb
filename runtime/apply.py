"""`apply(model, plan, loss_fn, optimizer_factory) -> Runner`: run a plan on torch.distributed.

The order of the steps is fixed, and matters (as in torchtitan's parallelize). Each is
`apply_<dimension>(chunks, ctx, options)` in its dimension's module (`steps`: what a step
is given), and `apply` lists them one line each:

    mesh            the plan's DeviceMesh (pp, dp, cp, tp) and this rank's coordinates; under
                    per-group TP this rank's device-group view (`mesh.group_view`), while the
                    batch split and the gradient average span the groups (the whole plan)
    precision       the dtype the plan was priced in (`precision`), on the whole model
    options         what the steps read off the whole model before the cut: whether the loss
                    runs vocab-parallel, whether HF decoders must be given their sequence's
                    positions (models that cannot run on a share of their sequences are
                    refused here), weights tied across pipeline stages
    pipeline cut    this rank's chunk-stages (one, or v under interleaved 1F1B / 2 under
                    ZB-V; `pipeline_parallel.model_chunks`): every later step runs on each
                    chunk and sees only that chunk's modules and parameters
    context par.    attention of the chunks works on this rank's sequence share (forward
                    wrapped; K/V all-gather, ring or heads); HF decoders' rotary modules get
                    the positions of the tokens their attention holds. Before tensor
                    parallelism and recompute, so they wrap the changed attention and
                    checkpointed regions re-run its collectives
    expert par.     experts cut to this rank's shard (over ep on the expert dim, over tp on
                    the ffn dim: DTensors on the tp mesh), tokens all-to-all'd to their
                    owners / the MoE made one TP region; before tensor parallelism (which
                    leaves the MoE's experts to this step) and before the optimizer and data
                    parallelism, which must see the sharded expert parameters (under EP the
                    experts' DTensors live on the experts' own mesh, `mesh.expert_groups`)
    tensor par.     DTensor sharding of the chunks' projections (+ sequence parallelism);
                    before recompute, so checkpointed regions re-run the sharded code
    recompute       checkpoint wrappers around units; before data parallelism, so FSDP2's
                    per-unit all-gathers happen inside the recomputed region's own forward
    (compile)       not applied (torch.compile costs minutes on small CPUs; plans carry no
                    compile decision yet)
    activations     the plan's AGoQ widths for this stage (`plan.quantization`): each chunk's
                    forward runs under an `ActivationQuantizer` (saved tensors block-quantized;
                    inside checkpointed units recomputation saves nothing to quantize)
    data par.       DDP / FSDP2 on the dp axis, last: it must see the final parameters
                    (DTensors from tensor parallelism) and wraps the checkpointed units. With
                    cp > 1 the axis is dp x cp (cp ranks hold different tokens of the same
                    sequences). Expert parameters are left to expert parallelism's handle:
                    under ZeRO > 0 every experts module becomes an FSDP2 unit over the ranks
                    holding the same expert shard first (FSDP2 wraps bottom-up), under ZeRO-0
                    the handle all-reduces them after backward. The plan's coded DP traffic
                    for this stage (`plan.compression`) on the same wrappers: DDP comm hook,
                    FSDP2 custom reduce-scatter / all-gather, or a coded all-reduce after
                    backward where `replicate()` has no hook; the experts' coded traffic too.
                    Per-group TP wraps nothing: `HeteroGradients` averages after backward
    tied weights    a weight tied across pipeline stages (input and output embeddings): its
                    copies' gradients summed over the stages holding them, after the dp
                    reduction (`pipeline_parallel.TiedGradients`)
    optimizer       built by the caller's factory over the final (sharded) parameters, or
                    over their fp32 masters under mixed precision (`precision.with_master_weights`)
    schedule        torch.distributed.pipelining around the wrapped chunk-stages; where stages
                    run at different tp degrees or in different groups, `pipeline_handoff`'s
                    1F1B / GPipe, which hands activations between the stages' TP groups

Semantics of `Runner.step(inputs, targets)`: `inputs`/`targets` hold the *global* batch
(`plan.global_batch` rows, the same on every rank) or this dp replica's share; each dp
replica takes its rows, splits them into micro-batches of `micro_batch` rows, and the
returned loss is the mean over the global batch, identical on every rank.
`loss_fn(outputs, targets)` must return the mean loss of one micro-batch; `outputs` is what
the model returns, under PP too (`pipeline_parallel.model_output`).

How the global batch is split over dp replicas: replica d runs m_d micro-batches (the plan's
`num_microbatches`, or under uneven shares `StagePlacement.microbatches` of d's device group)
and takes the m_d * micro_batch consecutive rows after those of replicas 0..d-1 (dp index
order, which is the plan's group order). A replica's share of rows is also accepted. With
uneven shares each replica's loss is weighted by its share of the samples, dp * m_d / M with
M = sum_d m_d, before the data-parallel gradient average (which divides by dp), so the
gradients and the returned loss are those of one process over the whole global batch.
With cp > 1 each cp rank takes its share of every sequence (inputs and targets alike,
`context_parallel.sequence_positions`), so `loss_fn` sees this rank's tokens only and the
cp ranks' losses are averaged (equal token counts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist
from meshplan.ir.facts import tied_parameters
from meshplan.ir.parallel import group_pure, group_tp_problem
from meshplan.ir.plan import Plan, plan_problem
from meshplan.ir.rules import ep_tp_problem
from torch import nn
from torch.distributed.tensor import DTensor

from . import watchdog
from .context_parallel import (
    ContextParallel,
    apply_context_parallel,
    check_sequence_sharding,
    sequence_layout,
)
from .data_parallel import DataParallel, apply_data_parallel, gradient_sync
from .errors import RuntimePlanError
from .expert_parallel import ExpertParallel, apply_expert_parallel
from .hybrid_precision import apply_hybrid_precision, new_step
from .mesh import RankContext, build_mesh, check_stage_widths
from .pipeline_handoff import HandoffSchedule
from .pipeline_parallel import (
    TiedGradients,
    apply_tied_gradients,
    build_schedule,
    check_microbatches,
    check_schedule,
    chunks_per_rank,
    model_chunks,
    model_output,
    tied_across_stages,
)
from .precision import apply_precision, make_optimizer
from .quantize import apply_activation_quantization
from .recompute import apply_checkpointing
from .steps import Chunks, Options
from .tensor_parallel import (
    apply_tensor_parallel,
    clean_name,
    is_cross_entropy,
    loss_context,
    reduce_partial_gradients,
)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def check_model(model: nn.Module, plan: Plan) -> None:
    """Fail with one line when `model` is not the model the plan's units describe."""
    missing = []
    for unit in plan.model.units:
        if unit.startswith("<"):
            continue
        try:
            model.get_submodule(unit)
        except AttributeError:
            missing.append(unit)
    if missing:
        raise RuntimePlanError(
            f"runtime: the model has no module {missing[0]!r} ({len(missing)} plan units "
            f"missing); the plan was made for {plan.model.name!r}"
        )
    n = sum(p.numel() for p in model.parameters())
    if plan.model.num_params and n != plan.model.num_params:
        raise RuntimePlanError(
            f"runtime: the model has {n:,} parameters but the plan's model "
            f"{plan.model.name!r} has {plan.model.num_params:,}"
        )


def replica_microbatches(plan: Plan) -> list[int]:
    """Micro-batches each dp replica runs per step, by dp index (see the module docstring).

    Even plans give every replica `num_microbatches`. Uneven shares
    (`StagePlacement.microbatches`) give each replica its device group's count; they need
    group-pure pipelines (every stage the same shares, a dp index in one group) and no
    collective whose count depends on the micro-batches across replicas (ZeRO-3's per
    micro-batch gathers; expert all-to-alls across groups): refused otherwise, one line.
    """
    p = plan.parallel
    dp, m = p.dp or 1, p.num_microbatches
    shares = [s.shares for s in plan.stages]
    if not any(shares):
        return [m] * dp
    if any(s != shares[0] for s in shares):
        raise RuntimePlanError(
            "runtime: uneven micro-batch shares differ between pipeline stages "
            f"({[dict(s) for s in shares]}); every stage of a pipeline must run the same count"
        )
    group_of: dict[int, set[str]] = {}
    for r in plan.ranks:
        if r.coords is not None:
            group_of.setdefault(r.coords[1], set()).add(r.group)
    counts = []
    for d in range(dp):
        groups = group_of.get(d, set())
        if len(groups) != 1:
            raise RuntimePlanError(
                f"runtime: dp replica {d} spans device groups {sorted(groups)}; uneven "
                "micro-batch shares need each pipeline inside one group"
            )
        counts.append(shares[0][groups.pop()])
    if sum(counts) * p.micro_batch != p.global_batch:
        raise RuntimePlanError(
            f"runtime: micro-batch shares {counts} x micro_batch {p.micro_batch} do not add up "
            f"to the global batch {p.global_batch}"
        )
    if len(set(counts)) > 1 and (p.zero or 0) == 3:
        raise RuntimePlanError(
            "runtime: uneven micro-batch shares with ZeRO-3 (FSDP gathers parameters for every "
            "micro-batch, so replicas would run different collectives); use zero <= 2"
        )
    ep = p.ep or 1
    for j in range(0, dp, ep):
        if len(set(counts[j : j + ep])) > 1:
            raise RuntimePlanError(
                f"runtime: ep group of dp replicas {j}..{j + ep - 1} mixes micro-batch shares "
                f"{counts[j : j + ep]}; its all-to-alls need equal counts"
            )
    return counts


def check_plan(plan: Plan) -> None:
    """Refuse, with one line, a plan this runtime cannot execute, from the plan alone (no
    process group, no model): uneven shares (`replica_microbatches`), schedules
    (`pipeline_parallel.check_schedule`, and each replica's micro-batch count against its
    schedule, `ir.microbatch_problem`), stage widths, EP x TP without sequence parallelism,
    per-group TP's rules, context parallelism's sequence split, and the dimensions the plan's
    model cannot run (`Plan.model.blockers`, through `ir.plan.plan_problem`). `apply` runs it
    first and `meshplan launch` before starting any process; what depends on the model
    (module paths, head counts, expert counts) is checked by `apply` itself."""
    p = plan.parallel
    # What `Plan.from_json` checks of a loaded plan (the blocked dimensions included), for
    # plans built in Python too.
    if (why := plan_problem(plan)) is not None:
        raise RuntimePlanError(f"runtime: {why}")
    for n in set(replica_microbatches(plan)):
        check_microbatches(plan, n)
    check_schedule(plan)
    check_stage_widths(plan)
    group_tp = [t for st in plan.stages for _, t in st.group_tp]  # any stage may set its own
    tp = max([p.tp or 1, *group_tp])
    if why := ep_tp_problem(p.ep or 1, tp, bool(p.sequence_parallel)):
        raise RuntimePlanError(f"runtime: {why}")
    if group_tp and (why := group_tp_problem(p, plan.stages)):
        raise RuntimePlanError(f"runtime: {why}")
    if (p.cp or 1) > 1 and plan.model.seq_len:
        sequence_layout(plan.model.seq_len, p.cp)  # refuses a sequence cp cannot split


class Runner:
    """A model prepared for one plan on this rank; `step` trains one global batch.

    `modules` holds this rank's model chunks as data parallelism wrapped them (one, or
    several pipeline chunk-stages); `module` is the first of them (the whole prepared model
    when there is no pipeline).
    """

    def __init__(
        self,
        ctx: RankContext,
        dp: DataParallel,
        optimizer: torch.optim.Optimizer,
        loss_fn: LossFn,
        *,
        schedule=None,
        cp: ContextParallel | None = None,
        ep: ExpertParallel | None = None,
        tied: TiedGradients | None = None,
        vocab_parallel_loss: bool = False,
        first_names: dict[str, str] | None = None,
    ) -> None:
        self.ctx, self.optimizer, self.loss_fn = ctx, optimizer, loss_fn
        self.modules = [chunk.module for chunk in dp.chunks]
        self.steps = 0  # steps started (`watchdog.progress`)
        # The loss runs on vocab-sharded logits under torch's `loss_parallel` (TP only).
        self.vocab_parallel_loss = vocab_parallel_loss
        self.module = self.modules[0]
        # Where gradients are reduced: the dp axis, or dp x cp merged (`data_parallel_context`).
        self.dp_ctx = dp.context
        # Reductions run after backward: coded averages (`data_parallel.CodedGradients`),
        # per-group TP's `HeteroGradients`, then the tied weights' sums over stages.
        self.coded_grads = [*dp.after_backward, *([tied] if tied is not None else [])]
        # later name of a tied weight -> its first name (`full_state_dict`)
        self.first_names = dict(first_names or {})
        self.schedule = schedule
        self.cp, self.ep = cp, ep
        p = ctx.plan.parallel
        # Replicas over the whole plan (per-group TP: every group's, not the view's).
        self.dp, self.dp_rank = ctx.whole_plan.parallel.dp or 1, ctx.replica
        self.micro_batch = p.micro_batch
        counts = replica_microbatches(ctx.whole_plan)
        self.n_microbatches = counts[self.dp_rank]
        self.row_offset = sum(counts[: self.dp_rank]) * p.micro_batch
        self.global_batch = p.global_batch
        # Weight of this replica's mean loss: its share of the samples x dp (1 when even),
        # times this cp rank's share of the tokens x cp (`cp_token_weight`).
        self.weight = self.dp * self.n_microbatches / sum(counts) * cp_token_weight(ctx)
        pipelined = ctx.num_stages > 1
        num_chunks = ctx.num_stages * chunks_per_rank(ctx.plan) if pipelined else 1
        indices = [chunk.index for chunk in dp.chunks]
        self.holds_first = 0 in indices
        self.holds_last = num_chunks - 1 in indices

    # -- one step -------------------------------------------------------------------------
    def _local(self, x: torch.Tensor, what: str) -> torch.Tensor:
        rows = x.shape[0]
        share = self.n_microbatches * self.micro_batch
        if rows == self.global_batch:
            x = x[self.row_offset : self.row_offset + share]
        elif rows != share:
            raise RuntimePlanError(
                f"runtime: {what} has {rows} rows; the plan's global batch is "
                f"{self.global_batch} ({share} for dp replica {self.dp_rank})"
            )
        if self.cp is not None:
            x = self.cp.shard(x, dim=1)
        return x.to(self.ctx.device)

    def step(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward, backward and optimizer step on one global batch; the global mean loss."""
        watchdog.progress(self.steps)  # named in the line a stalled peer prints
        self.steps += 1
        new_step()  # per-group precision: this step's weights are quantized afresh
        x, y = self._local(inputs, "inputs"), self._local(targets, "targets")
        with loss_context(self.vocab_parallel_loss):  # backward must run inside it too
            if self.schedule is None:
                local = self._accumulate(x, y)
            else:
                local = self._pipeline(x, y)
        if self.ctx.size("tp") > 1:
            reduce_partial_gradients(self.modules)
        for handle in self.coded_grads:
            handle.finish()
        if self.ep is not None:
            self.ep.finish_gradients()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._global_mean(local)

    def _accumulate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        n = self.n_microbatches
        if x.shape[0] % n:
            raise RuntimePlanError(
                f"runtime: {x.shape[0]} rows do not split into {n} micro-batches"
            )
        # Summed on the device in float64 (the same additions as Python floats), read once in
        # `_global_mean`: a `float()` per micro-batch would make the host wait for the GPU
        # every micro-batch, so it could not queue the next one's kernels ahead.
        total = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        scale = self.weight / n
        zero = self.ctx.plan.parallel.zero or 0
        for i, (xi, yi) in enumerate(zip(x.chunk(n), y.chunk(n))):
            # ZeRO-0/1/2 reduce once per step (the last micro-batch); ZeRO-3 keeps gradients
            # sharded, so it reduce-scatters every micro-batch's (as priced: m x traffic).
            sync = i == n - 1 or zero == 3
            with gradient_sync(self.module, enabled=sync, keep_gathered=zero in (1, 2)):
                loss = self.loss_fn(self.module(xi), yi) * scale
                loss.backward()
            total += _local_value(loss).to(device=total.device, dtype=torch.float64)
        return total

    def _pipeline(self, x: torch.Tensor, y: torch.Tensor) -> float:
        losses: list[torch.Tensor] = []
        args = (x,) if self.holds_first else ()
        target = y if self.holds_last else None
        self.schedule.step(*args, target=target, losses=losses)
        if not self.holds_last:
            return 0.0
        # The schedule's losses are already weighted by dp / M (see `_schedule`).
        return float(sum(float(_local_value(v)) for v in losses))

    def _global_mean(self, local: float | torch.Tensor) -> float:
        """Every dp replica's last stage contributes its weighted mean loss once (tp peers
        hold copies; cp peers each hold the mean over their share of the tokens)."""
        ctx = self.ctx
        contributes = self.holds_last and ctx.coord("tp") == 0
        if isinstance(local, torch.Tensor) and contributes:
            t = local.reshape(1).to(device=ctx.device, dtype=torch.float64)
        else:
            t = torch.tensor([local if contributes else 0.0], dtype=torch.float64,
                             device=ctx.device)  # fmt: skip
        dist.all_reduce(t)  # on the rank's device: NCCL has no CPU tensors
        return float(t.item()) / (self.dp * ctx.size("cp"))

    # -- state ----------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the user's names, on rank 0 (others get `{}`).

        Every rank must call it (it gathers DTensor shards and pipeline stages).
        """
        ctx = self.ctx
        mine: dict[str, torch.Tensor] = {}
        for module in self.modules:
            for name, p in module.named_parameters():
                if self.ep is not None and self.ep.owns(p):
                    t = self.ep.full_tensor(p)  # expert shards gathered over the ep group
                else:
                    t = p.full_tensor() if isinstance(p, DTensor) else p
                mine[clean_name(name)] = t.detach().cpu().clone()
        holder = ctx.replica == 0 and ctx.coord("tp") == 0 and ctx.coord("cp") == 0
        gathered: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine if holder else None, gathered, dst=0)
        if dist.get_rank() != 0:
            return {}
        out: dict[str, torch.Tensor] = {}
        for part in gathered or []:
            if part:
                out.update(part)
        # A tied weight is held by each stage under the name its modules give it; the
        # model's own `named_parameters()` lists it once, under its first name.
        named = {self.first_names.get(k, k): v for k, v in sorted(out.items())}
        return dict(sorted(named.items()))


def cp_token_weight(ctx: RankContext) -> float:
    """cp x this cp rank's share of a sequence's tokens (`Parallel.cp_shares`; 1 when the
    shares are equal): each cp rank's loss is the mean over its own tokens, and gradients
    and the reported loss average over the cp ranks, so a rank holding more tokens weighs
    more. The weighted mean over cp ranks is then the mean over every token."""
    shares = ctx.plan.parallel.cp_shares
    if not shares:
        return 1.0
    return len(shares) * shares[ctx.coord("cp")] / sum(shares)


def _local_value(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor().detach() if isinstance(t, DTensor) else t.detach()


def _weighted(loss_fn: LossFn, weight: float, as_output=lambda logits: logits) -> LossFn:
    """The pipeline's loss: `loss_fn` on the last stage's logits given as the unsplit model's
    kind of output (`as_output`, `pipeline_parallel.model_output`), times `weight`."""

    def weighted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(as_output(outputs), targets) * weight

    return weighted


def apply(
    model: nn.Module,
    plan: Plan,
    loss_fn: LossFn,
    optimizer_factory: OptimizerFactory,
    *,
    device: torch.device | None = None,
    cp_attention: str | None = None,
    ep_dispatch: str = "tokens",
    loss_parallel: bool | None = None,
    master_weights: bool | None = None,
) -> Runner:
    """Prepare `model` to train under `plan` on this rank (see the module docstring).

    Call inside an initialised process group (`meshplan launch`, torchrun or
    `meshplan.runtime.run_local`) with the same model (same seed) on every rank. The model is
    changed in place (sharded, wrapped); use the returned Runner from then on.
    `cp_attention` ("allgather", "ring" or "heads") and `ep_dispatch` ("tokens" or "slots")
    choose how context and expert parallelism communicate (`context_parallel`,
    `expert_parallel`); `cp_attention` None: the plan's `cp_mode`, "allgather" when unset.
    `loss_parallel` (tp > 1): compute the loss on vocab-sharded logits under torch's
    `loss_parallel`, as the plan prices it; None (default) does so when `loss_fn` is a cross
    entropy (`tensor_parallel.is_cross_entropy`), otherwise the logits are gathered.
    `master_weights`: step fp32 master copies of 16-bit parameters
    (`precision.with_master_weights`);
    None (default) does so when the plan trains in bf16, fp16 or fp8, as the planner prices it.
    """
    check_plan(plan)
    ctx = build_mesh(plan, device)  # mesh: ctx.plan is this rank's (device-group) view
    check_model(model, plan)
    apply_precision(model, plan, ctx.device)  # the precision the plan was priced in
    options = _options(model, ctx, loss_fn, cp_attention, ep_dispatch, loss_parallel)
    as_output = model_output(model, ctx.plan)  # read before the cut: the loss gets it under PP
    first_names = {n: names[0] for names in tied_parameters(model) for n in names[1:]}

    chunks = model_chunks(model, ctx)  # pipeline cut: this rank's chunk-stages, on its device
    cp = apply_context_parallel(chunks, ctx, options)  # attention on this rank's sequence share
    ep = apply_expert_parallel(chunks, ctx, options)  # experts cut to this rank's shard
    apply_tensor_parallel(chunks, ctx, options)  # projections sharded over tp (+ SP)
    apply_hybrid_precision(chunks, ctx, options)  # this group's linears: int8/fp8 forward
    apply_checkpointing(chunks, ctx, options)  # units recomputed in backward
    apply_activation_quantization(chunks, ctx, options)  # saved activations at AGoQ widths
    options = dataclasses.replace(options, experts=ep)  # data parallelism leaves them to ep
    dp = apply_data_parallel(chunks, ctx, options)  # DDP / FSDP2 over dp (x cp), coded traffic
    tied = apply_tied_gradients(dp.chunks, ctx, options)  # tied weights summed over stages

    params = [q for chunk in dp.chunks for q in chunk.module.parameters()]
    # over the final (sharded) parameters; fp32 masters under mixed precision (precision.py)
    optimizer = make_optimizer(params, optimizer_factory, plan, master_weights)
    schedule = _schedule(dp.chunks, ctx, loss_fn, as_output)  # None without a pipeline
    return Runner(
        ctx,
        dp,
        optimizer,
        loss_fn,
        schedule=schedule,
        cp=cp,
        ep=ep,
        tied=tied,
        vocab_parallel_loss=options.vocab_parallel_loss,
        first_names=first_names,
    )


def _options(
    model: nn.Module,
    ctx: RankContext,
    loss_fn: LossFn,
    cp_attention: str | None,
    ep_dispatch: str,
    loss_parallel: bool | None,
) -> Options:
    """The steps' `Options`: the caller's choices, and what is read off the whole model
    before the pipeline cut (on this rank's plan view)."""
    plan = ctx.plan
    return Options(
        cp_attention=cp_attention or ctx.plan.parallel.cp_mode or "allgather",
        ep_dispatch=ep_dispatch,
        vocab_parallel_loss=_vocab_parallel_loss(model, plan, loss_fn, loss_parallel),
        # Under SP or CP an HF decoder is given the positions of the whole sequence; models
        # that cannot run on a share of their sequences are refused here.
        reposition=check_sequence_sharding(model, plan),
        ties=tied_across_stages(model, plan) if ctx.num_stages > 1 else (),
    )


def _schedule(chunks: Chunks, ctx: RankContext, loss_fn: LossFn, as_output):
    """The pipeline schedule around this rank's wrapped chunk-stages (None without a
    pipeline): torch's pipelining, or `pipeline_handoff` where stages run at different tp
    degrees (per-stage TP).

    Each micro-batch's loss is weighted by dp / M (M = micro-batches of all replicas): the
    replica's share of the samples and the mean over its micro-batches in one factor, applied
    before DP reduces (the schedule's own 1/m scaling runs after DDP/FSDP have reduced, which
    is wrong when replicas run different m)."""
    if ctx.num_stages == 1:
        return None
    whole = ctx.whole_plan
    counts = replica_microbatches(whole)
    loss = _weighted(loss_fn, whole.parallel.dp / sum(counts) * cp_token_weight(ctx), as_output)
    modules = [chunk.module for chunk in chunks]
    if ctx.whole is not None and not group_pure(whole.stages):  # stages at different tp degrees
        return HandoffSchedule(modules[0], ctx, loss, counts[ctx.replica])
    indices = [chunk.index for chunk in chunks]
    return build_schedule(modules, indices, ctx, loss, counts[ctx.replica])


def _vocab_parallel_loss(model: nn.Module, plan: Plan, loss_fn: LossFn, wanted: bool | None):
    """Whether the loss runs vocab-parallel (see `apply`): only under TP, with an LM head
    the plan shards on the vocabulary (an epilogue Linear placed S(0))."""
    if (plan.parallel.tp or 1) == 1 or wanted is False:
        return False
    vocab = None
    for key, placement in plan.placements:
        if key.startswith("epilogue:") and key.endswith(".weight") and placement == "S(0)":
            head = model.get_submodule(key[len("epilogue:") : -len(".weight")])
            vocab = getattr(head, "out_features", None)
    if vocab is None:
        if wanted:
            raise RuntimePlanError(
                "runtime: loss_parallel=True needs an LM head the plan shards on the "
                "vocabulary (an epilogue Linear placed S(0)); this plan has none"
            )
        return False
    return True if wanted else is_cross_entropy(loss_fn, vocab)
