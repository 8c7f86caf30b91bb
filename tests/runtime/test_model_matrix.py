"""The model x configuration matrix: models nobody on the project wrote, under every
parallelism the planner offers, against one process.

A cell is one model (`user_models.MODELS`) under one configuration (`CONFIGS`) on 2 or 4 CPU
gloo ranks. It is planned as a user would plan it: the model built on meta, traced
(`meshplan.trace`), planned (`meshplan.estimate_plan` with the configuration's dimensions, or
`meshplan.plan` with them pinned), then `meshplan.runtime.check_plan`. Then the real model
(same seed) trains 3 SGD steps under the plan (`run_local`), and the losses of every rank and
the parameters after every step are compared with one process training the same global batch
in the same micro-batches (`harness.assert_parity`). Each cell is classified:

- OK: it ran and matched one process;
- REFUSED: tracing or planning refused it (`TraceError`, `InfeasibleError`, `ValueError`,
  `RuntimePlanError` from `check_plan`) with a one-line reason;
- RUNTIME-FAIL: it passed planning and failed inside a rank (including `apply` refusing the
  plan for the model: a refusal that comes too late for the user, who has already launched);
- WRONG: it ran and the numbers differ from one process: the worst kind of bug.

A cell passes when OK or REFUSED with a non-empty one-line reason. Cells that fail today are
real bugs, marked `xfail(strict=True)` with what is wrong (`KNOWN`), so they turn into errors
the moment they are fixed (or refused at plan time) and the mark can come off.

The whole matrix is `slow` (`pytest -m slow tests/runtime/test_model_matrix.py`, or
`python benchmarks/model_matrix.py` for the table); `DEFAULT_SLICE` runs by default.
"""

from __future__ import annotations

import dataclasses
import re
import time

import meshplan
import pytest
import torch

from tests.runtime.harness import LR, assert_parity, sgd_reference, train
from tests.runtime.user_models import MODELS, UserModel, loss_fn

STEPS = 3


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration of the matrix: `parallel` fields on `world` CPU ranks; `solver`:
    plan with `meshplan.plan` (those fields pinned) instead of `estimate_plan`; `moe_only`:
    only for models with experts (EP)."""

    world: int
    parallel: dict
    solver: bool = False
    moe_only: bool = False


# Micro-batch 1 everywhere, so every configuration accumulates several micro-batches.
CONFIGS: dict[str, Config] = {
    "dp": Config(2, dict(dp=2, zero=0, micro_batch=1, global_batch=4)),
    "fsdp": Config(2, dict(dp=2, zero=3, micro_batch=1, global_batch=4)),
    "tp": Config(2, dict(tp=2, micro_batch=1, global_batch=2)),  # SP where the planner allows
    "tp-nosp": Config(2, dict(tp=2, sequence_parallel=False, micro_batch=1, global_batch=2)),
    "pp": Config(2, dict(pp=2, schedule="1f1b", micro_batch=1, global_batch=4)),
    "tpxpp": Config(4, dict(tp=2, pp=2, micro_batch=1, global_batch=4)),
    "cp": Config(2, dict(cp=2, micro_batch=1, global_batch=2)),
    "ep": Config(2, dict(dp=2, ep=2, micro_batch=1, global_batch=4), moe_only=True),
    "ep-fsdp": Config(4, dict(dp=4, ep=2, zero=3, micro_batch=1, global_batch=4), moe_only=True),
    "epxpp": Config(4, dict(dp=2, ep=2, pp=2, micro_batch=1, global_batch=4), moe_only=True),
    "recompute": Config(2, dict(dp=2, recompute="full", micro_batch=1, global_batch=4)),
    "solver-tp": Config(2, dict(dp=1, tp=2, pp=1, cp=1, micro_batch=1, global_batch=2), True),
    "solver-pp": Config(2, dict(dp=1, tp=1, pp=2, cp=1, micro_batch=1, global_batch=4), True),
}


@dataclasses.dataclass(frozen=True)
class Cell:
    """The outcome of one cell: `status` (OK, REFUSED, RUNTIME-FAIL, WRONG), the one-line
    reason (refusal, failure or first divergence; empty when OK), seconds end to end."""

    model: str
    config: str
    status: str
    reason: str
    seconds: float
    plan: str = ""  # the plan's parallel configuration, as run


def cells() -> list[tuple[str, str]]:
    """Every (model, config) of the matrix."""
    return [
        (m, c)
        for m, um in MODELS.items()
        for c, cfg in CONFIGS.items()
        if um.moe or not cfg.moe_only
    ]


def _one_line(text: str) -> str:
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[0] if lines else ""


def make_plan(um: UserModel, cfg: Config):
    """Trace the model built on meta and plan it; raises what a user would see."""
    from meshplan.runtime import check_plan

    model = um.build("meta")
    args, kwargs = um.example(model)
    graph = meshplan.trace(model, *args, kwargs=kwargs)
    cluster = meshplan.Cluster.preset("cpu", gpus=cfg.world)
    parallel = meshplan.Parallel(**cfg.parallel)
    if cfg.solver:
        plan = meshplan.plan(graph, cluster=cluster, parallel=parallel, time_limit_s=5.0)
    else:
        plan = meshplan.estimate_plan(graph, cluster=cluster, parallel=parallel)
    check_plan(plan)
    return plan


def reference(um: UserModel, global_batch: int, micro_batches: int, steps: int = STEPS):
    """One process: losses and parameter snapshots (before, after each step), the global
    batch run as `micro_batches` accumulated micro-batches."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return sgd_reference(um.build("cpu"), um.batch, loss_fn, global_batch, micro_batches, steps)
    finally:
        torch.set_num_threads(threads)


def _rank(model_name: str, plan, steps: int):
    """Inside a rank: apply the plan to the real model and train `steps` steps."""
    from meshplan.runtime import apply

    um = MODELS[model_name]
    runner = apply(um.build("cpu"), plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=LR))
    losses, states, _ = train(
        runner, plan.parallel.global_batch, steps, count_step=None, batch_fn=um.batch
    )
    return {"losses": losses, "states": states}


def run_cell(model_name: str, config_name: str, steps: int = STEPS) -> Cell:
    """Plan, run and classify one cell (see the module docstring)."""
    from meshplan.runtime import RankFailure, RuntimePlanError, run_local

    um, cfg = MODELS[model_name], CONFIGS[config_name]
    t0 = time.perf_counter()

    def done(status: str, reason: str = "", plan_str: str = "") -> Cell:
        return Cell(model_name, config_name, status, reason, time.perf_counter() - t0, plan_str)

    try:
        plan = make_plan(um, cfg)
    except (meshplan.InfeasibleError, meshplan.TraceError, RuntimePlanError, ValueError) as e:
        return done("REFUSED", _one_line(f"{type(e).__name__}: {e}"))
    p = plan.parallel
    plan_str = (
        f"dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} ep={p.ep} zero={p.zero} "
        f"sp={p.sequence_parallel} recompute={p.recompute} m={p.num_microbatches}"
    )
    ref = reference(um, p.global_batch, p.global_batch // p.micro_batch, steps)
    try:
        results = run_local(
            _rank, cfg.world, model_name, plan, steps, timeout_s=120, collective_timeout_s=20
        )
    except RankFailure as e:
        return done("RUNTIME-FAIL", _one_line(str(e)), plan_str)
    try:
        assert_parity(f"{model_name} x {config_name}", ref, results)
    except AssertionError as e:
        return done("WRONG", _one_line(str(e)), plan_str)
    return done("OK", "", plan_str)


def blames_unused_axis(reason: str) -> str:
    """The axis a refusal leads with when the configuration does not use it ("pp=1 exceeds
    ..." for a DP plan): such a reason is not accurate. Empty when it blames nothing unused."""
    head = reason.split(": ", 1)[-1].removeprefix("no plan: ")
    m = re.match(r"(dp|tp|pp|cp|ep)=1\b", head)
    return m.group(0) if m else ""


def check_cell(cell: Cell) -> None:
    """A cell passes when it matched one process, or was refused at plan time in one line
    that blames something the configuration uses."""
    if cell.status == "REFUSED":
        assert cell.reason and "\n" not in cell.reason, f"refusal without a one-line reason: {cell}"
        unused = blames_unused_axis(cell.reason)
        assert not unused, f"{cell.model} x {cell.config}: refusal blames {unused}: {cell.reason}"
        return
    assert cell.status == "OK", f"{cell.model} x {cell.config}: {cell.status}: {cell.reason}"


# Cells failing today: (model, config) -> what is wrong. Real bugs (see the module docstring).
# None at present; an entry is added with the failure it documents.
KNOWN: dict[tuple[str, str], str] = {}

# A representative slice that runs by default (< 70 s on 2 shared cores): the HF Llama
# control, users' models that train (FSDP, TP + SP, DP on images, PP cut from the exported
# graph with an encoder's output skipping stages, and BART's in-place writes and tied
# embeddings, an attention written out under TP + SP) and refusals that guard against wrong
# numbers (fused qkv under TP, positions by local length under CP, EP of a user's MoE, TP of
# ALiBi attention whose per-head slopes follow the head count).
DEFAULT_SLICE: tuple[tuple[str, str], ...] = (
    ("hf-llama", "tp"),
    ("llama-ref", "fsdp"),
    ("rope-qproj", "tp"),
    ("vit", "dp"),
    ("enc-dec", "pp"),
    ("hf-bart", "pp"),
    ("nanogpt", "tp"),
    ("rope-qproj", "cp"),
    ("user-moe", "ep"),
    ("alibi", "tp"),
    ("eager-attn", "tp"),
    ("hf-mixtral", "ep"),
    ("convnet", "fsdp"),
)


def _params():
    out = []
    for model, config in cells():
        marks = []
        if (model, config) not in DEFAULT_SLICE:
            marks.append(pytest.mark.slow)
        if (model, config) in KNOWN:
            marks.append(pytest.mark.xfail(strict=True, reason=KNOWN[(model, config)]))
        out.append(pytest.param(model, config, marks=marks, id=f"{model}-{config}"))
    return out


@pytest.mark.parametrize(("model", "config"), _params())
def test_cell(model: str, config: str) -> None:
    check_cell(run_cell(model, config))


def test_matrix_is_wide_enough() -> None:
    """At least 10 models, every configuration, and every known failure a real cell."""
    assert len(MODELS) >= 10
    every = set(cells())
    assert set(KNOWN) <= every and set(DEFAULT_SLICE) <= every
