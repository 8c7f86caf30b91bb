"""What a framework file says that meshplan does not price, and what it does not know (unit
tier, no processes): every option a torchtitan, Megatron-LM or DeepSpeed file states is
priced, listed as not priced, silent bookkeeping, or listed as unknown with the nearest
known name (`meshplan.configs_options`). One table of files per framework, asserting on
`FrameworkConfig.unpriced` / `.unknown` and on the CLI's one line."""

from __future__ import annotations

import json

import pytest
from meshplan import configs
from meshplan.cli import app
from meshplan.configs_options import OPTIONS, NotPriced, Options, classify
from typer.testing import CliRunner

runner = CliRunner()

# Megatron arguments that state a tiny model, so that the files below price on their own.
SHAPE = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --vocab-size 1024 "
    "--seq-length 256 --micro-batch-size 1 --global-batch-size 8 "
)
OFFLOAD = "activation/weight CPU offloading: priced without offload"
# A torchtitan job TOML's model, without recomputation (torchtitan's default, selective
# checkpointing of every second layer, is a note of the reader's own).
TITAN = '[model]\nname = "llama3"\nflavor = "8B"\n[activation_checkpoint]\nmode = "none"\n'

# (framework, file suffix, file text, expected unpriced, expected unknown). Every row's
# other options are silent: an empty tuple asserts that nothing else is listed.
CASES = [
    # -- Megatron-LM
    (
        "megatron",
        ".txt",
        SHAPE + "--tensor-model-paralel-size 2",
        (),
        ("--tensor-model-paralel-size (did you mean --tensor-model-parallel-size?)",),
    ),
    (  # a flag cut short: the shortest flag that extends it
        "megatron",
        ".txt",
        SHAPE + "--cpu-offloading",
        (),
        ("--cpu-offloading (did you mean --cpu-offloading-num-layers?)",),
    ),
    (  # bookkeeping: data, tokenizer, checkpoints, logging, seed, hyperparameters
        "megatron",
        ".txt",
        SHAPE + "--data-path /data/corpus_text_document --split 949,50,1 "
        "--tokenizer-model /tok/tokenizer.model --save /ckpt --load /ckpt --save-interval 1000 "
        "--log-interval 10 --tensorboard-dir /tb --seed 1234 --lr 3e-4 --min-lr 3e-5 "
        "--lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --train-iters 5000 "
        "--eval-interval 1000 --eval-iters 10",
        (),
        (),
    ),
    (  # what meshplan prices: bf16, overlapped DP traffic, FlashAttention, dropout 0
        "megatron",
        ".txt",
        SHAPE + "--bf16 --overlap-grad-reduce --overlap-param-gather --use-flash-attn "
        "--hidden-dropout 0 --attention-dropout 0.0 --cpu-offloading-num-layers 0",
        (),
        (),
    ),
    (  # known, not priced; the same reason lists its flags together
        "megatron",
        ".txt",
        SHAPE + "--cpu-offloading-num-layers 2 --hidden-dropout 0.1 --attention-dropout 0.1 "
        "--moe-token-dispatcher-type allgather --checkpoint-activations",
        (
            f"--cpu-offloading-num-layers 2: {OFFLOAD}",
            "--hidden-dropout 0.1, --attention-dropout 0.1: dropout: priced without dropout",
            "--moe-token-dispatcher-type allgather: MoE token dispatch: priced as all-to-all",
            "--checkpoint-activations: refused by Megatron-LM; use --recompute-activations or "
            "--recompute-granularity",
        ),
        (),
    ),
    (  # the launcher's own options come before the program and are not Megatron's
        "megatron",
        ".txt",
        "torchrun --nproc_per_node 8 --nnodes 2 --master_addr node0 pretrain_gpt.py "
        + SHAPE
        + "--tensor-model-parallel-size 2",
        (),
        (),
    ),
    # -- torchtitan job TOML
    (
        "torchtitan",
        ".toml",
        TITAN + "[parallelism]\ntensor_parallel_degre = 2\n",
        (),
        ("parallelism.tensor_parallel_degre (did you mean parallelism.tensor_parallel_degree?)",),
    ),
    (  # a misspelt table is named once, not once per key
        "torchtitan",
        ".toml",
        TITAN + "[paralelism]\ntensor_parallel_degree = 2\npipeline_parallel_degree = 2\n",
        (),
        ("[paralelism] (did you mean [parallelism]?)",),
    ),
    (  # bookkeeping: job, tokenizer, data, metrics, checkpoints, optimizer hyperparameters
        "torchtitan",
        ".toml",
        '[job]\ndump_folder = "./outputs"\ndescription = "Llama 3 8B"\n'
        '[model]\nname = "llama3"\nflavor = "8B"\ntokenizer_path = "./tokenizer.model"\n'
        '[optimizer]\nname = "AdamW"\nlr = 3e-4\neps = 1e-8\n'
        "[lr_scheduler]\nwarmup_steps = 200\n"
        "[training]\nlocal_batch_size = 1\nseq_len = 8192\nmax_norm = 1.0\nsteps = 1000\n"
        'dataset = "c4"\n'
        "[metrics]\nlog_freq = 10\nenable_tensorboard = true\n"
        "[checkpoint]\nenable_checkpoint = true\ninterval = 500\n"
        '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n'
        "[training.dataloader]\nnum_workers = 2\n[debug]\nseed = 42\n",
        (),
        (),
    ),
    (  # known, not priced; a value that prices as meshplan prices is silent
        "torchtitan",
        ".toml",
        TITAN + '[training]\nmixed_precision_param = "float32"\n'
        '[parallelism]\ncontext_parallel_rotate_method = "allgather"\n'
        '[optimizer]\nname = "Lion"\n',
        (
            "training.mixed_precision_param = float32: fp32 parameters in FSDP's compute: "
            "priced in bf16",
            "optimizer.name = Lion: optimizer: priced as AdamW (two fp32 states)",
        ),
        (),
    ),
    # -- torchtitan 0.3 command line
    (
        "torchtitan",
        ".txt",
        "torchrun --nproc_per_node=8 -m torchtitan.train --module llama3 --config llama3_8b "
        "--parallelism.tensr_parallel_degree 4 --profilr.enable_profiling",
        (),
        (
            "--parallelism.tensr_parallel_degree (did you mean "
            "--parallelism.tensor_parallel_degree?)",
            "--profilr.* (did you mean --profiler.*?)",
        ),
    ),
    (  # bookkeeping, a negated boolean, and one option not priced
        "torchtitan",
        ".txt",
        "--module llama3 --config llama3_8b --dump_folder /out --metrics.log_freq 5 "
        "--checkpoint.interval 100 --training.steps 20 --parallelism.tensor_parallel_degree 2 "
        "--parallelism.no-enable_sequence_parallel --training.mixed_precision_param float32",
        (
            "--training.mixed_precision_param float32: fp32 parameters in FSDP's compute: "
            "priced in bf16",
        ),
        (),
    ),
    # -- DeepSpeed
    (  # DeepSpeed ignores a misspelt top-level key without a word
        "deepspeed",
        ".json",
        {"train_batch_size": 64, "gradient_acumulation_steps": 4, "tensorbord": {"enabled": True}},
        (),
        (
            "gradient_acumulation_steps (did you mean gradient_accumulation_steps?)",
            "tensorbord (did you mean tensorboard?)",
        ),
    ),
    (
        "deepspeed",
        ".json",
        {
            "train_batch_size": 64,
            "zero_optimization": {"stage": 3, "stage3_max_live_paramaters": 1e9},
        },
        (),
        (
            "zero_optimization.stage3_max_live_paramaters (did you mean "
            "zero_optimization.stage3_max_live_parameters?)",
        ),
    ),
    (  # bookkeeping; "auto" and a table switched off are silent
        "deepspeed",
        ".json",
        {
            "train_batch_size": 64,
            "train_micro_batch_size_per_gpu": "auto",
            "zero_optimization": {
                "stage": 2,
                "overlap_comm": True,
                "contiguous_gradients": True,
                "reduce_bucket_size": "auto",
            },
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95]}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
            "gradient_clipping": 1.0,
            "steps_per_print": 10,
            "wall_clock_breakdown": False,
            "tensorboard": {"enabled": True, "output_path": "/tb"},
            "flops_profiler": {"enabled": False},
            "sparse_attention": {"enabled": False},
        },
        (),
        (),
    ),
    (
        "deepspeed",
        ".json",
        {
            "train_batch_size": 64,
            "zero_optimization": {"stage": 2, "overlap_comm": False, "reduce_bucket_size": 2e8},
            "sparse_attention": {"mode": "fixed", "block": 16},
        },
        (  # overlap_comm is read (`test_configs.py`: gradients reduced after the backward)
            "zero_optimization.reduce_bucket_size: 200000000.0: ZeRO bucket, prefetch and "
            "persistence sizes: priced by the ZeRO stage's traffic, not its buckets",
            "sparse_attention: sparse attention: priced dense",
        ),
        (),
    ),
]


def write(tmp_path, suffix, text) -> str:
    path = tmp_path / f"cfg{suffix}"
    path.write_text(json.dumps(text) if isinstance(text, dict) else text + "\n")
    return str(path)


@pytest.mark.parametrize("framework,suffix,text,unpriced,unknown", CASES)
def test_every_option_is_sorted(tmp_path, framework, suffix, text, unpriced, unknown):
    path = write(tmp_path, suffix, text)
    model = "tiny" if framework == "deepspeed" else None
    cfg = configs.load(f"{framework}:{path}", world_size=16, model=model)
    assert cfg.unpriced == unpriced
    assert cfg.unknown == unknown


def test_a_misspelt_flag_leaves_the_default():
    # why an unknown flag is worth a line: the run it describes has no TP
    assert OPTIONS["megatron"].known >= {"tensor-model-parallel-size", "data-path", "fp16"}
    found = classify(OPTIONS["megatron"], [("tensor-model-paralel-size", "2")])
    assert found == classify(OPTIONS["megatron"], [("tensor-model-paralel-size", "8")])
    assert found.unknown and not found.not_priced


def test_an_option_is_of_one_kind():
    with pytest.raises(ValueError, match="names in two kinds: \\['lr'\\]"):
        Options("x", frozenset({"lr"}), {"lr": NotPriced("why")}, frozenset())


@pytest.mark.parametrize(
    "framework,suffix,text,line",
    [
        (
            "megatron",
            ".txt",
            SHAPE + "--tensor-model-paralel-size 2 --cpu-offloading-num-layers 2 --seed 7",
            f"not priced: --cpu-offloading-num-layers 2: {OFFLOAD}; unknown "
            "--tensor-model-paralel-size (did you mean --tensor-model-parallel-size?)",
        ),
        (
            "deepspeed",
            ".json",
            {"train_batch_size": 8, "gradient_acumulation_steps": 2, "steps_per_print": 1},
            "not priced: unknown gradient_acumulation_steps (did you mean "
            "gradient_accumulation_steps?)",
        ),
    ],
)
def test_cli_prints_one_line(tmp_path, framework, suffix, text, line):
    path = write(tmp_path, suffix, text)
    args = ["estimate", "--from", f"{framework}:{path}", "--cluster", "cpu", "--gpus", "4"]
    if framework == "deepspeed":
        args += ["--model", "tiny"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = [x for x in result.stdout.splitlines() if x.startswith("not priced:")]
    assert lines == [line]


def test_cli_is_silent_when_everything_is_priced_or_bookkeeping(tmp_path):
    path = write(tmp_path, ".txt", SHAPE + "--data-path /d --save /c --seed 1 --lr 1e-4 --bf16")
    result = runner.invoke(
        app, ["estimate", "--from", f"megatron:{path}", "--cluster", "cpu", "--gpus", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "read megatron config" in result.stdout and "not priced" not in result.stdout


@pytest.mark.parametrize(
    "spec,gpus",
    [
        ("torchtitan:examples/frameworks/torchtitan_llama3_8b_fsdp.toml", 8),
        ("megatron:examples/frameworks/megatron_gpt_7b_args.txt", 96),
    ],
)
def test_published_examples_hold_no_unknown_option(spec, gpus):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    framework, path = spec.split(":")
    cfg = configs.load(f"{framework}:{root / path}", world_size=gpus)
    assert cfg.unknown == () and cfg.unpriced == ()


def test_torchtitan_selective_policy_is_read_and_priced_as_torchtitan_runs_it(tmp_path):
    """torchtitan's "op" policy saves every other matmul of a layer and "2" checkpoints every
    second layer: each import carries its policy in the engine, and the pricer prices the
    engine's policy exactly as when the policy is named to it."""
    import meshplan
    from meshplan import configs
    from meshplan.cost_model.engine import Engine, EngineError, SelectivePolicy

    want = {"op": SelectivePolicy.TORCHTITAN_OP, "2": SelectivePolicy.EVERY_OTHER_LAYER}
    for option, policy in want.items():
        path = tmp_path / f"job_{option}.toml"
        path.write_text(
            '[model]\nname = "llama3"\nflavor = "8B"\n'
            "[training]\nlocal_batch_size = 1\nseq_len = 2048\n"
            f'[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "{option}"\n'
        )
        cfg = configs.load(f"torchtitan:{path}", world_size=8)
        assert cfg.engine.selective == policy
        assert f"selective {policy}" in cfg.engine.describe()
    with pytest.raises(EngineError, match="selective policy 'everything' is not modelled"):
        Engine(selective="everything")
    # the engine's policy is the pricer's: the engine is the only place a policy is set
    from meshplan.cost_model.pricer import pricer_for

    from tests.synthetic import h100_cluster, transformer_graph

    g = transformer_graph(2, 1024, 8, 8, 4096, 32000, 1024, 1)
    c = h100_cluster(1)
    for policy in SelectivePolicy:
        assert pricer_for(g, c, engine=Engine(selective=str(policy))).selective_policy == policy
    assert pricer_for(g, c).selective_policy == "keep_linear"  # meshplan's own, by default
    assert meshplan  # imported for configs' side effects
