"""Pipeline parallelism: cut the model at the plan's stage boundaries, run torch's schedules.

A stage runs the plan's units `[first_unit, last_unit)` (uneven stages are fine). The cut is
manual: torch's tracer frontend (`pipeline()`) fails on skip connections such as RoPE tables
built in stage 0 (see RUNTIME_NOTES), and a manual stage keeps the user's modules and their
parameter names, so state dicts and plan placements match the unsplit model.

How a model is cut:
- a model may define `pipeline_stage(first_unit, last_unit, units) -> nn.Module` itself;
- the built-in zoo `Transformer` (and models of the same shape: `embed`, optional
  `pos_embed`, `layers`, `norm`, `lm_head`, optional `rope_cos`/`rope_sin` buffers) is cut by
  `TransformerStage`;
- anything else is refused with a one-line reason.

Each stage keeps only its own modules; the rest are dropped, so the optimizer and data
parallelism only see this stage's parameters.
"""

from __future__ import annotations

import torch
from meshplan.ir.parallel import Schedule
from meshplan.ir.plan import Plan
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .errors import RuntimePlanError
from .mesh import RankContext


class TransformerStage(nn.Module):
    """Units `[first, last)` of a zoo-shaped decoder: prologue (embedding), some layers,
    epilogue (final norm + LM head). Attribute names equal the model's, so parameter names do.

    forward: stage 0 takes tokens, the others the hidden state; the last returns logits.
    """

    def __init__(self, model: nn.Module, first: int, last: int, units: tuple[str, ...]) -> None:
        super().__init__()
        container = _container_name(units)
        self.has_prologue = first == 0 and units[0] == "<prologue>"
        self.has_epilogue = last == len(units) and units[-1] == "<epilogue>"
        self.gpt_positions = hasattr(model, "pos_embed")
        if self.has_prologue:
            self.embed = model.embed
            if self.gpt_positions:
                self.pos_embed = model.pos_embed
        kept = {}
        for u in units[first:last]:
            if u.startswith("<"):
                continue
            if not u.startswith(container + "."):
                raise RuntimePlanError(f"runtime: unit {u!r} is not inside {container!r}")
            kept[u[len(container) + 1 :]] = model.get_submodule(u)
        # A ModuleDict keyed by the original indices keeps names like "layers.5.attn...".
        setattr(self, container, nn.ModuleDict(kept))
        self._container = container
        if self.has_epilogue:
            self.norm = model.norm
            self.lm_head = model.lm_head
        for buf in ("rope_cos", "rope_sin"):
            if hasattr(model, buf):
                self.register_buffer(buf, getattr(model, buf), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.has_prologue:
            tokens = x
            x = self.embed(tokens)
            if self.gpt_positions:
                x = x + self.pos_embed(torch.arange(tokens.shape[1], device=tokens.device))
        rope = (self.rope_cos, self.rope_sin) if hasattr(self, "rope_cos") else None
        for layer in getattr(self, self._container).values():
            x = layer(x, rope)
        if self.has_epilogue:
            x = self.lm_head(self.norm(x))
        return x


def _container_name(units: tuple[str, ...]) -> str:
    inner = [u for u in units if not u.startswith("<")]
    if not inner:
        raise RuntimePlanError("runtime: the plan has no repeated units to pipeline")
    heads = {u.rsplit(".", 1)[0] for u in inner}
    if len(heads) != 1:
        raise RuntimePlanError(f"runtime: units live in several containers {sorted(heads)}")
    return heads.pop()


def stage_module(model: nn.Module, plan: Plan, stage_index: int) -> nn.Module:
    """The module this pipeline stage runs (see module docstring for how models are cut)."""
    s = plan.stages[stage_index]
    units = plan.model.units
    if hasattr(model, "pipeline_stage"):
        return model.pipeline_stage(s.first_unit, s.last_unit, units)
    zoo_shape = all(hasattr(model, a) for a in ("embed", "norm", "lm_head"))
    if not zoo_shape:
        raise RuntimePlanError(
            f"runtime: cannot cut {type(model).__name__} into pipeline stages: define "
            "`pipeline_stage(first_unit, last_unit, units) -> nn.Module` on the model"
        )
    return TransformerStage(model, s.first_unit, s.last_unit, units)


def build_schedule(
    module: nn.Module,
    ctx: RankContext,
    loss_fn,
    n_microbatches: int,
):
    """torch's PipelineStage for this rank's stage and the plan's schedule around it.

    The plan has one stage per pp rank, so only single-stage-per-rank schedules apply: GPipe
    and 1F1B. Interleaved and zero-bubble plans need several stages per rank and are refused
    rather than silently run with another schedule.
    """
    plan = ctx.plan
    stage = PipelineStage(
        module,
        ctx.stage_index,
        ctx.num_stages,
        ctx.device,
        group=ctx.group("pp"),
    )
    kind = plan.parallel.schedule
    if kind == Schedule.GPIPE:
        cls = ScheduleGPipe
    elif kind == Schedule.ONE_F_ONE_B:
        cls = Schedule1F1B
    else:
        raise RuntimePlanError(
            f"runtime: schedule {kind} needs several stages per rank; plans with one stage per "
            "rank run gpipe or 1f1b"
        )
    # scale_grads: the schedule divides gradients by n_microbatches, matching a mean loss.
    return cls(stage, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=True)
