"""Pricing of compression and quantization (cost_model/compression.py) against hand-derived
oracles, the runtime's own codec/quantizer, and the runtime's AGoQ rule."""

from __future__ import annotations

import math

import pytest
import torch
from meshplan.cost_model import compression as C
from meshplan.cost_model.collectives import Collective, Path, collective_time
from meshplan.ir.hardware import gpu_spec
from meshplan.runtime import quantize as Q

GB = 1e9


def test_pipeline_formula_by_hand():
    # first chunk passes all three stages (1 + 2 + 0.5), the other 3 leave one per 2 s
    assert C.pipelined_time(1.0, 2.0, 0.5, 4) == pytest.approx(9.5)
    assert C.pipelined_time(1.0, 2.0, 0.5, 1) == pytest.approx(3.5)


def test_sequential_and_pipelined_coded_p2p_by_hand():
    speed = C.CodecSpeed(1 * GB, 2 * GB)  # no per-call cost

    def xfer(n: float) -> float:  # a 1 GB/s link without latency
        return n / GB

    # 1 GB, ratio 2: encode 1 s, send 0.5 GB in 0.5 s, decode 0.5 s
    t1, c1 = C.coded_time(Collective.P2P, 1 * GB, 2, xfer, 2.0, speed, chunks=1)
    assert (t1, c1) == (pytest.approx(2.0), 1)
    # 4 chunks: stages 0.25 / 0.125 / 0.125 s -> 0.5 + 3 * 0.25
    t4, _ = C.coded_time(Collective.P2P, 1 * GB, 2, xfer, 2.0, speed, chunks=4)
    assert t4 == pytest.approx(1.25)
    # free choice: more chunks tend to the slowest stage (encode, 1 s) plus a vanishing fill
    best, chunks = C.coded_time(Collective.P2P, 1 * GB, 2, xfer, 2.0, speed)
    assert chunks == C.MAX_CHUNKS and 1.0 < best < 1.01


def test_codec_bytes_follow_the_runtime_algorithms():
    # all-reduce over 4 ranks = reduce-scatter (3/4 out, 3/4 in) + all-gather of the
    # reduced quarter (coded once, 3/4 in)
    assert C.codec_bytes(Collective.ALL_REDUCE, 1.0, 4) == pytest.approx((1.0, 1.5))
    assert C.codec_bytes(Collective.ALL_GATHER, 1.0, 4) == pytest.approx((0.25, 0.75))
    assert C.codec_bytes(Collective.REDUCE_SCATTER, 1.0, 4) == pytest.approx((0.75, 0.75))
    assert C.codec_bytes(Collective.P2P, 1.0, 2) == (1.0, 1.0)


def test_break_even_is_zipccls_inequality():
    speed = C.CodecSpeed(1 * GB, 1 * GB)
    r = 1.44
    seq, pipe = C.break_even_bandwidth(Collective.P2P, 2, r, speed)
    # ZipCCL: sequential pays iff B/C + B/D < 1 - 1/r  <=>  B < (1 - 1/r) / (2 / GB)
    assert seq == pytest.approx((1 - 1 / r) * GB / 2)
    assert pipe == pytest.approx(1 * GB)  # pipelined: whenever the codec outruns the link
    size = 1e9
    for bw, pays in ((0.9 * seq, True), (1.1 * seq, False)):

        def xfer(n: float, bw=bw) -> float:  # no latency
            return n / bw

        t, _ = C.coded_time(Collective.P2P, size, 2, xfer, r, speed, chunks=1)
        assert (t < xfer(size)) == pays


def test_gpu_estimate_is_hbm_over_passes():
    h100 = gpu_spec("H100")
    s = C.gpu_codec_speed(h100)
    assert s.compress_bps == pytest.approx(h100.hbm_bandwidth * 0.8 / 53.5)
    assert s.decompress_bps == pytest.approx(h100.hbm_bandwidth * 0.8 / 43.6)
    assert s.compress_overhead_s == pytest.approx(166 * 10e-6 + 6 * 20e-6)
    assert "estimate" in s.source
    assert C.codec_speed(gpu_spec("CPU")) is C.CPU_CODEC


def test_codec_traffic_constant_matches_a_dispatch_count():
    from meshplan.runtime import codec
    from torch.utils._python_dispatch import TorchDispatchMode

    views = {"view", "_unsafe_view", "slice", "select", "as_strided", "t", "transpose"}
    views |= {"unsqueeze", "squeeze", "expand", "alias", "detach", "split", "_reshape_alias"}

    class Bytes(TorchDispatchMode):
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func.overloadpacket).split(".")[-1] not in views:
                flat = [*args, *(kwargs or {}).values(), out]
                for x in flat:
                    for y in x if isinstance(x, (list, tuple)) else [x]:
                        if isinstance(y, torch.Tensor):
                            self.total += y.numel() * y.element_size()
            return out

    torch.set_num_threads(1)
    x = (torch.randn(1 << 20, generator=torch.Generator().manual_seed(0)) * 1e-3).bfloat16()
    with Bytes() as enc:
        c = codec.compress(x)
    with Bytes() as dec:
        codec.decompress(c)
    raw = x.numel() * 2
    assert enc.total / raw == pytest.approx(C.CODEC_TRAFFIC["bfloat16"][0], rel=0.1)
    assert dec.total / raw == pytest.approx(C.CODEC_TRAFFIC["bfloat16"][1], rel=0.1)


def test_predicted_ratios_are_the_measured_table():
    assert C.predicted_ratio("bfloat16", "gradients") == 1.460
    assert 1.43 <= C.predicted_ratio("bfloat16", "activations") <= 1.60
    assert C.predicted_ratio("float32", "weights") == pytest.approx(1.2, abs=0.03)
    assert C.predicted_ratio("float16", "activations") == pytest.approx(1.15, abs=0.03)
    assert C.predicted_ratio("int8", "weights") == 1.0
    with pytest.raises(ValueError, match="kind must be"):
        C.predicted_ratio("bfloat16", "logits")


@pytest.mark.parametrize("bits", [4, 8])
def test_error_proxy_matches_the_runtime_quantizer(bits):
    torch.set_num_threads(1)
    x = torch.randn(1 << 20, generator=torch.Generator().manual_seed(0))
    y = Q.dequantize(Q.quantize(x, bits))
    measured = float((y - x).pow(2).mean().sqrt() / x.pow(2).mean().sqrt())
    assert C.block_quant_rel_rms(bits) == pytest.approx(measured, rel=0.03)


def test_activation_bits_are_the_runtime_rule():
    for p in range(1, 9):
        for s in range(p):
            for kind in C.LAYER_KINDS:
                assert C.activation_bits(kind, s, p) == Q.agoq_bits(kind, s, p), (kind, s, p)


def test_decisions_wan_on_nvlink_off():
    h100 = gpu_spec("H100")
    opts = C.CommOptions()
    size = 64 * 2**20
    nvlink = Path(450e9 * 0.8, 2e-6)  # NVLink4 per GPU, efficiency 0.8 (hardware.py)
    wan = Path(100e9 / 8 * 0.5 / 8, 1e-3)  # a 100 Gb/s WAN at 0.5, shared by 8 streams

    def on(path, kind, n):
        return C.choose(
            kind,
            size,
            n,
            lambda x: collective_time(kind, x, n, path),
            opts,
            h100,
            "bfloat16",
            "activations",
        )

    assert on(nvlink, Collective.ALL_REDUCE, 8).method == "raw"
    got = on(wan, Collective.P2P, 2)
    assert got.method == "lossless" and got.time_s < got.raw_s
    assert got.ratio == C.predicted_ratio("bfloat16", "activations")
    # the measured CPU codec (0.07 GB/s) pays on the WAN stream only if it outruns it
    cpu = C.CommOptions(codec=C.CPU_CODEC)
    slow = C.choose(
        Collective.P2P,
        size,
        2,
        lambda x: collective_time(Collective.P2P, x, 2, wan),
        cpu,
        h100,
        "bfloat16",
        "activations",
    )
    assert slow.method == "raw"  # 0.78 GB/s per stream > 0.068 GB/s codec
    off = C.choose(
        Collective.P2P,
        size,
        2,
        lambda x: collective_time(Collective.P2P, x, 2, wan),
        None,
        h100,
        "bfloat16",
        "activations",
    )
    assert off.method == "raw" and math.isinf(off.lossless_s)


def test_int8_gradients_only_for_gradient_reductions_when_allowed():
    h100 = gpu_spec("H100")
    wan = Path(0.1e9, 1e-3)
    size = 256 * 2**20

    def pick(opts, kind, tensor):
        return C.choose(
            kind,
            size,
            8,
            lambda x: collective_time(kind, x, 8, wan),
            opts,
            h100,
            "bfloat16",
            tensor,
        )

    both = C.CommOptions(lossless=True, int8_gradients=True)
    assert pick(both, Collective.ALL_REDUCE, "gradients").method == "int8"  # 1.94x > 1.46x
    assert math.isinf(pick(both, Collective.ALL_GATHER, "weights").int8_s)
    assert math.isinf(pick(C.CommOptions(), Collective.ALL_REDUCE, "gradients").int8_s)
    assert C.int8_gradient_ratio() == pytest.approx(16 / 8.25)


def test_quantized_activation_memory_matches_the_runtime():
    """Predicted quantized / exact saved bytes of the tiny model (AGoQ, one stage) against
    what the runtime's saved-tensor hooks hold (fp32 model, same micro-batch)."""
    from meshplan import models
    from meshplan.cost_model.memory import block_memory
    from meshplan.ir.trace import trace

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, (tokens, targets) = models.get("tiny", device="cpu", dtype="float32", micro_batch=4)
    base = Q.measure_saved_bytes(model, None, tokens, targets)
    agoq = Q.measure_saved_bytes(model, Q.agoq_plan(model), tokens, targets)
    measured = agoq.held_bytes / base.held_bytes
    g = trace(model, tokens, targets)
    exact = quant = 0.0
    for u in g.units:
        block = dict(g.blocks)[u.block]
        bm = block_memory(block)
        qm = C.quantized_block_memory(block, bm)
        exact += bm.saved_tp + bm.saved_sp
        quant += qm.saved_tp + qm.saved_sp
    assert quant / exact == pytest.approx(measured, rel=0.25)
    assert quant / exact < 0.5  # docs/compression.md's bar: at least 45% less than fp32 and bf16
