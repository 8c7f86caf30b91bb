"""Exported configurations read by the frameworks' own config parsers (optional extra
`frameworks`; each test is skipped when its package is absent, and CI does not install them:
`pip install --no-deps torchtitan==0.3.0 deepspeed==0.19.8` beside the CPU torch, plus
tyro for torchtitan's command line)."""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

import meshplan
import pytest
from meshplan import configs
from meshplan.ir import Parallel


@pytest.fixture(scope="module")
def graph():
    model, inputs = meshplan.models.get("llama3-8b", seq_len=2048)
    return meshplan.trace(model, *inputs, name="llama3-8b")


@pytest.fixture(scope="module")
def plan(graph):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=64)
    p = Parallel(tp=2, pp=4, zero=3, global_batch=64, recompute="full")
    return configs.with_stage_layers(
        meshplan.estimate_plan(graph, cluster=cluster, parallel=p), graph, (7, 9, 9, 7)
    )


def test_torchtitan_dataclasses_take_the_toml(plan):
    titan = pytest.importorskip("torchtitan.config.configs")
    data = tomllib.loads(configs.export(plan, "torchtitan").text)
    par = titan.ParallelismConfig(**data["parallelism"])
    titan.TrainingConfig(**data["training"])
    titan.CompileConfig(**data["compile"])
    assert par.pipeline_parallel_degree == 4 and par.tensor_parallel_degree == 2


def test_torchtitan_cli_parses_with_tyro(plan):
    titan = pytest.importorskip("torchtitan.config.configs")
    tyro = pytest.importorskip("tyro")

    # the sections of torchtitan 0.3's Trainer.Config that the overrides touch
    sub = dataclasses.make_dataclass(
        "Sub",
        [
            (name, cls, dataclasses.field(default_factory=cls))
            for name, cls in (
                ("parallelism", titan.ParallelismConfig),
                ("training", titan.TrainingConfig),
                ("compile", titan.CompileConfig),
            )
        ],
    )

    text = configs.export(plan, "torchtitan-cli").text
    tokens = [t for t in " ".join(x for x in text.splitlines() if not x.startswith("#")).split()]
    args = [t for t in tokens if t != "\\"]
    args = args[4:-1]  # drop --module/--config (ConfigManager's) and the AC subcommand
    parsed = tyro.cli(sub, args=args)
    assert parsed.parallelism.pipeline_parallel_degree == 4
    par = parsed.parallelism
    split = (4, 32, par.pipeline_parallel_first_stage_less_layers)
    assert configs.titan_stage_split(*split, par.pipeline_parallel_last_stage_less_layers) == (
        7,
        9,
        9,
        7,
    )
    assert parsed.training.global_batch_size == 64


def test_deepspeed_config_accepts_the_json(graph, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    plan = meshplan.estimate_plan(
        graph, cluster=cluster, parallel=Parallel(zero=3, global_batch=64, recompute="full")
    )
    p = plan.parallel
    data = json.loads(configs.export(plan, "deepspeed").text)
    # DeepSpeedConfig reads the data-parallel world size from torch.distributed
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    monkeypatch.setattr(ds_config.dist, "get_world_size", lambda *a, **k: p.dp)
    cfg = ds_config.DeepSpeedConfig(data)
    assert cfg.zero_optimization_stage == 3
    assert cfg.train_batch_size == 64 and cfg.gradient_accumulation_steps == p.num_microbatches
    assert os.environ["DS_ACCELERATOR"] == "cpu"
