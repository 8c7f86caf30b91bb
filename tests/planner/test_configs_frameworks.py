"""Exported configurations read by the frameworks' own config parsers (optional extra
`frameworks`; each test is skipped when its package is absent, and CI does not install them:
`pip install --no-deps torchtitan==0.3.0 deepspeed==0.19.8 megatron-core==0.16.1` beside
the CPU torch, plus tyro for torchtitan's command line; Megatron-LM's argument parser from a
checkout named by MEGATRON_LM_PATH)."""

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


# -- Megatron ----------------------------------------------------------------------------------
# megatron-core 0.16.1 (PyPI, `--no-deps`) holds TransformerConfig, DistributedDataParallelConfig
# and the layer layout (`get_num_layers_to_build`); Megatron-LM's argument parser
# (`megatron/training/arguments.py`) is not on PyPI: the parser test reads it from a checkout
# of Megatron-LM at tag core_v0.16.1 named by MEGATRON_LM_PATH, and is skipped without one.

# (layers, pp, virtual stages, first, last, embedding counted, loss counted)
MEGATRON_LAYOUTS = [
    (32, 4, 1, None, None, False, False),
    (32, 4, 2, None, None, False, False),
    (32, 4, 1, 5, None, False, False),
    (32, 4, 2, 6, 6, False, False),
    (32, 4, 2, None, 2, False, False),
    (30, 4, 2, None, None, True, True),
    (30, 4, 1, None, None, True, True),
    (126, 16, 1, None, None, True, True),
    (31, 4, 1, None, None, True, False),
]


@pytest.mark.parametrize("layers,pp,v,first,last,emb,loss", MEGATRON_LAYOUTS)
def test_megatron_layout_matches_megatron_core(layers, pp, v, first, last, emb, loss):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=v if v > 1 else None,
        num_layers_in_first_pipeline_stage=first,
        num_layers_in_last_pipeline_stage=last,
        account_for_embedding_in_pipeline_split=emb,
        account_for_loss_in_pipeline_split=loss,
        pipeline_dtype=torch.bfloat16,
        bf16=True,
    )
    # model order: chunk k is virtual stage k // pp of pipeline rank k % pp
    theirs = tuple(
        get_num_layers_to_build(cfg, vp_stage=(k // pp) if v > 1 else None, pp_rank=k % pp)
        for k in range(pp * v)
    )
    assert configs.megatron_chunk_layers(layers, pp, v, first, last, emb, loss) == theirs


def test_megatron_core_refuses_what_the_reader_refuses():
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    # the first stage's 5 layers do not split over 2 virtual stages
    with pytest.raises(ValueError):
        TransformerConfig(
            num_layers=32,
            hidden_size=64,
            num_attention_heads=4,
            pipeline_model_parallel_size=4,
            virtual_pipeline_model_parallel_size=2,
            num_layers_in_first_pipeline_stage=5,
            pipeline_dtype=torch.bfloat16,
            bf16=True,
        )
    with pytest.raises(configs.ConfigError, match="virtual stages"):
        configs.megatron_chunk_layers(32, 4, 2, first=5)


MEGATRON_PLANS = [
    # (Parallel, layers per stage or None, sharding strategy Megatron must see)
    (Parallel(tp=2, pp=4, zero=1, global_batch=64, recompute="selective",
              sequence_parallel=True), (7, 9, 9, 7), "no_shard"),
    (Parallel(tp=2, pp=4, zero=3, global_batch=64, recompute="full"), None, "optim_grads_params"),
    (Parallel(tp=2, zero=2, global_batch=64), None, "optim_grads"),
    (Parallel(tp=2, pp=4, zero=1, global_batch=64, schedule="interleaved_1f1b",
              virtual_stages=2), None, "no_shard"),
]  # fmt: skip


@pytest.fixture(scope="module")
def megatron_lm():
    """Megatron-LM core_v0.16.1's `megatron.training.arguments`, from MEGATRON_LM_PATH.

    Substitutes, each for something a GPU node has and this CPU test does not:
    `megatron/training/__init__.py` is not run (it imports `initialize`, which imports
    triton): the package is registered bare with the `global_vars` getters that
    `training/utils.py` imports from it; `get_device_arch_version` (a CUDA query) answers 9,
    the H100 the plans target."""
    pytest.importorskip("megatron.core")
    root = os.environ.get("MEGATRON_LM_PATH")
    if not root or not os.path.isfile(f"{root}/megatron/training/arguments.py"):
        pytest.skip("MEGATRON_LM_PATH (a Megatron-LM checkout at core_v0.16.1) is not set")
    import importlib
    import sys
    import types

    sys.path.insert(0, root)
    if "megatron.training" not in sys.modules:
        pkg = types.ModuleType("megatron.training")
        pkg.__path__ = [f"{root}/megatron/training"]
        sys.modules["megatron.training"] = pkg
        global_vars = importlib.import_module("megatron.training.global_vars")
        for name in dir(global_vars):
            if name.startswith("get_"):
                setattr(pkg, name, getattr(global_vars, name))
    arguments = importlib.import_module("megatron.training.arguments")
    arguments.get_device_arch_version = lambda: 9
    return arguments


@pytest.mark.parametrize("parallel,split,strategy", MEGATRON_PLANS)
def test_megatron_lm_parses_and_validates_the_arguments(
    graph, megatron_lm, monkeypatch, capsys, parallel, split, strategy
):
    import shlex
    import sys

    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    cluster = meshplan.Cluster.preset("dgx-h100", gpus=64)
    plan = meshplan.estimate_plan(graph, cluster=cluster, parallel=parallel)
    if split:
        plan = configs.with_stage_layers(plan, graph, split)
    p = plan.parallel
    text = configs.export(plan, "megatron").text
    argv = shlex.split(" ".join(x.rstrip("\\") for x in text.splitlines() if not x.startswith("#")))
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    monkeypatch.setenv("WORLD_SIZE", str(plan.world_size))
    monkeypatch.setenv("RANK", "0")
    # the launch environment Megatron asks for: 1 with TP and no FSDP, unset with FSDP
    if p.zero >= 2:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    args = megatron_lm.parse_args()  # argparse: an unknown flag exits here
    megatron_lm.validate_args(args)
    args.apply_rope_fusion = False  # RoPE fusion needs Transformer Engine, absent on CPU
    core = megatron_lm.core_transformer_config_from_args(args)
    capsys.readouterr()

    assert args.data_parallel_size == p.dp and args.global_batch_size == p.global_batch
    assert core.tensor_model_parallel_size == p.tp and core.pipeline_model_parallel_size == p.pp
    assert core.sequence_parallel == p.sequence_parallel
    assert (core.virtual_pipeline_model_parallel_size or 1) == (p.virtual_stages or 1)
    assert args.use_distributed_optimizer == (p.zero >= 1)
    assert args.data_parallel_sharding_strategy == strategy
    assert args.use_megatron_fsdp == (p.zero >= 2)
    ddp = DistributedDataParallelConfig(
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(DistributedDataParallelConfig)
            if hasattr(args, f.name)
        }
    )
    assert ddp.data_parallel_sharding_strategy == strategy
    v = p.virtual_stages or 1
    layers = tuple(
        sum(
            get_num_layers_to_build(core, vp_stage=c if v > 1 else None, pp_rank=r)
            for c in range(v)
        )
        for r in range(p.pp)
    )
    assert layers == configs.stage_layer_counts(plan)


# -- the option tables of `configs_options` against the frameworks' own names -----------------
# Each table says which options meshplan prices, which it lists as not priced and which are
# bookkeeping; a name in them that the framework does not have would hide a real unknown.


def test_megatron_option_names_are_megatron_lm_flags(megatron_lm):
    import argparse

    from meshplan.configs_options import OPTIONS

    parser = megatron_lm.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    flags = {s[2:] for a in parser._actions for s in a.option_strings if s.startswith("--")}
    # NeMo / Megatron-Bridge's name for --num-virtual-stages-per-pipeline-rank, which the
    # reader takes too
    assert OPTIONS["megatron"].known - flags == {"virtual-pipeline-model-parallel-size"}


def test_deepspeed_option_names_are_deepspeed_fields(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    zero = pytest.importorskip("deepspeed.runtime.zero.config")
    precision = pytest.importorskip("deepspeed.runtime.precision_config")
    tp = pytest.importorskip("deepspeed.runtime.tensor_parallel.config")
    from meshplan.configs_options import OPTIONS

    models = {
        "zero_optimization": zero.DeepSpeedZeroConfig,
        "bf16": precision.DeepSpeedBF16Config,
        "bfloat16": precision.DeepSpeedBF16Config,
        "fp16": precision.DeepSpeedFP16Config,
        "tensor_parallel": tp.TPTrainingConfig,
    }
    for section, model in models.items():
        fields = {n for name, f in model.model_fields.items() for n in (name, f.alias) if n}
        ours = {
            n.split(".", 1)[1] for n in OPTIONS["deepspeed"].known if n.startswith(section + ".")
        }
        assert ours <= fields, (section, ours - fields)


def test_torchtitan_option_names_are_torchtitan_fields():
    titan = pytest.importorskip("torchtitan.config.configs")
    from meshplan.configs_options import OPTIONS

    sections = {
        "training": titan.TrainingConfig,
        "parallelism": titan.ParallelismConfig,
        "compile": titan.CompileConfig,
        "comm": titan.CommConfig,
        "debug": titan.DebugConfig,
    }
    known = OPTIONS["torchtitan-cli"].known
    for section, cls in sections.items():
        fields = {f.name for f in dataclasses.fields(cls)}
        ours = {n.split(".", 1)[1] for n in known if n.startswith(section + ".")}
        # torchtitan 0.1's names that the reader, shared with the job TOML, still reads
        assert ours - fields <= {"enable_async_tensor_parallel", "pipeline_parallel_split_points"}
        assert fields <= ours, (section, fields - ours)
