"""benchmarks/gpu_sustained.py: burst against sustained GEMM throughput (a GPU-only script)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.benchmark_module import benchmark_module


def test_refuses_without_a_gpu(monkeypatch, capsys):
    mod = benchmark_module("gpu_sustained")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert mod.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_measures_every_shape_on_a_gpu(tmp_path):
    mod = benchmark_module("gpu_sustained")
    out = tmp_path / "sustained.json"
    assert mod.main(["--seconds", "1", "--rest", "0", "-o", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["m"], r["n"], r["k"]) for r in rows] == list(mod.SHAPES)
    for r in rows:
        # a GEMM cannot beat the dense BF16 peak of any part (B200's 2.25 PFLOP/s)
        assert 0 < r["sustained_tflops"] < 2500 and 0 < r["burst_tflops"] < 2500
        ratio = r["sustained_tflops"] / r["burst_tflops"]
        assert r["sustained_over_burst"] == pytest.approx(ratio)
