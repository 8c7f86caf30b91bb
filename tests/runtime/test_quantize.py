"""AGoQ-style quantization: block quantization error bounds, per-layer widths, saved-tensor
hooks (memory and gradients on the zoo's tiny Llama-style model), and the 8-bit gradient
all-reduce (bit-identical to its single-process simulation; DDP hook and FSDP2
reduce-scatter within 1% of the exact average) on gloo."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from meshplan import models
from meshplan.runtime import quantize as Q


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: on a shared 2-core machine a second OpenMP thread that cannot
    get a core makes every op wait for it (measured 40x slower steps)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- block quantization ---------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(0, 3000),
    log_scale=st.integers(-40, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_quantization_error_is_half_a_step(bits, seed, n, log_scale, dtype):
    """|x - dq(q(x))| <= scale/2 per block (plus the dtype's own rounding), shape and dtype
    kept, zeros exact."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 2.0**log_scale
    x[torch.rand(n, generator=g) < 0.1] = 0.0
    x = x.to(dtype)
    if not torch.isfinite(x).all():
        return  # out of the dtype's range: nothing meaningful to quantize
    q = Q.quantize(x, bits)
    y = Q.dequantize(q)
    assert y.shape == x.shape and y.dtype == x.dtype
    if n == 0:
        return
    pad = -n % Q.DEFAULT_BLOCK
    xb = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, Q.DEFAULT_BLOCK)
    yb = torch.nn.functional.pad(y.float(), (0, pad)).view(-1, Q.DEFAULT_BLOCK)
    step = q.scales.float().view(-1, 1)
    # the cast back to the dtype adds half an ulp (or half the smallest subnormal)
    info = torch.finfo(dtype)
    dtype_ulp = xb.abs() * info.eps + info.tiny * info.eps
    assert ((xb - yb).abs() <= step * 0.5 * (1 + 1e-3) + dtype_ulp).all()
    assert (y[x == 0] == 0).all()


def test_four_bit_packing_and_sizes():
    x = torch.arange(-7, 8, dtype=torch.float32).repeat(64)[:960]  # exact multiples of 1
    x[::64] = 7.0  # every block's absmax is 7, so the scale is exactly 1
    q = Q.quantize(x, 4)
    assert torch.equal(Q.dequantize(q), x)
    assert q.data.numel() == 960 // 2 and q.nbytes == 480 + 2 * 15
    q8 = Q.quantize(torch.randn(4096), 8)
    assert q8.nbytes == 4096 + 2 * 64  # 8.25 bits a value
    with pytest.raises(ValueError):
        Q.quantize(x, 3)


# -- per-layer widths -----------------------------------------------------------------------


def test_agoq_bits_by_kind_and_stage():
    assert Q.agoq_bits("norm") == 8 and Q.agoq_bits("head") == 8
    assert Q.agoq_bits("mlp") == 4 and Q.agoq_bits("attention") == 4
    assert Q.agoq_bits("embedding") is None
    # 4 stages under 1F1B hold 4, 3, 2, 1 micro-batches: attention is 4-bit on the first two
    assert [Q.agoq_bits("attention", s, 4) for s in range(4)] == [4, 4, 8, 8]
    assert all(Q.agoq_bits("mlp", s, 4) == 4 for s in range(4))
    with pytest.raises(ValueError):
        Q.agoq_bits("mlp", 4, 4)


def test_agoq_plan_on_the_zoo_model():
    model, _ = models.get("tiny", device="meta")
    plan = Q.agoq_plan(model)
    assert plan[""] == 8 and plan["lm_head"] == 8 and plan["embed"] is None
    assert plan["layers.0.attn"] == 4 and plan["layers.3.mlp"] == 4
    assert plan["layers.0.attn_norm"] == 8 and plan["norm"] == 8
    assert "layers.0.attn.q_proj" not in plan  # inherits from its attention block


# -- saved-tensor hooks ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return models.get("tiny", device="cpu", dtype="float32", micro_batch=2, seq_len=128)


def _grads(model, tokens, targets, bits):
    model.zero_grad()
    with Q.ActivationQuantizer(model, bits):
        loss = model(tokens, targets)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _rel_err(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    num = sum(((x - y) ** 2).sum() for x, y in zip(a, b))
    return float((num / sum((y**2).sum() for y in b)).sqrt())


def test_activation_memory_drops_by_more_than_45_percent(tiny):
    model, (tokens, targets) = tiny
    base = Q.measure_saved_bytes(model, None, tokens, targets)
    agoq = Q.measure_saved_bytes(model, Q.agoq_plan(model), tokens, targets)
    assert base.quantized == 0 and agoq.quantized > 0 and set(agoq.by_bits) == {4, 8}
    assert 1 - agoq.held_bytes / base.held_bytes >= 0.45  # against fp32 activations
    assert 1 - agoq.held_bytes / base.bf16_bytes >= 0.45  # against bf16 activations


def test_gradients_stay_close_and_forward_is_unchanged(tiny):
    model, (tokens, targets) = tiny
    loss0, g0 = _grads(model, tokens, targets, None)
    loss8, g8 = _grads(model, tokens, targets, 8)
    loss_a, ga = _grads(model, tokens, targets, Q.agoq_plan(model))
    assert loss0 == loss8 == loss_a  # only what backward reads is quantized
    assert _rel_err(g8, g0) < 0.03
    assert _rel_err(ga, g0) < 0.2


def test_exact_tensors_and_hook_lifetime(tiny):
    model, (tokens, targets) = tiny
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: list[object] = []
    aq = Q.ActivationQuantizer(model, 4)
    pack = aq._pack

    def spy(t):
        out = pack(t)
        seen.append((t.untyped_storage().data_ptr() in params, out))
        return out

    aq._pack = spy
    with aq:
        model(tokens, targets)
    assert all(not isinstance(out, Q.Quantized) for is_param, out in seen if is_param)
    assert any(isinstance(out, Q.Quantized) for _, out in seen)
    n = len(seen)
    model(tokens, targets)  # outside the context: no hooks left behind
    assert len(seen) == n
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    with pytest.raises(ValueError):
        Q.ActivationQuantizer(model, {"no.such.module": 4})


def _markov_batch(g: torch.Generator, table: torch.Tensor, batch: int, seq: int):
    """Tokens from a fixed random bigram language (each token has a few likely successors),
    so the loss falls gradually instead of sitting at ln(vocab)."""
    vocab = table.shape[0]
    x = torch.empty(batch, seq + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for i in range(seq):
        x[:, i + 1] = torch.multinomial(table[x[:, i]], 1, generator=g).squeeze(1)
    return x[:, :-1], x[:, 1:]


def train_losses(bits_fn, steps: int, *, seq: int = 128, batch: int = 4) -> list[float]:
    """AdamW on the tiny model with saved activations at `bits_fn(model)` widths."""
    torch.manual_seed(0)
    model, _ = models.get("tiny", device="cpu", dtype="float32", seq_len=seq)
    g = torch.Generator().manual_seed(1)
    table = torch.distributions.Dirichlet(torch.full((8,), 0.5)).sample((model.cfg.vocab,))
    succ = torch.randint(0, model.cfg.vocab, (model.cfg.vocab, 8), generator=g)
    probs = torch.zeros(model.cfg.vocab, model.cfg.vocab).scatter_add_(1, succ, table)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    bits = bits_fn(model)
    losses = []
    for _ in range(steps):
        tokens, targets = _markov_batch(g, probs, batch, seq)
        with Q.ActivationQuantizer(model, bits):
            loss = model(tokens, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_short_training_tracks_the_unquantized_run():
    base = train_losses(lambda m: None, 15, seq=64)
    agoq = train_losses(Q.agoq_plan, 15, seq=64)
    assert sum(base[-3:]) / 3 < base[0] - 0.8  # it learns
    assert abs(sum(agoq[-5:]) / sum(base[-5:]) - 1) < 0.03


@pytest.mark.slow
def test_300_steps_within_2_percent():
    base = train_losses(lambda m: None, 300)
    agoq = train_losses(Q.agoq_plan, 300)
    assert abs(sum(agoq[-10:]) / sum(base[-10:]) - 1) < 0.02


# -- 8-bit gradient all-reduce --------------------------------------------------------------


def test_simulated_all_reduce_error_bound():
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(5000, generator=g) * (r + 1) for r in range(3)]
    exact = sum(xs) / 3
    got = Q.simulate_quantized_all_reduce(xs)
    assert got.shape == exact.shape and got.dtype == exact.dtype
    assert float((got - exact).norm() / exact.norm()) < 0.01


def _dist_checks() -> dict[str, object]:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    me, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, object] = {}
    xs = [
        torch.randn(1000 + 7, generator=torch.Generator().manual_seed(r)) * (r + 1)
        for r in range(ws)
    ]
    got = Q.quantized_all_reduce(xs[me])
    out["all_reduce_matches_simulation"] = torch.equal(got, Q.simulate_quantized_all_reduce(xs))
    out["all_reduce_digest"] = float(got.sum())
    got_bf16 = Q.quantized_all_reduce(xs[me].bfloat16(), op="sum")
    sim_bf16 = Q.simulate_quantized_all_reduce([x.bfloat16() for x in xs], op="sum")
    out["all_reduce_bf16_sum"] = torch.equal(got_bf16, sim_bf16)

    def mlp():
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
        )

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(10 + me))
    local = mlp()
    local(x).pow(2).mean().backward()
    exact = [p.grad.clone() for p in local.parameters()]
    for e in exact:
        dist.all_reduce(e)
        e /= ws

    # DDP comm hook
    model = mlp()
    ddp = DDP(model)
    calls = []

    def hook(state, bucket):
        calls.append(bucket.buffer().numel())
        return Q.quantized_allreduce_hook(state, bucket)

    ddp.register_comm_hook(Q.QuantHookState(), hook)
    ddp(x).pow(2).mean().backward()
    out["ddp_calls"] = len(calls)
    out["ddp_err"] = max(
        float((p.grad - e).norm() / e.norm()) for p, e in zip(model.parameters(), exact)
    )
    out["ddp_digest"] = float(sum(p.grad.sum() for p in model.parameters()))

    # FSDP2 custom reduce-scatter
    class Counting(Q.QuantizedReduceScatter):
        calls = 0

        def __call__(self, *args, **kwargs):
            Counting.calls += 1
            return super().__call__(*args, **kwargs)

    fmodel = mlp()
    for layer in (fmodel[0], fmodel[2], fmodel):
        fully_shard(layer)
        layer.set_custom_reduce_scatter(Counting())
    fmodel(x).pow(2).mean().backward()
    out["fsdp_calls"] = Counting.calls
    out["fsdp_err"] = max(
        float((p.grad.full_tensor() - e).norm() / e.norm())
        for p, e in zip(fmodel.parameters(), exact)
    )
    return out


def test_quantized_gradient_sync_on_gloo():
    from meshplan.runtime.launch import run_local

    results = run_local(_dist_checks, 3, timeout_s=90, collective_timeout_s=60)
    for rank, r in enumerate(results):
        assert r["all_reduce_matches_simulation"] and r["all_reduce_bf16_sum"], rank
        assert r["ddp_calls"] >= 1 and r["ddp_err"] < 0.01, (rank, r)
        assert r["fsdp_calls"] >= 2 and r["fsdp_err"] < 0.01, (rank, r)
    for key in ("all_reduce_digest", "ddp_digest"):
        assert len({r[key] for r in results}) == 1, f"ranks disagree on {key}"


def test_install_from_plan_reads_the_recorded_widths_and_methods():
    from meshplan import models
    from meshplan.ir.plan import CommDecision, CompressionPlan, QuantizationPlan
    from meshplan.runtime import data_parallel

    model, _ = models.get("tiny", device="meta", micro_batch=1)
    kinds = (("attention", 8), ("embedding", None), ("head", 8), ("mlp", 4), ("norm", 8))
    grad = CommDecision(
        "dp stage 1 across a+b",
        "reduce_scatter",
        "gradients",
        "lossless",
        1.0,
        0.7,
        None,
        1.46,
        4,
    )

    class FakePlan:  # only the two fields the readers use
        quantization = QuantizationPlan("activations", ((1, kinds),))
        compression = CompressionPlan("auto", "", (grad,))

    bits = Q.plan_activation_bits(FakePlan, model, stage=1)
    expect = Q.agoq_plan(model, stage=1, num_stages=2)  # attention at 8 bits on stage 1 of 2
    assert bits == expect
    assert Q.plan_activation_bits(FakePlan, model, stage=0) is None
    assert data_parallel.plan_gradient_method(FakePlan, stage=1) == ("lossless", 4)
    assert data_parallel.plan_gradient_method(FakePlan, stage=0) == ("raw", 1)
    # no DDP given: nothing registered
    hooks = data_parallel.install_from_plan(FakePlan, model, stage=1)
    assert isinstance(hooks.activations, Q.ActivationQuantizer) and hooks.gradients == "raw"
