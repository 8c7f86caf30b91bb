"""Predicted memory against what torch actually holds for a small zoo model on CPU (dp = 1).

Activations: the storages autograd keeps for backward (`saved_tensors_hooks`, each storage
counted once) during a real bf16 forward. Model states: the bf16 weights and gradients after a
real backward, and the fp32 master copy + Adam moments of the mixed-precision convention the
memory model uses (`memory.OPTIMIZER_BYTES`), built and stepped with torch.optim.AdamW.
"""

from __future__ import annotations

import pytest
import torch
from meshplan import models
from meshplan.cost_model import predict
from meshplan.ir import Cluster, Parallel
from meshplan.ir.trace import trace
from meshplan.passes.partition import even_stages, place_stages


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


@pytest.fixture(scope="module")
def measured_and_predicted():
    torch.manual_seed(0)
    model, inputs = models.get("tiny", seq_len=128, device="cpu")
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor):
        if not isinstance(t, torch.nn.Parameter):
            storages[t.untyped_storage().data_ptr()] = _nbytes(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*inputs)
    params = [p for p in model.parameters()]
    # parameters autograd saved are weights, not activations
    weight_ptrs = {p.untyped_storage().data_ptr() for p in params}
    activations = sum(n for ptr, n in storages.items() if ptr not in weight_ptrs)
    loss.backward()
    weights = sum(_nbytes(p) for p in params)
    grads = sum(_nbytes(p.grad) for p in params if p.grad is not None)
    master = [p.detach().float().requires_grad_() for p in params]
    for m, p in zip(master, params):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(master, lr=1e-3)
    opt.step()
    optimizer = sum(_nbytes(m) for m in master) + sum(
        _nbytes(v) for st in opt.state.values() for v in st.values() if v.dim() > 0
    )

    meta_model, meta_inputs = models.get("tiny", seq_len=128)
    graph = trace(meta_model, *meta_inputs)
    cluster = Cluster.preset("H100", gpus=1)
    p = Parallel(
        dp=1, tp=1, pp=1, cp=1, ep=1, micro_batch=1, global_batch=1, recompute="none",
        zero=0, schedule="1f1b", sequence_parallel=False,
    )  # fmt: skip
    pred = predict(graph, cluster, p, place_stages(cluster, p, even_stages(graph, 1)))
    breakdown = dict(pred.memory[0].breakdown)
    measured = {
        "activations": activations,
        "weights": weights,
        "grads": grads,
        "optimizer": optimizer,
    }
    return measured, breakdown


@pytest.mark.parametrize("part", ["weights", "grads", "optimizer"])
def test_model_states_match_torch(measured_and_predicted, part):
    measured, predicted = measured_and_predicted
    assert predicted[part] == pytest.approx(measured[part], rel=1e-6)


def test_activations_match_what_autograd_saves(measured_and_predicted):
    measured, predicted = measured_and_predicted
    # within 10%: the traced graph runs on fake tensors, where views of one storage and the
    # RoPE tables can be attributed differently than on a real run
    assert predicted["activations"] == pytest.approx(measured["activations"], rel=0.10)
