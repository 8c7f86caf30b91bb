"""The lossless codec: bit-exact round trips on every bit pattern, and its ratio on the bf16
tensors of a small transformer (weights, gradients, activations) after a few AdamW steps."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from meshplan.runtime.codec import (
    Compressed,
    compress,
    decompress,
    entropy_ideal_ratio,
)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
BITS = {torch.bfloat16: 16, torch.float16: 16, torch.float32: 32}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine a second OpenMP thread that cannot
    get a core makes every op wait for it (measured 40x slower steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def assert_bit_identical(x: torch.Tensor, y: torch.Tensor) -> None:
    assert y.dtype == x.dtype and y.shape == x.shape
    ix, iy = x.reshape(-1).view(INT_OF[x.dtype]), y.reshape(-1).view(INT_OF[x.dtype])
    bad = (ix != iy).nonzero()
    assert bad.numel() == 0, f"{bad.numel()} values differ, first at {bad[0].item()}"


def roundtrip(x: torch.Tensor, **kw) -> Compressed:
    c = compress(x, **kw)
    assert_bit_identical(x, decompress(c))
    assert_bit_identical(x, decompress(Compressed.from_buffer(c.data.clone())))
    return c


def special_patterns(dtype: torch.dtype) -> torch.Tensor:
    """±0, ±inf, NaNs with payloads and sign, subnormals, extremes, as raw bit patterns."""
    bits = BITS[dtype]
    exp_bits = 5 if dtype == torch.float16 else 8
    man = bits - 1 - exp_bits
    emax = (1 << exp_bits) - 1
    sign = 1 << (bits - 1)
    pats = [
        0,  # +0
        sign,  # -0
        emax << man,  # +inf
        sign | emax << man,  # -inf
        emax << man | 1 << (man - 1),  # quiet NaN
        emax << man | 1,  # signalling NaN payload
        sign | emax << man | (1 << man) - 1,  # negative NaN, all payload bits
        1,  # smallest subnormal
        sign | 1,
        (1 << man) - 1,  # largest subnormal
        1 << man,  # smallest normal
        (emax - 1) << man | (1 << man) - 1,  # largest finite
        sign | (emax - 1) << man | (1 << man) - 1,
    ]
    wrap = [p - (1 << bits) if p >= 1 << (bits - 1) else p for p in pats]
    return torch.tensor(wrap, dtype=INT_OF[dtype]).view(dtype)


# -- round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_arbitrary_bit_patterns_roundtrip(dtype, data):
    bits = BITS[dtype]
    values = data.draw(
        st.lists(st.integers(-(1 << (bits - 1)), (1 << (bits - 1)) - 1), max_size=300)
    )
    block = data.draw(st.sampled_from([8, 16, 64, 4096]))
    x = torch.tensor(values, dtype=torch.int64).to(INT_OF[dtype]).view(dtype)
    roundtrip(x, block=block)


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 20000),
    log_scale=st.integers(-30, 30),
    zero_frac=st.sampled_from([0.0, 0.01, 0.5, 1.0]),
    positive=st.booleans(),
    n_special=st.integers(0, 20),
    block=st.sampled_from([64, 512, 4096]),
)
def test_structured_tensors_roundtrip(
    dtype, seed, n, log_scale, zero_frac, positive, n_special, block
):
    """Gaussian data at any scale (subnormal to overflow), with exact zeros, one sign only,
    and special values sprinkled in: the cases that exercise every code path."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g, dtype=torch.float64) * 2.0**log_scale
    if positive:
        x = x.abs()
    x[torch.rand(n, generator=g) < zero_frac] = 0.0
    x = x.to(dtype)
    specials = special_patterns(dtype)
    idx = torch.randint(0, n, (n_special,), generator=g)
    x[idx] = specials[torch.randint(0, len(specials), (n_special,), generator=g)]
    roundtrip(x, block=block)


@pytest.mark.parametrize("dtype", DTYPES)
def test_special_values_roundtrip(dtype):
    specials = special_patterns(dtype)
    roundtrip(specials)
    roundtrip(specials.repeat(1000), block=64)
    x = torch.randn(10000).to(dtype)
    x[::7] = specials.repeat(10000 // 7 // len(specials) + 1)[: len(x[::7])]
    roundtrip(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (), (1,), (7,), (3, 5, 7), (4097,), (2, 4096)])
def test_shapes_roundtrip(dtype, shape):
    roundtrip(torch.randn(shape).to(dtype))


def test_non_contiguous_and_constant_inputs():
    x = torch.randn(64, 96).bfloat16().t()
    roundtrip(x)
    roundtrip(torch.zeros(9000, dtype=torch.bfloat16))  # all zeros: the zero code only
    roundtrip(torch.ones(9000, dtype=torch.float16))  # one exponent
    roundtrip(torch.full((9000,), -0.0, dtype=torch.float32))  # all -0: escapes
    roundtrip(torch.full((9000,), float("nan"), dtype=torch.bfloat16))


def test_incompressible_data_is_stored_raw():
    """Random bit patterns cannot be coded smaller; the buffer is then the raw bytes plus
    the header, never bigger."""
    x = torch.randint(-(2**15), 2**15, (50000,), dtype=torch.int16).view(torch.bfloat16)
    c = roundtrip(x)
    assert c.nbytes <= x.numel() * 2 + 256


def test_buffer_describes_itself_and_rejects_garbage():
    x = torch.randn(3, 1000).to(torch.float16)
    c = compress(x)
    c2 = Compressed.from_buffer(c.data)
    assert c2.dtype == torch.float16 and c2.shape == (3, 1000) and c2.nbytes == c.nbytes
    with pytest.raises(ValueError):
        decompress(torch.zeros(200, dtype=torch.uint8))
    with pytest.raises(TypeError):
        compress(torch.randn(10, dtype=torch.float64))


def test_always_positive_tensors_drop_the_sign_bit():
    x = torch.randn(100000).abs().bfloat16()
    signed = torch.randn(100000).bfloat16()
    assert compress(x).ratio > compress(signed).ratio + 0.1


def test_exact_zeros_store_nothing_but_a_code():
    """Embedding gradients are mostly zero rows: zeros cost only their code."""
    x = torch.zeros(1024, 256)
    x[torch.randperm(1024)[:100]] = torch.randn(100, 256)
    c = roundtrip(x.bfloat16())
    assert c.ratio > 4.0


# -- ratio on a small transformer -----------------------------------------------------------


@pytest.fixture(scope="module")
def trained_tiny():
    """The zoo's tiny Llama-style model after 3 AdamW steps on random tokens: its bf16
    weights, gradients and layer activations (Linear outputs)."""
    from meshplan import models

    torch.manual_seed(0)
    model, (tokens, targets) = models.get(
        "tiny", device="cpu", dtype="float32", micro_batch=2, seq_len=128
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, model.cfg.vocab, tokens.shape, generator=g)
        targets = torch.randint(0, model.cfg.vocab, tokens.shape, generator=g)
        opt.zero_grad()
        model(tokens, targets).backward()
        opt.step()
    acts: list[torch.Tensor] = []
    hooks = [
        m.register_forward_hook(lambda m, i, o: acts.append(o.detach()))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    opt.zero_grad()
    model(tokens, targets).backward()
    for h in hooks:
        h.remove()
    return {
        "weights": [p.detach() for p in model.parameters()],
        "gradients": [p.grad for p in model.parameters()],
        "activations": acts,
    }


@pytest.mark.parametrize("kind", ["weights", "gradients", "activations"])
def test_ratio_on_transformer_tensors(trained_tiny, kind):
    raw = coded = 0
    ideal_bits = 0.0
    for t in trained_tiny[kind]:
        x = t.to(torch.bfloat16)
        c = compress(x)
        raw += x.numel() * 2
        coded += c.nbytes
        ideal_bits += x.numel() * 16 / entropy_ideal_ratio(x)
    ratio = raw / coded
    ideal = raw * 8 / ideal_bits
    assert ratio >= 1.38, f"{kind}: ratio {ratio:.3f} (ideal {ideal:.3f})"
    assert ratio <= ideal * 1.02  # sanity: no free lunch beyond the entropy bound
    # spot-check exactness on the biggest tensor of the kind
    big = max(trained_tiny[kind], key=lambda t: t.numel()).to(torch.bfloat16)
    assert_bit_identical(big, decompress(compress(big)))


def test_entropy_ideal_matches_the_summary_range():
    """bf16 Gaussian: exponent entropy ~2.5 bits, so the ideal is 16/(8+2.5) ~ 1.5x."""
    r = entropy_ideal_ratio(torch.randn(200000).bfloat16())
    assert 1.45 < r < 1.56
