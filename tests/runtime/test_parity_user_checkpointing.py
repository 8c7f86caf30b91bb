"""A user's model with its own activation checkpointing switched on (HuggingFace's
`gradient_checkpointing_enable`, non-reentrant), planned and run like any matrix cell
(`test_model_matrix.run_cell`: traced on meta, planned, 3 SGD steps on 2 gloo ranks against
one process). Until session 23 such a model could not be traced on meta at all (its
recomputation ran outside the tracer's parameter swap), so no plan was ever made for it."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from tests.runtime import test_model_matrix as mx  # noqa: E402
from tests.runtime import user_models  # noqa: E402

NAME = "hf-llama-gradient-checkpointing"


def _make(device: str):
    model = user_models.MODELS["hf-llama"].make(device)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


@pytest.fixture
def registered(monkeypatch):
    um = dataclasses.replace(user_models.MODELS["hf-llama"], name=NAME, make=_make)
    monkeypatch.setitem(user_models.MODELS, NAME, um)  # mx.MODELS is the same dict
    assert mx.MODELS is user_models.MODELS
    return NAME


@pytest.mark.parametrize("config", ["dp", "tp", "fsdp", "recompute", "pp"])
def test_model_with_its_own_checkpointing_matches_one_process(registered, config):
    cell = mx.run_cell(registered, config)
    assert cell.status == "OK", cell
