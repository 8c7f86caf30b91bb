"""The validation protocol of benchmarks/fidelity.py, without running the benchmark.

Unit tier: no tracing, no published-run table. Checks that leave-one-source-out never lets a
held-out source's rows reach the fit, that a GPU type whose only source is held out falls back
to values no row of that source set, the constant-MFU baseline against a hand-computed row, and
how an llm-foundry row is read.
"""

from __future__ import annotations

import math

import pytest

from tests.benchmark_module import benchmark_module


@pytest.fixture(scope="module")
def fid():
    """benchmarks/fidelity.py as a module (benchmarks/ is not a package)."""
    return benchmark_module("fidelity")


SOURCES = {
    "A": "Korthikanti et al. MLSys23 (arXiv 2205.05198) Table 5",
    "B": "mosaicml/llm-foundry scripts/train/benchmarking/README.md [A100 80GB]",
    "C": "pytorch/torchtitan docs/performance.md",
}


def _case(fid, row: int, source: str, work: float, slow: float = 1.0, cluster="dgx2-v100"):
    """A counted V100 row whose step takes `work` / GEMM efficiency, measured at efficiency 0.6
    times `slow` (a V100: the A100's and H100's GEMM efficiencies are measured on kernels and
    never fitted, `KERNEL_MEASURED_GEMM`)."""
    return fid.Case(
        row=row,
        source=SOURCES[source],
        model="m",
        metric="step",
        value=0.0,
        gpus=8,
        gpu_type="V100",
        params=1e9,
        seq_len=2048,
        cluster=cluster,
        parallel={"global_batch": 8},
        measured_step_s=work / 0.6 * slow,
    )


def _work(case) -> float:
    return float(case.row)


def _synthetic_predictor(calls: list | None = None):
    """Step = work / GEMM efficiency of the row's GPU type: a cost model with one constant."""

    def predict(cases, table):
        if calls is not None:
            calls.append({c.row for c in cases})
        return {c.row: _work(c) / table[c.gpu_type].gemm for c in cases}

    return predict


B_ROWS = (4, 5, 6, 10, 11, 12, 13)


def _table(fid, slow_b: float):
    """Rows 1-3 of source A and 7-9 of source C measured at efficiency 0.6; source B's seven
    rows (a majority of every fit that contains them) measured `slow_b` times slower."""
    cases = [_case(fid, r, "A", r) for r in (1, 2, 3)]
    cases += [_case(fid, r, "B", r, slow_b) for r in B_ROWS]
    cases += [_case(fid, r, "C", r) for r in (7, 8, 9)]
    return cases


def test_loso_prediction_of_a_source_ignores_its_own_rows(fid):
    """Making source B's measured times 10x slower or 10x faster leaves B's leave-one-source-out
    predictions exactly where the other sources put them (GEMM efficiency 0.6), while B's
    in-sample refit follows B. The other sources' LOSO predictions do move with B: the fit does
    use every source it is allowed to."""
    predictions = {}
    for slow_b in (10.0, 0.1):
        cases = _table(fid, slow_b)
        steps, fits = fid.leave_out(cases, fid.source_of, _synthetic_predictor())
        predictions[slow_b] = steps
        held_b = fid.source_of(cases[3])
        assert held_b == "llm-foundry"
        assert fits[held_b]["V100"].rows == (1, 2, 3, 7, 8, 9)
        for c in cases:
            if fid.source_of(c) == held_b:
                assert steps[c.row] == pytest.approx(_work(c) / 0.6, rel=1e-3)
        refit = fid.fit_constants(cases, _synthetic_predictor())["V100"].efficiency.gemm
        assert refit == pytest.approx(0.3 if slow_b > 1 else 0.9, abs=1e-3)  # at B's bound
    assert all(predictions[10.0][r] == predictions[0.1][r] for r in B_ROWS)
    assert predictions[10.0][1] != pytest.approx(predictions[0.1][1], rel=0.1)


def test_loso_never_passes_held_out_rows_to_the_fit(fid):
    """Every call the fit makes while source B is held out names only rows of A and C; B's rows
    are only ever predicted, once, on their own."""
    cases = _table(fid, 10.0)
    calls: list[set[int]] = []
    counted_a_c = [c for c in cases if fid.source_of(c) != "llm-foundry"]
    fid.fit_constants(counted_a_c, _synthetic_predictor(calls))
    assert calls and all(call <= {1, 2, 3, 7, 8, 9} for call in calls)
    calls.clear()
    fid.leave_out(cases, fid.source_of, _synthetic_predictor(calls))
    b = set(B_ROWS)
    assert [call for call in calls if call & b and not call <= b] != []  # A's and C's fits use B
    assert [call for call in calls if call <= b] == [b]  # B itself: one prediction call


def test_a_type_whose_only_source_is_held_out_gets_nothing_fitted_on_it(fid):
    """With no rows of its own the power-capped H100 takes the H100 group's fit; with no rows
    at all a type gets its prior: the published attention fractions (the H100's for the 500 W
    part, whose shipped ones are fitted) and the uncalibrated GEMM efficiency."""
    from meshplan.cost_model.compute import DEFAULT_EFFICIENCY, KERNEL_EFFICIENCY

    prior = fid.prior_efficiency("H100-96GB-500W")
    assert prior.gemm == DEFAULT_EFFICIENCY.gemm and prior.gemm_fp8 is None
    assert prior.attention_fwd == KERNEL_EFFICIENCY["H100"].attention_fwd
    assert prior.attention_fwd != KERNEL_EFFICIENCY["H100-96GB-500W"].attention_fwd

    h100 = fid.GroupFit(
        "H100",
        fid.dataclasses.replace(prior, gemm=0.61),
        (fid.FieldFit("gemm", 0.61, (11, 12, 13)),),
        (11, 12, 13),
    )
    table = fid.efficiency_table({"H100": h100})
    assert table["H100-96GB-500W"].gemm == 0.61
    assert table["H200"].gemm == 0.61  # fitted with the H100 as one group
    assert table["V100"].gemm == DEFAULT_EFFICIENCY.gemm
    assert table["A100-40GB"] == table["A100-80GB"] == fid.prior_efficiency("A100-80GB")

    # what-if: groups without long-sequence rows take the fitted groups' attention scale
    a100_prior = fid.prior_efficiency("A100-80GB")
    a100 = fid.GroupFit(
        "A100-80GB",
        fid._with(a100_prior, "attention", 0.5, a100_prior),
        (fid.FieldFit("attention", 0.5, (1, 2, 3)),),
        (1, 2, 3),
    )
    shared = fid.efficiency_table({"H100": h100, "A100-80GB": a100}, shared_attention=True)
    assert shared["H100"].gemm == 0.61
    assert shared["H100"].attention_fwd == pytest.approx(0.5 * prior.attention_fwd)
    assert shared["A100-80GB"].attention_bwd == pytest.approx(0.5 * a100_prior.attention_bwd)
    plain = fid.efficiency_table({"H100": h100, "A100-80GB": a100})
    assert plain["H100"].attention_fwd == prior.attention_fwd


def test_constant_mfu_baseline_on_a_hand_computed_row(fid):
    """1e9 parameters, 8 x 2048 tokens per step on 8 A100s (312 TFLOP/s bf16) at MFU 0.5:
    6 * 1e9 * 16384 / (8 * 0.5 * 312e12) = 0.078769... s. The V100 rows (fp16) use 125 TFLOP/s.
    The fitted MFU is the median achieved one, so its signed errors have a zero median."""
    case = _case(fid, 1, "A", 1.0, cluster="dgx-a100")
    assert fid.baseline_step(case, 0.5) == pytest.approx(6e9 * 16384 / (8 * 0.5 * 312e12))
    assert fid.baseline_step(case, 0.5) == pytest.approx(0.0787692, rel=1e-6)
    v100 = fid.dataclasses.replace(case, cluster="dgx2-v100", dtype="float16")
    assert fid.baseline_step(v100, 0.5) == pytest.approx(6e9 * 16384 / (8 * 0.5 * 125e12))
    rows = [
        fid.dataclasses.replace(case, row=i, measured_step_s=t) for i, t in enumerate((1, 2, 4))
    ]
    mfu = fid.fit_mfu(rows)
    assert mfu == pytest.approx(fid.baseline_step(case, 1.0) / 2)
    errors = sorted(fid.baseline_step(c, mfu) / c.measured_step_s - 1 for c in rows)
    assert errors[1] == pytest.approx(0.0, abs=1e-12)
    # leave-one-source-out MFU: fitted on the other sources' rows only
    a, b = fid.dataclasses.replace(rows[0], status="counted"), rows[1]
    b = fid.dataclasses.replace(b, source=SOURCES["B"], cluster="mosaic-a100-80")
    mfus = fid.mfu_leave_out([a, b], fid.source_of)
    assert mfus["llm-foundry"] == pytest.approx(fid.fit_mfu([a]))
    assert mfus["Korthikanti 2022"] == pytest.approx(fid.fit_mfu([b]))


def test_llm_foundry_row_is_read_as_the_source_documents(fid):
    """MPT-7B at 2048 tokens, 8 x A100-40GB, FSDP, micro-batch 12, full recompute, 3679
    tokens/s/GPU (the README's table): GPT-style MPT with vocab 50368 and ffn 4h whose zoo
    parameter count is the README's NumParams, ZeRO-3, eager kernels, 40 GB cluster, and
    step = 384 * 2048 / (3679 * 8)."""
    row = {
        "source": "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 4952183, "
        "2024-04) [A100 40GB with 1600 Gbps node-node interconnect (RoCE)]",
        "model": "MPT-7b",
        "params_b": "6.659",
        "layers": "32",
        "hidden": "4096",
        "heads": "32",
        "seq_len": "2048",
        "gpus": "8",
        "gpu_type": "A100-40GB",
        "tp": "1",
        "pp": "1",
        "dp": "8",
        "cp": "",
        "ep": "",
        "micro_batch": "12",
        "global_batch": "384",
        "recompute": "full",
        "measured_metric": "tokens_per_sec_per_gpu",
        "measured_value": "3679",
        "notes": "FSDP FULL_SHARD (ZeRO-3); precision=bf16; MFU=50.92%; HFU=67.89%; "
        "grad_accum=4; 1600 Gbps node-node RoCE; FlashAttention",
    }
    case = fid.interpret(153, row)
    assert case.status == "counted", case.reason
    assert case.arch == fid.Arch(None, 32, 4096, 32, 4 * 4096, 50368, "gpt", "flash")
    assert fid.mpt_params(32, 4096, 32, 2048) == 6658859008  # the README's NumParams
    assert fid.mpt_params(32, 4096, 32, 65536) == 6918905856  # the position table grows
    assert case.cluster == "mosaic-a100-40" and fid._gpu_of(case) == "A100-40GB"
    assert case.parallel | {"cp": 1} == {
        "dp": 8,
        "tp": 1,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "global_batch": 384,
        "micro_batch": 12,
        "recompute": "full",
        "zero": 3,
    }
    # eager PyTorch (no fused norms) with MPT's Triton FlashAttention (priced as FA 1.x) and
    # flash-attn's fused cross entropy (the benchmark script's attn_impl, MPT's loss_fn)
    assert case.engine == {"attention": "flash1", "fused_loss": True}
    assert case.measured_step_s == pytest.approx(384 * 2048 / (3679 * 8))
    assert "50.92%" in case.conversion and "50.9" in case.conversion.split("vs ")[1]
    assert fid.source_of(case) == "llm-foundry"
    assert fid.fit_group(fid._gpu_of(case)) == "A100-80GB"
    wrong = fid.interpret(153, row | {"params_b": "7.5"})
    assert wrong.status == "excluded" and "parameter count" in wrong.reason


def test_sources_are_publishers_not_tables(fid):
    """torchtitan's tables and pages are one source; so are llm-foundry's two A100 tables."""
    names = [
        "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (Dec 2024) Table 1",
        "pytorch/torchtitan docs/performance.md (commit 877991a70",
        "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md",
    ]
    case = _case(fid, 1, "A", 1.0, cluster="dgx-a100")
    assert {fid.source_of(fid.dataclasses.replace(case, source=n)) for n in names} == {"torchtitan"}
    assert math.isnan(case.refit_step_s)


def test_cost_model_predictor_prices_with_the_table_and_restores_the_shipped_one(
    fid, gpu_time_only
):
    """The real predictor (on a synthetic graph, no tracing): a lower GEMM efficiency gives a
    slower step, the case itself is not changed, and the shipped efficiencies are back after."""
    from meshplan.cost_model.compute import KERNEL_EFFICIENCY

    from tests.synthetic import transformer_graph

    arch = fid.Arch(None, 2, 512, 8, 2048, 1024, "gpt")
    fid._GRAPHS[arch.key(256)] = transformer_graph(2, 512, 8, 8, 2048, 1024, 256, 1)
    case = _case(fid, 1, "A", 1.0, cluster="dgx-a100")
    case = fid.dataclasses.replace(
        case,
        arch=arch,
        seq_len=256,
        parallel={"dp": 8, "tp": 1, "pp": 1, "cp": 1, "ep": 1, "global_batch": 16}
        | {"micro_batch": 2, "recompute": "none", "zero": 3},
    )
    shipped = dict(KERNEL_EFFICIENCY)
    predict = fid.cost_model_predictor(None)
    a100 = shipped["A100-80GB"]
    slow = predict([case], {"A100-80GB": fid.dataclasses.replace(a100, gemm=0.4)})[1]
    fast = predict([case], {"A100-80GB": fid.dataclasses.replace(a100, gemm=0.8)})[1]
    assert slow > fast > 0
    assert math.isnan(case.predicted_step_s)
    assert KERNEL_EFFICIENCY == shipped
    assert predict([case], {})[1] == pytest.approx(
        predict([case], {"A100-80GB": a100})[1], rel=1e-12
    )


def test_a_kernel_measured_gemm_is_never_fitted(fid):
    """The A100's GEMM efficiency comes from measured kernels (`KERNEL_MEASURED_GEMM`): however
    slow or fast its step rows are, the fit keeps the shipped value, in sample and held out."""
    from meshplan.cost_model.compute import KERNEL_EFFICIENCY

    shipped = KERNEL_EFFICIENCY["A100-80GB"].gemm
    for slow in (10.0, 0.1):
        cases = [_case(fid, r, "A", r, slow, "dgx-a100") for r in (1, 2, 3)]
        cases += [_case(fid, r, "C", r, slow, "dgx-a100") for r in (7, 8, 9)]
        fits = fid.fit_constants(cases, _synthetic_predictor())
        assert fits["A100-80GB"].efficiency.gemm == shipped
        assert fits["A100-80GB"].field("gemm") is None
