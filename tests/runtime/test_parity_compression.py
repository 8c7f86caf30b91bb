"""The plan's compression and quantization decisions, executed by `runtime.apply`.

Plans come from the planner (`meshplan.plan(..., compress="auto", quantize=...)`) on two
CPU sites joined by a slow WAN, where coding the data-parallel traffic pays even with the
measured one-core CPU codec (docs/compression.md: below ~0.5 Gb/s). Each launch runs every
plan next to its twin with compression and quantization off (`_raw`), on the same ranks.

Oracles:
- lossless: the losses and every parameter after every step (so the gradients) are
  bit-identical to the twin's when the coded reduction spans two ranks (a + b commutes and
  /2 is exact, so the coded `reduce_reference` and gloo's reduction agree bit for bit). A
  reduction over more ranks sums in rank order, which gloo/NCCL do not promise: those runs
  (dp x cp, dp=4) match one process within fp32 tolerance, like every other parity test;
- int8 gradients: within `INT8_TOL` of one process (measured ~1.2%, see below);
- quantized activations: within fp32-rounding tolerance of one process that quantizes its
  saved activations at the same widths (data parallelism only: same tensors, same blocks),
  and within `ACT_TOL` of one process without quantization;
- the collectives counted on the gradient group show the coded path ran (no raw gradient
  collective; fewer bytes on the wire than raw), and the twin's are the cost model's.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import meshplan
import pytest
import torch
from meshplan import Parallel
from meshplan.ir.plan import CompressionPlan, QuantizationPlan
from meshplan.runtime import run_local

from tests.runtime.harness import (
    CFG,
    SEQ,
    assert_parity,
    check_step_collectives,
    distributed_run,
    expected_dp_volume,
    graph,
    reference,
)

# 20 Mb/s between the sites, 1 ms latency: raw all-reduce of the tiny model's gradients takes
# ~35 ms, coded ~28 ms (lossless) / ~20 ms (int8) at the CPU codec speed the planner assumes.
WAN_BYTES_PER_S = 2.5e6
MOE_NO_DROP = dict(experts=4, top_k=2, capacity_factor=2.0)

# int8 gradients: loss within 0.1% of one process, each parameter's change over the run
# within 5% (relative L2) of one process's (measured: 1e-5 and 1.2%).
INT8_TOL = dict(loss=1e-3, update=0.05)
# AGoQ activations (4-bit attention/MLP): loss within 0.1% (measured 2e-5); single tensors can
# move ~30% off (the k projections' small, noisy updates on random tokens).
ACT_TOL = dict(loss=1e-3, update=0.5)

# name -> (parallel fields, quantize mode, expected gradient method, model overrides)
CONFIGS_2 = {
    "ddp-lossless": (dict(dp=2, micro_batch=2, global_batch=8), "off", "lossless", {}),
    "fsdp-zero2-lossless": (
        dict(dp=2, zero=2, micro_batch=4, global_batch=8),
        "off",
        "lossless",
        {},
    ),
    # ZeRO-3 gathers and reduce-scatters one FSDP unit at a time: at hidden 32 each unit's
    # few KB are cheaper raw than coded; at hidden 64 coding pays again
    "fsdp-zero3-lossless": (
        dict(dp=2, zero=3, micro_batch=2, global_batch=8),
        "off",
        "lossless",
        dict(hidden=64, ffn=128),
    ),
    "ddp-int8": (dict(dp=2, micro_batch=2, global_batch=8), "gradients", "int8", {}),
    "fsdp-zero2-int8": (
        dict(dp=2, zero=2, micro_batch=4, global_batch=8),
        "gradients",
        "int8",
        {},
    ),
    # micro-batch 8: the saved tensors reach the quantizer's 1024-value minimum
    "ddp-activations": (
        dict(dp=2, micro_batch=8, global_batch=16, recompute="none", quantize_activations=True),
        "activations",
        "lossless",
        {},
    ),
}
CONFIGS_4 = {
    # TP's DTensor parameters: `replicate()` has no hook, so the coded all-reduce runs after
    # backward (`data_parallel.CodedGradients`)
    "tpxdp-lossless": (dict(dp=2, tp=2, micro_batch=2, global_batch=8), "off", "lossless", {}),
    "tpxdp-activations": (
        dict(
            dp=2, tp=2, micro_batch=8, global_batch=16, recompute="none", quantize_activations=True
        ),
        "activations",
        "lossless",
        {},
    ),
    # gradients over dp x cp = 4 ranks
    "cpxdp-lossless": (dict(dp=2, cp=2, micro_batch=2, global_batch=4), "off", "lossless", {}),
    # dense gradients over dp = 4 ranks, expert gradients over their 2 replicas (one per site)
    "epxdp-lossless": (
        dict(dp=4, ep=2, micro_batch=1, global_batch=4),
        "off",
        "lossless",
        MOE_NO_DROP,
    ),
    # ZeRO-2: the experts' FSDP2 units reduce-scatter and all-gather over their 2 replicas,
    # coded
    "epxfsdp-zero2-lossless": (
        dict(dp=4, ep=2, zero=2, micro_batch=1, global_batch=4),
        "off",
        "lossless",
        MOE_NO_DROP,
    ),
}


def two_sites(per_site: int) -> meshplan.Cluster:
    """Two CPU groups of `per_site` ranks each, at sites "a" and "b", joined by a slow WAN."""
    from meshplan.ir.cluster_io import cluster_from_dict

    d = meshplan.Cluster.preset("cpu", gpus=per_site).to_dict()
    a, b = copy.deepcopy(d["groups"][0]), copy.deepcopy(d["groups"][0])
    a.update(name="site-a", site="a")
    b.update(name="site-b", site="b")
    d.update(name="two-cpu-sites", groups=[a, b])
    d["links"].append(
        dict(name="wan-20m", kind="wan", bandwidth=WAN_BYTES_PER_S, latency=1e-3, efficiency=1.0)
    )
    d["group_links"] = [dict(a="a", b="b", link="wan-20m")]
    return cluster_from_dict(d, source="test")


_GRAPHS: dict = {}


def _graph(model_kw):
    if not model_kw:
        return graph()
    key = tuple(sorted(model_kw.items()))
    if key not in _GRAPHS:
        model, _ = meshplan.models.transformer(
            dtype="float32", micro_batch=1, **{**CFG, **model_kw}
        )
        example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
        _GRAPHS[key] = meshplan.trace(model, example, example)
    return _GRAPHS[key]


def _plan(world, fields, quantize, model_kw):
    return meshplan.plan(
        _graph(model_kw),
        cluster=two_sites(world // 2),
        parallel=Parallel(**fields),
        compress="auto",
        quantize=quantize,
    )


def _raw(plan):
    """The same plan with compression and quantization off."""
    return dataclasses.replace(plan, compression=CompressionPlan(), quantization=QuantizationPlan())


def _gradient_methods(plan) -> list[str]:
    return [
        d.method
        for d in plan.compression.decisions
        if d.group.startswith("dp stage") and d.tensor == "gradients"
    ]


def _run_all(plans, model_kws):
    return {name: distributed_run(plan, **model_kws[name]) for name, plan in plans.items()}


def _launch(world, configs):
    plans, model_kws = {}, {}
    for name, (fields, quantize, method, model_kw) in configs.items():
        plan = _plan(world, fields, quantize, model_kw)
        # The planner chose to code this DP traffic (else the test would prove nothing).
        half = plan.parallel.dp // 2  # the dp replicas, half at each site
        assert plan.stages[0].replicas == (("site-a", half), ("site-b", half)), name
        assert _gradient_methods(plan) and set(_gradient_methods(plan)) == {method}, name
        plans[name], plans[f"{name}/raw"] = plan, _raw(plan)
        model_kws[name] = model_kws[f"{name}/raw"] = model_kw
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the forked ranks inherit it (see test_parity_cp_ep)
    try:
        results = run_local(_run_all, world, plans, model_kws, timeout_s=240)
    finally:
        torch.set_num_threads(threads)
    return plans, results


def _reference(plan, model_kw, quantized=False):
    p = plan.parallel
    return reference(
        p.global_batch, p.dp * p.num_microbatches, quantized=plan if quantized else None, **model_kw
    )


def _bit_identical(name, a, b):
    assert a["losses"] == b["losses"], f"{name}: losses {a['losses']} != raw {b['losses']}"
    for i, (x, y) in enumerate(zip(a["states"], b["states"])):  # rank 0's, {} elsewhere
        for k in y:
            assert torch.equal(x[k], y[k]), f"{name}: {k} after step {i} differs from raw"


def _close_to(name, got, ref, tol):
    """Losses within tol["loss"] (relative) and each parameter's change over the run within
    tol["update"] (relative L2) of the single process's."""
    ref_losses, ref_states = ref
    for a, b in zip(got["losses"], ref_losses):
        assert abs(a - b) <= tol["loss"] * abs(b), f"{name}: loss {a} vs {b}"
    first, last = ref_states[0], ref_states[-1]
    if not got["states"][-1]:  # parameters are gathered on rank 0 only
        return
    for k in last:
        change = (last[k] - first[k]).norm()
        err = (got["states"][-1][k] - last[k]).norm()
        assert err <= tol["update"] * change, f"{name}: {k} off by {err / change:.3f}"


def _coded_wire(name, plan, result, group_key, *, kinds, graph_, int8=False):
    """The gradient group ran the coded path: only the coded kinds (and the step's scalar
    loss all-reduce), and fewer bytes received than the same algorithm moves raw. Returns the
    measured wire ratio (raw fp32 bytes / coded bytes received).

    Bytes a rank receives, raw: the lossless algorithms (`compressed`) receive (ws - 1) / ws
    of each buffer (reduce-scatter, all-gather; an all-reduce is both); the int8 reduction
    (`quantize.quantized_reduce_scatter` / `quantized_all_reduce`) exchanges equal splits
    with the rank's own share included, so the whole buffer."""
    group = result["groups"][group_key]
    recs = [r for r in result["records"] if r.group == group and r.group_size > 1]
    ws = recs[0].group_size
    loss = [r for r in recs if r.kind == "all_reduce" and r.numel == 1]
    data = [r for r in recs if r not in loss and r.numel > ws]  # sizes exchanges: ws int64s
    assert {r.kind for r in recs if r not in loss} <= kinds, f"{name}: {[r.kind for r in recs]}"
    assert len(loss) <= 1
    experts = group_key == "replica"
    volume = expected_dp_volume(plan, graph_, result["coords"][0], experts=experts)
    raw = 0.0
    for kind, n in volume.items():
        share = 1.0 if int8 and kind != "all_gather" else (ws - 1) / ws
        raw += n * (2 if kind == "all_reduce" else 1) * 4 * share
    coded = sum(r.numel for r in data)
    assert 0 < coded < raw, f"{name}: {coded} coded bytes vs {raw} raw"
    return raw / coded


def test_dp_coding_reads_dense_then_expert_decisions():
    """`dp_coding` splits a stage's DP decisions as `Pricer.dp_traffic` lists them: the dense
    parameters' collectives, then the experts' (ZeRO-1/2: reduce-scatter, all-gather; ZeRO-3:
    two all-gathers, then the reduce-scatter), no process needed."""
    from meshplan.ir.plan import CommDecision
    from meshplan.runtime.data_parallel import RAW, DpCoding, dp_coding

    def plan(*methods):
        decisions = tuple(
            CommDecision("dp stage 0 in a", kind, tensor, "lossless", 1.0, 0.5, None, 2.0, n)
            for n, (kind, tensor) in enumerate(methods, start=1)
        )
        return types.SimpleNamespace(compression=CompressionPlan("auto", "", decisions))

    rs, ag = ("reduce_scatter", "gradients"), ("all_gather", "weights")
    l1, l2, l3, l4, _, l6 = (("lossless", n) for n in range(1, 7))  # chunks = position
    assert dp_coding(plan(rs, ag, rs, ag), 0) == DpCoding(l1, l2, l3, l4)
    assert dp_coding(plan(ag, ag, rs, ag, ag, rs), 0) == DpCoding(l3, l1, l6, l4)
    assert dp_coding(plan(rs, ag), 0) == DpCoding(l1, l2, RAW, RAW)  # no expert replicas
    ar = ("all_reduce", "gradients")  # ZeRO-0
    assert dp_coding(plan(ar, ar), 0) == DpCoding(l1, RAW, l2, RAW)
    assert dp_coding(plan(("all_reduce", "gradients")), 1) == DpCoding()


def test_planner_codes_only_what_the_runtime_codes():
    """On the two sites the planner codes DP traffic across the WAN; TP, CP and PP traffic
    stay raw with the reason the runtime gives (no process needed)."""
    tp = _plan(4, dict(dp=2, tp=2, micro_batch=2, global_batch=8), "off", {})
    for d in tp.compression.decisions:
        if d.group.startswith("tp in"):
            assert d.method == "raw" and "DTensor" in d.reason
    pp = _plan(4, dict(dp=2, pp=2, micro_batch=1, global_batch=8), "off", {})
    boundary = [d for d in pp.compression.decisions if d.group.startswith("pp boundary")]
    assert boundary and all(d.method == "raw" and "pipelining" in d.reason for d in boundary)
    # The planner put the pipeline across the WAN (stage s on site s) and DP inside the sites.
    assert [s.replicas for s in pp.stages] == [(("site-a", 2),), (("site-b", 2),)]
    with pytest.raises(ValueError, match="quantize_activations=True changes numerics"):
        _plan(2, dict(dp=2, micro_batch=2, global_batch=8, quantize_activations=True), "off", {})


def test_compression_two_ranks():
    plans, results = _launch(2, CONFIGS_2)
    ratios = {}
    for name, (_, quantize, method, model_kw) in CONFIGS_2.items():
        plan, r0 = plans[name], results[0][name]
        raw = [r[f"{name}/raw"] for r in results]
        assert_parity(f"{name}/raw", _reference(plan, model_kw), raw)
        for rank, r in enumerate(results):
            check_step_collectives(
                f"{name}/raw rank {rank}", plans[f"{name}/raw"], _graph(model_kw), r[f"{name}/raw"]
            )
        if method == "lossless" and quantize == "off":
            for r in results:
                _bit_identical(name, r[name], r[f"{name}/raw"])
        elif method == "int8":
            for r in results:
                _close_to(name, r[name], _reference(plan, model_kw), INT8_TOL)
        if quantize == "activations":
            assert_parity(
                name, _reference(plan, model_kw, quantized=True), [r[name] for r in results]
            )
            _close_to(name, r0, _reference(plan, model_kw), ACT_TOL)
        kinds = {"all_to_all", "all_gather"} if name == "ddp-int8" else {"all_to_all"}
        ratios[name] = _coded_wire(
            name, plan, r0, "grad", kinds=kinds, graph_=_graph(model_kw), int8=method == "int8"
        )
    # int8 block-scaled: 8 bits + a bf16 scale per 64 values against fp32's 32 bits.
    assert ratios["ddp-int8"] == pytest.approx(32 / 8.25, rel=0.02)
    assert all(v > 1.05 for v in ratios.values()), ratios


def test_compression_four_ranks():
    plans, results = _launch(4, CONFIGS_4)
    for name, (_, quantize, _, model_kw) in CONFIGS_4.items():
        plan, g = plans[name], _graph(model_kw)
        ref = _reference(plan, model_kw)
        assert_parity(f"{name}/raw", ref, [r[f"{name}/raw"] for r in results])
        for rank, r in enumerate(results):
            ignore = frozenset({"send", "recv", "all_to_all"}) if model_kw else None
            kw = {"ignore_kinds": ignore} if ignore else {}
            check_step_collectives(
                f"{name}/raw rank {rank}", plans[f"{name}/raw"], g, r[f"{name}/raw"], **kw
            )
        if name == "tpxdp-lossless":  # 2-rank gradient groups
            for r in results:
                _bit_identical(name, r[name], r[f"{name}/raw"])
        elif quantize == "activations":
            # TP shards the tensors, so quantization blocks differ from one process's.
            for r in results:
                _close_to(name, r[name], _reference(plan, model_kw, quantized=True), ACT_TOL)
                _close_to(name, r[name], ref, ACT_TOL)
        else:  # 4-rank reductions: rank-order fp32 sums (see the module docstring)
            assert_parity(name, ref, [r[name] for r in results])
        for r in results:
            _coded_wire(name, plan, r[name], "grad", kinds={"all_to_all"}, graph_=g)
            if model_kw:  # the expert gradients' replicas sit one per site
                _coded_wire(name, plan, r[name], "replica", kinds={"all_to_all"}, graph_=g)
