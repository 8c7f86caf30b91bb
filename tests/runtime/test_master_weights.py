"""Mixed precision as the planner prices it: 16-bit parameters stepped through fp32 masters
(`runtime.precision.with_master_weights`, applied by `apply` for bf16 / fp16 / fp8 plans).

Oracles: an update smaller than a bf16 ulp, summed by hand in fp32; and a single process that
keeps its fp32 masters in a few lines of its own, against 2 gloo ranks under DDP and FSDP2."""

from __future__ import annotations

import meshplan
import pytest
import torch
from meshplan.runtime import RuntimePlanError, run_local
from meshplan.runtime.precision import make_optimizer, with_master_weights

from tests.runtime.harness import CFG, SEQ, batch, loss_fn, sgd_reference

LR = 0.05


def test_updates_below_a_bf16_ulp_accumulate_in_the_master():
    """100 SGD steps of 1e-4 on a weight of 1.0: bf16 alone never moves (its ulp at 1 is
    2^-7, the step rounds away), the master reaches 0.99 and the weight its bf16 rounding."""
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = with_master_weights([w], lambda ps: torch.optim.SGD(ps, lr=1e-4))
    ref = torch.optim.SGD([plain], lr=1e-4)
    ((_, master),) = opt.meshplan_masters
    for _ in range(100):
        w.grad = torch.ones_like(w)
        plain.grad = torch.ones_like(plain)
        opt.step()
        ref.step()
        assert w.grad is None and master.grad is None  # both freed by the step's hooks
    expect = torch.ones(4, dtype=torch.float32)
    for _ in range(100):
        expect -= 1e-4
    assert torch.equal(master.detach(), expect)
    assert torch.equal(w.detach(), expect.to(torch.bfloat16))
    assert torch.equal(plain.detach(), torch.ones(4, dtype=torch.bfloat16))  # the lost updates


def test_the_callers_optimizer_is_what_the_runner_steps():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))
    opt = with_master_weights([w, w], lambda ps: torch.optim.AdamW(ps, lr=1e-3))
    assert isinstance(opt, torch.optim.AdamW) and len(opt.meshplan_masters) == 1  # tied: once
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    w.grad = torch.randn_like(w)
    opt.step()
    sched.step()
    ((_, master),) = opt.meshplan_masters
    state = opt.state[master]
    assert state["exp_avg"].dtype == state["exp_avg_sq"].dtype == torch.float32
    assert w.dtype == torch.bfloat16 and opt.param_groups[0]["lr"] == pytest.approx(5e-4)
    with pytest.raises(RuntimePlanError, match="optimizer factory"):
        with_master_weights([w], lambda ps: torch.optim.SGD([w], lr=0.1))  # ignores its input


def test_the_choice_follows_the_plan():
    w = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.bfloat16))

    class P:  # what make_optimizer reads of a plan
        precision = "bf16"

    factory = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    assert hasattr(make_optimizer([w], factory, P()), "meshplan_masters")
    assert not hasattr(make_optimizer([w], factory, P(), master_weights=False), "meshplan_masters")
    P.precision = "fp32"
    assert not hasattr(make_optimizer([w], factory, P()), "meshplan_masters")
    f32 = torch.nn.Parameter(torch.randn(2))
    P.precision = "bf16"
    assert not hasattr(make_optimizer([f32], factory, P()), "meshplan_masters")  # no 16-bit


def _bf16_model(seed: int = 0):
    torch.manual_seed(seed)
    model, _ = meshplan.models.transformer(dtype="bfloat16", device="cpu", **CFG)
    return model


def _plan(**parallel):
    model, _ = meshplan.models.transformer(dtype="bfloat16", micro_batch=1, **CFG)
    example = torch.zeros(1, SEQ, dtype=torch.long, device="meta")
    g = meshplan.trace(model, example, example)
    cluster = meshplan.Cluster.preset("cpu", gpus=2)
    return meshplan.estimate_plan(g, cluster=cluster, parallel=meshplan.Parallel(**parallel))


class _HandMasters:
    """One process's own fp32 masters, in a few lines: SGD on fp32 copies of the bf16 model's
    parameters from its gradients, the model set to their bf16 rounding."""

    def __init__(self, model):
        self.params = list(model.parameters())
        self.masters = [p.detach().float() for p in self.params]

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m -= LR * p.grad.float()
            p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def _reference(global_batch: int, micro_batches: int, steps: int):
    model = _bf16_model()
    losses, states = sgd_reference(
        model, batch, loss_fn, global_batch, micro_batches, steps, opt=_HandMasters(model)
    )
    return losses, {n: v.float() for n, v in states[-1].items()}


def _ranks(plans, steps):
    from meshplan.runtime import apply

    out = {}
    for name, plan in plans.items():
        runner = apply(_bf16_model(), plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=LR))
        losses = [
            runner.step(*batch(plan.parallel.global_batch, s)) for s in range(steps)
        ]  # fmt: skip
        dtypes = {m.dtype for _, m in runner.optimizer.meshplan_masters}
        state = {k: v.float() for k, v in runner.full_state_dict().items()}
        out[name] = {"losses": losses, "state": state, "master_dtypes": dtypes}
    return out


def test_ddp_and_fsdp2_train_as_one_process_with_fp32_masters():
    plans = {
        "ddp": _plan(dp=2, micro_batch=2, global_batch=8),
        "fsdp-zero3": _plan(dp=2, zero=3, micro_batch=2, global_batch=8),
    }
    assert {p.precision for p in plans.values()} == {"bf16"}
    steps = 3
    results = run_local(_ranks, 2, plans, steps, timeout_s=240)
    ref_losses, ref_state = _reference(8, 2, steps)
    for name in plans:
        for rank, r in enumerate(results):
            got = r[name]
            assert got["master_dtypes"] == {torch.float32}, (name, rank)
            # bf16 activations: the ranks' micro-batches and reductions round differently
            assert got["losses"] == pytest.approx(ref_losses, rel=2e-2), (name, rank)
        state = results[0][name]["state"]
        assert state.keys() == ref_state.keys()
        for k, v in ref_state.items():
            assert torch.allclose(state[k], v, atol=2e-2, rtol=2e-2), (name, k)


def _foreach_ranks(plans, steps):
    from meshplan.runtime import apply

    out = {}
    for name, plan in plans.items():
        runner = apply(
            _bf16_model(), plan, loss_fn, lambda ps: torch.optim.SGD(ps, lr=LR, foreach=True)
        )
        losses = [runner.step(*batch(plan.parallel.global_batch, s)) for s in range(steps)]
        state = {k: v.float() for k, v in runner.full_state_dict().items()}
        out[name] = {"losses": losses, "state": state}
    return out


def test_tensor_parallel_steps_a_foreach_optimizer_as_one_process():
    # TP without SP leaves the norms plain tensors beside the sharded DTensors: a foreach
    # step (the CUDA default of SGD / Adam / AdamW) refused the mixed list ("got mixed
    # torch.Tensor and DTensor") until the runtime handed the factory a group of each kind
    # (`precision.by_kind`); found by benchmarks/host_overhead.py on an H200.
    plans = {"tp": _plan(tp=2, sequence_parallel=False, micro_batch=2, global_batch=4)}
    steps = 2
    results = run_local(_foreach_ranks, 2, plans, steps, timeout_s=240)
    ref_losses, ref_state = _reference(4, 2, steps)
    for rank, r in enumerate(results):
        assert r["tp"]["losses"] == pytest.approx(ref_losses, rel=2e-2), rank
    state = results[0]["tp"]["state"]
    for k, v in ref_state.items():
        assert torch.allclose(state[k], v, atol=2e-2, rtol=2e-2), k


def test_parameters_of_both_kinds_go_in_two_groups():
    from meshplan.runtime.precision import by_kind

    plain = [torch.nn.Parameter(torch.zeros(2)) for _ in range(2)]
    assert by_kind(plain) is plain  # one kind: as given
