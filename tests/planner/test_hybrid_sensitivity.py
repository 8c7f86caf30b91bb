"""Per-group precision chosen per linear from a measured sensitivity (QSync's indicator, issue
19 point 3): `measure.sensitivity.linear_sensitivity` measures how much the loss rises with
each linear of the layers lowered, `chosen_linears` picks the linears to lower within a loss
budget, the plan records them (`hybrid_linears`), the cost model prices only them and the
runtime lowers only them.

Oracles: the loss of the model with one linear's forward quantized by a hand-written int8
fake-quantizer (not the runtime's code); a knapsack solved by hand where taking the best FLOPs
per unit of loss first falls short; the linears' own FLOP arithmetic; `predict` with the engine
stated by hand; counts of the modules the runtime changed.
"""

from __future__ import annotations

import json

import meshplan
import pytest
import torch
from meshplan.api import chosen_linears, linear_flops, quantized_fraction
from meshplan.cost_model import predict
from meshplan.cost_model.engine import Engine
from meshplan.ir import Parallel
from meshplan.ir.plan import Plan, plan_problem
from meshplan.measure.sensitivity import (
    linear_sensitivity,
    load_sensitivity,
    save_sensitivity,
    unit_linears,
)
from meshplan.runtime.hybrid_precision import MODE_ATTR, quantize_linears

from tests.planner.test_cli import run
from tests.planner.test_hybrid_planning import GRAPH, _cluster
from tests.runtime.harness import CFG, SEQ, build_model, loss_fn

UNITS = [f"layers.{i}" for i in range(CFG["layers"])]


def _batches(n: int = 2, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randint(0, CFG["vocab"], (4, SEQ), generator=g) for _ in range(2))
        for _ in range(n)
    ]


def _fake_int8(x: torch.Tensor) -> torch.Tensor:
    """Symmetric per-row int8 round trip, written out: scale max|row| / 127, round half to
    even, clamp to +-127."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    s = torch.where(s == 0, torch.ones_like(s), s)
    return (x / s).round().clamp(-127, 127) * s


def _loss_with(model, batches, role: str | None) -> float:
    """Mean loss with `role`'s forward in every layer replaced by the hand-written int8 one."""
    saved = {}
    if role is not None:
        for unit in UNITS:
            lin = model.get_submodule(f"{unit}.{role}")

            def forward(x, lin=lin):
                y = _fake_int8(x.reshape(-1, x.shape[-1])) @ _fake_int8(lin.weight).t()
                y = y.reshape(*x.shape[:-1], -1)
                return y if lin.bias is None else y + lin.bias

            saved[lin] = forward
            lin.forward = forward
    try:
        with torch.no_grad():
            return sum(float(loss_fn(model(x), y)) for x, y in batches) / len(batches)
    finally:
        for lin in saved:
            del lin.forward


def _trained(batches, steps: int = 60):
    """The harness's tiny model fitted to `batches` (so that noise in its forward raises the
    loss rather than moving it either way, as on an untrained model)."""
    torch.manual_seed(0)
    model = build_model()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for i in range(steps):
        x, y = batches[i % len(batches)]
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return model


def test_measured_sensitivity_is_the_hand_quantized_loss_increase():
    batches = _batches()
    model = _trained(batches)
    with torch.no_grad():
        # The same function, but up_proj's weight rows are dominated by one column (x1000,
        # its input feature scaled down by the norm before it): int8 per-row scales then
        # crush every other weight of the row.
        for unit in UNITS:
            layer = model.get_submodule(unit)
            layer.mlp.up_proj.weight[:, 0] *= 1000
            layer.mlp_norm.weight[0] /= 1000
    got = linear_sensitivity(model, batches, loss_fn, units=UNITS)
    assert (
        list(got)
        == unit_linears(model, UNITS)
        == [
            "attn.q_proj",
            "attn.k_proj",
            "attn.v_proj",
            "attn.o_proj",
            "mlp.up_proj",
            "mlp.gate_proj",
            "mlp.down_proj",
        ]
    )
    base = _loss_with(model, batches, None)
    for role, value in got.items():
        want = (_loss_with(model, batches, role) - base) / base
        assert value == pytest.approx(want, rel=1e-3, abs=1e-6), role
    # the planted outlier makes up_proj the most sensitive, by far
    others = max(abs(v) for r, v in got.items() if r != "mlp.up_proj")
    assert got["mlp.up_proj"] > 5 * others
    # the model is left as it was: no linear lowered, training flag restored
    assert not any(hasattr(m, MODE_ATTR) for m in model.modules())
    assert model.training
    # units found by tracing the model when not given
    assert linear_sensitivity(model, batches[:1], loss_fn).keys() == got.keys()


def test_chosen_linears_solve_the_knapsack_taking_ratios_first_misses():
    """GRAPH's layer linears: qkv_proj 3F, o_proj F, up_proj 4F, down_proj 4F (F = h^2 FLOPs
    per token x 2). Budget 1.0: by FLOPs per unit of loss, o_proj (0.1 for F) then up_proj
    (0.5 for 4F) go first and nothing else fits: 5F. Both MLP linears fit exactly: 8F."""
    flops = linear_flops(GRAPH)
    f = flops["o_proj"]
    assert flops == pytest.approx(
        {"qkv_proj": 3 * f, "o_proj": f, "up_proj": 4 * f, "down_proj": 4 * f}
    )
    sens = {"qkv_proj": 0.45, "o_proj": 0.1, "up_proj": 0.5, "down_proj": 0.5}
    assert chosen_linears(GRAPH, sens, 1.0) == ("up_proj", "down_proj")
    assert chosen_linears(GRAPH, sens, 0.05) == ()
    assert chosen_linears(GRAPH, sens, 10.0) == ("qkv_proj", "o_proj", "up_proj", "down_proj")
    # a negative measurement costs nothing; a linear left out is never lowered
    assert chosen_linears(GRAPH, {"o_proj": -0.01}, 0.0) == ("o_proj",)
    with pytest.raises(ValueError, match="q_proj is no linear of the model's layers"):
        chosen_linears(GRAPH, {"q_proj": 0.0}, 1.0)


def test_the_plan_lowers_only_the_chosen_linears_and_prices_only_them():
    cluster = _cluster("T4")
    kw = dict(cluster=cluster, global_batch=128, time_limit_s=2, equal_shares=True, compress="off")
    sens = {"qkv_proj": 0.45, "o_proj": 0.1, "up_proj": 0.5, "down_proj": 0.5}
    every = meshplan.plan(GRAPH, hybrid_precision="auto", **kw)
    some = meshplan.plan(
        GRAPH, hybrid_precision="auto", sensitivity=sens, max_loss_increase=1.0, **kw
    )
    assert every.hybrid_linears == () and every.hybrid_precision == (("slow", "int8"),)
    assert some.hybrid_linears == ("up_proj", "down_proj")
    assert some.hybrid_precision == (("slow", "int8"),)
    # the quantized share of the FLOPs is the chosen linears' share of the linears' FLOPs
    flops = linear_flops(GRAPH)
    part = (flops["up_proj"] + flops["down_proj"]) / sum(flops.values())
    p, st = some.parallel, some.stages
    whole = quantized_fraction(GRAPH, p, st, some.hybrid_precision)
    mine = quantized_fraction(GRAPH, p, st, some.hybrid_precision, some.hybrid_linears)
    assert mine == pytest.approx(whole * part, rel=1e-12)
    # priced as `predict` prices it with the engine written by hand; between none and all
    engines = {
        "none": Engine(),
        "some": Engine(hybrid=some.hybrid_precision, hybrid_linears=some.hybrid_linears),
        "all": Engine(hybrid=some.hybrid_precision),
    }
    t = {
        k: predict(GRAPH, cluster, p, st, dtype="float16", engine=e).step_time_s
        for k, e in engines.items()
    }
    assert some.predicted.step_time_s == pytest.approx(t["some"], rel=1e-9)
    assert t["all"] < t["some"] < t["none"]
    # in the plan JSON and read back; refused without per-group precision
    back = Plan.from_json(some.to_json())
    assert back.hybrid_linears == some.hybrid_linears and plan_problem(back) is None
    assert json.loads(some.to_json())["hybrid_linears"] == ["up_proj", "down_proj"]
    assert "(up_proj, down_proj)" in some.explain()
    bare = Plan.from_json(every.to_json())
    assert "hybrid_linears" not in json.loads(every.to_json())
    import dataclasses

    stray = dataclasses.replace(bare, hybrid_precision=(), hybrid_linears=("o_proj",))
    assert "hybrid_linears without hybrid_precision" in plan_problem(stray)
    # nothing within the budget: planned without per-group precision
    none = meshplan.plan(
        GRAPH, hybrid_precision="auto", sensitivity=sens, max_loss_increase=0.01, **kw
    )
    assert none.hybrid_precision == () and none.hybrid_linears == ()


def test_runtime_lowers_only_the_named_linears():
    model = build_model()
    roles = ("attn.q_proj", "mlp.down_proj")
    assert quantize_linears(model, "int8", UNITS, roles) == len(roles) * len(UNITS)
    lowered = {n for n, m in model.named_modules() if MODE_ATTR in m.__dict__}
    assert lowered == {f"{u}.{r}" for u in UNITS for r in roles}


def test_sensitivity_file_round_trip_and_cli(tmp_path):
    path = tmp_path / "sens.json"
    save_sensitivity({"up_proj": 0.002, "o_proj": -0.001}, path)
    assert load_sensitivity(path) == {"up_proj": 0.002, "o_proj": -0.001}
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "meshplan-linear-sensitivity/1", "relative_loss_increase": [1]}')
    with pytest.raises(ValueError, match="bad.json: field relative_loss_increase"):
        load_sensitivity(bad)
    r = run("plan", "--hybrid-precision", "auto", "--sensitivity", str(tmp_path / "none.json"))
    assert r.exit_code == 2 and "none.json: no such file" in r.output
    r = run("plan", "--sensitivity", str(path))
    assert r.exit_code == 2 and "--sensitivity needs --hybrid-precision" in r.output


def test_estimate_prices_a_given_set_of_linears_or_refuses_it():
    cluster = _cluster("T4")
    pins = Parallel(dp=40, tp=1, pp=1, micro_batch=1, global_batch=80)
    some = Engine(hybrid=(("slow", "int8"),), hybrid_linears=("up_proj",))
    plan = meshplan.estimate_plan(GRAPH, cluster=cluster, parallel=pins, engine=some)
    assert plan.hybrid_linears == ("up_proj",)
    bad = Engine(hybrid=(("slow", "int8"),), hybrid_linears=("gate_proj",))
    with pytest.raises(ValueError, match="gate_proj is no linear of the model's layers"):
        meshplan.estimate_plan(GRAPH, cluster=cluster, parallel=pins, engine=bad)
    r = run("estimate", "--hybrid-linears", "up_proj")
    assert r.exit_code == 2 and "--hybrid-linears needs --hybrid-precision" in r.output


def test_groups_without_a_precision_price_as_the_plain_engine():
    """The chosen linears belong to the lowered groups only: a group without a mode prices
    with the plain engine (the learned latency model where it covers the GPU), and the
    "off" option of `auto` carries no linears."""
    from meshplan.cost_model.engine import EAGER
    from meshplan.cost_model.pricer import pricer_for

    engine = Engine(hybrid=(("slow", "int8"),), hybrid_linears=("up_proj",))
    pricer = pricer_for(GRAPH, _cluster("T4"), "float16", engine=engine)
    assert pricer.engine_of("a100") == EAGER
    assert pricer.engine_of("slow").hybrid_linears == ("up_proj",)


def test_a_linear_whose_loss_went_non_finite_is_never_lowered():
    sens = {"qkv_proj": float("nan"), "o_proj": 0.0, "up_proj": float("inf"), "down_proj": 0.0}
    assert chosen_linears(GRAPH, sens, 10.0) == ("o_proj", "down_proj")
    with pytest.raises(ValueError, match="pass hybrid_precision='auto'"):
        meshplan.plan(GRAPH, cluster=_cluster("T4"), global_batch=128, sensitivity=sens)
