"""Framework configurations in and out (unit tier, no processes): torchtitan, Megatron-LM and
DeepSpeed files read into `Parallel`, plans written back, `import(export(plan))` giving the
plan's `Parallel` back for every dimension, and one-line errors for bad files."""

from __future__ import annotations

import dataclasses
import json

import meshplan
import pytest
from meshplan import configs
from meshplan.cli import app
from meshplan.ir import Parallel
from typer.testing import CliRunner

SUFFIX = {"torchtitan": ".toml", "torchtitan-cli": ".txt", "megatron": ".txt", "deepspeed": ".json"}
FRAMEWORK = {"torchtitan-cli": "torchtitan"}


@pytest.fixture(scope="module")
def llama8b():
    model, inputs = meshplan.models.get("llama3-8b", seq_len=2048)
    return meshplan.trace(model, *inputs, name="llama3-8b")


@pytest.fixture(scope="module")
def tiny_moe():
    model, inputs = meshplan.models.get("tiny-moe")
    return meshplan.trace(model, *inputs, name="tiny-moe")


def round_trip(tmp_path, plan, fmt, model=None):
    text = configs.export(plan, fmt).text
    path = tmp_path / f"cfg{SUFFIX[fmt]}"
    path.write_text(text)
    spec = f"{FRAMEWORK.get(fmt, fmt)}:{path}"
    return configs.load(spec, world_size=plan.world_size, model=model)


# (format, configuration, layers per stage or None): together every dimension each
# framework expresses: DP with each ZeRO stage it has, TP with SP, PP with virtual stages,
# ZB-V, uneven first/last stages, CP, recomputation modes, micro and global batch.
DENSE = [
    ("torchtitan", Parallel(tp=2, zero=3, global_batch=64, recompute="selective"), None),
    (
        "torchtitan",
        Parallel(
            tp=4,
            pp=4,
            global_batch=64,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            recompute="full",
            zero=2,
        ),
        None,
    ),
    ("torchtitan", Parallel(pp=4, tp=2, global_batch=32, micro_batch=2, zero=0), (7, 9, 9, 7)),
    ("torchtitan", Parallel(pp=2, global_batch=256, schedule="zero_bubble", zero=3), None),
    ("torchtitan-cli", Parallel(tp=8, cp=2, zero=3, global_batch=64), None),
    ("torchtitan-cli", Parallel(pp=4, tp=4, global_batch=64, zero=2), (6, 10, 10, 6)),
    (
        "torchtitan-cli",
        Parallel(
            pp=2,
            tp=2,
            global_batch=64,
            schedule="interleaved_1f1b",
            virtual_stages=4,
            recompute="selective",
            zero=3,
        ),
        None,
    ),
    ("megatron", Parallel(tp=2, pp=2, zero=1, global_batch=64), None),
    (
        "megatron",
        Parallel(
            tp=4,
            pp=4,
            cp=2,
            global_batch=128,
            schedule="interleaved_1f1b",
            virtual_stages=2,
            recompute="selective",
        ),
        None,
    ),
    ("megatron", Parallel(tp=2, pp=4, global_batch=64, recompute="full", zero=3), (5, 9, 9, 9)),
    ("deepspeed", Parallel(zero=2, global_batch=256, micro_batch=2), None),
    (
        "deepspeed",
        Parallel(tp=4, pp=2, zero=1, global_batch=64, recompute="full", sequence_parallel=False),
        None,
    ),
]


@pytest.mark.parametrize("fmt,parallel,split", DENSE)
def test_round_trip(tmp_path, llama8b, fmt, parallel, split):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=64)
    plan = meshplan.estimate_plan(llama8b, cluster=cluster, parallel=parallel)
    if split:
        plan = configs.with_stage_layers(plan, llama8b, split)
    model = "llama3-8b" if fmt == "deepspeed" else None
    cfg = round_trip(tmp_path, plan, fmt, model)
    assert cfg.parallel == plan.parallel
    assert cfg.stage_layers == (split or ())
    assert cfg.model is not None and cfg.model.name == "llama3-8b"
    # DeepSpeed's checkpointing is called by the model's code: the reader says so
    assert cfg.unpriced == () or fmt == "deepspeed" and "activation" in cfg.unpriced[0]
    assert cfg.unknown == ()  # every option the writers write is one the tables know
    # the file prices as the plan does, as the framework runs it (Megatron: fused kernels)
    again = configs.estimate(cfg, cluster, llama8b)
    expected = configs.reprice(plan, llama8b, cfg.engine).predicted.step_time_s
    assert again.predicted.step_time_s == pytest.approx(expected)


def test_round_trip_expert_parallel(tmp_path, tiny_moe):
    cluster = meshplan.Cluster.preset("cpu", gpus=8)
    plan = meshplan.estimate_plan(
        tiny_moe, cluster=cluster, parallel=Parallel(ep=2, tp=2, zero=1, global_batch=16)
    )
    cfg = round_trip(tmp_path, plan, "megatron")
    assert cfg.parallel == plan.parallel
    assert cfg.model.name == "tiny-moe"  # the shape in the arguments is the preset's


def test_engine_options_round_trip(tmp_path, llama8b):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    plan = meshplan.estimate_plan(llama8b, cluster=cluster, parallel=Parallel(tp=2, zero=3))
    engine = configs.Engine(
        fused=True, float8="tensorwise", float8_all_gather=True, tp_overlap=True
    )
    for fmt in ("torchtitan", "megatron"):
        path = tmp_path / f"e{SUFFIX[fmt]}"
        configs.export(plan, fmt, engine=engine).write(path)
        cfg = configs.load(f"{fmt}:{path}", world_size=16)
        # torchtitan reduces gradients in float32 only (0.3.0: Literal["float32"])
        want = engine if fmt == "megatron" else dataclasses.replace(engine, reduce_fp32=True)
        assert cfg.engine == want and cfg.unpriced == cfg.unknown == ()


def test_refuses_or_writes_closest(llama8b):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    plan = meshplan.estimate_plan(
        llama8b, cluster=cluster, parallel=Parallel(tp=2, recompute="selective", zero=1)
    )
    with pytest.raises(configs.ExportError, match="deepspeed cannot express (selective|sequence)"):
        configs.export(plan, "deepspeed")
    with pytest.raises(configs.ExportError, match="torchtitan cannot express ZeRO-1"):
        configs.export(plan, "torchtitan")
    near = configs.export(plan, "deepspeed", closest=True, graph=llama8b)
    assert near.plan.parallel.sequence_parallel is False
    assert near.plan.parallel.recompute == "full"
    assert near.changes and near.plan.predicted.step_time_s > 0


def test_torchtitan_stage_split_matches_torchtitan():
    # torchtitan 0.3.0 _generate_llm_fqn_per_model_part: 32 layers, 4 stages, weights 1/1:
    # 34 effective layers -> 9, 9, 8, 8 effective -> 8, 9, 8, 7 layers
    assert configs.titan_stage_split(4, 32, 1, 1) == (8, 9, 8, 7)
    assert configs.titan_stage_split(4, 32, 0, 0) == (8, 8, 8, 8)


def test_torchtitan_uneven_virtual_stages_priced_as_read(tmp_path, llama8b):
    # 32 layers, pp 4, Interleaved1F1B with 3 layers per stage and torchtitan's default
    # first/last_stage_less_layers 1/1 written out: ceil(34 / 3) = 12 stages, 3 per rank,
    # split (2, 3 x 9, 2, 1); meshplan's own chunk layout has none for 12 chunks of 32 layers
    from meshplan.ir.plan import Plan, plan_problem
    from meshplan.passes.partition import chunk_layers, layer_counts
    from meshplan.runtime.apply import check_plan
    from meshplan.runtime.pipeline_parallel import chunk_ranges

    toml = tmp_path / "llama3_8b_pp.toml"
    toml.write_text(
        '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 8\n'
        "seq_len = 2048\n[parallelism]\ntensor_parallel_degree = 2\n"
        'pipeline_parallel_degree = 4\npipeline_parallel_schedule = "Interleaved1F1B"\n'
        "pipeline_parallel_layers_per_stage = 3\n"
        "pipeline_parallel_first_stage_less_layers = 1\n"
        "pipeline_parallel_last_stage_less_layers = 1\n"
    )
    cfg = configs.load(f"torchtitan:{toml}", world_size=64)
    split = configs.titan_stage_split(12, 32, 1, 1)
    assert split == (2, 3, 3, 3, 3, 3, 3, 3, 3, 3, 2, 1)
    assert chunk_layers(32, 4, 3) is None
    assert (cfg.parallel.schedule, cfg.parallel.virtual_stages) == ("interleaved_1f1b", 3)
    assert cfg.stage_layers == split
    assert not any("even split" in note for note in cfg.unpriced)
    plan = configs.estimate(cfg, meshplan.Cluster.preset("dgx-h100", gpus=64), llama8b)
    # rank r holds torchtitan's stages r, r + 4, r + 8 (in model order)
    held = [layer_counts(llama8b, st.chunks) for st in plan.stages]
    assert held == [(2, 3, 3), (3, 3, 3), (3, 3, 2), (3, 3, 1)]
    assert tuple(held[k % 4][k // 4] for k in range(12)) == split  # chunk k on rank k % 4
    assert configs.stage_layer_counts(plan) == (8, 9, 8, 7)
    # a valid plan the runtime runs as priced: its chunk-stages are torchtitan's stages
    assert plan_problem(plan) is None
    check_plan(plan)
    assert tuple(layer_counts(llama8b, chunk_ranges(plan))) == split
    again = Plan.from_json(plan.to_json())
    assert again.stages == plan.stages
    # without the file's split meshplan's own layout has no chunks for these degrees
    even = dataclasses.replace(cfg, stage_layers=())
    with pytest.raises(configs.ConfigError, match="12 model chunks"):
        configs.estimate(even, meshplan.Cluster.preset("dgx-h100", gpus=64), llama8b)


def test_reads_published_files(tmp_path):
    toml = tmp_path / "llama3_8b.toml"
    toml.write_text(
        '[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 1\n'
        "seq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\n"
        '[activation_checkpoint]\nmode = "selective"\nselective_ac_option = "op"\n'
        "[compile]\nenable = true\n"
    )
    cfg = configs.load(f"torchtitan:{toml}", world_size=8)
    assert cfg.parallel == Parallel(
        dp=8,
        tp=1,
        pp=1,
        cp=1,
        ep=1,
        micro_batch=1,
        global_batch=8,
        recompute="selective",
        zero=3,
        schedule="1f1b",
        sequence_parallel=False,
    )
    assert cfg.engine.fused and cfg.model.name == "llama3-8b" and cfg.model.seq_len == 8192
    cli = tmp_path / "cmd.txt"
    cli.write_text(
        "--module llama3 --config llama3_405b --parallelism.pipeline_parallel_degree 1\n"
    )
    cfg = configs.load(f"torchtitan:{cli}", world_size=512)
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.recompute) == (8, 64, "full")
    assert cfg.engine.float8 == "tensorwise" and cfg.engine.tp_overlap
    ds = tmp_path / "ds.json"
    ds.write_text(
        '{"train_batch_size": 64, "gradient_accumulation_steps": 2,'
        ' "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}'
    )
    cfg = configs.load(f"deepspeed:{ds}", world_size=16)
    assert (cfg.parallel.micro_batch, cfg.parallel.zero) == (2, 3)
    assert cfg.unpriced == ("ZeRO optimizer offload to cpu: priced with the states on the GPU",)


runner = CliRunner()

BAD = [
    ("torchtitan", ".toml", "[parallelism\n", "not valid TOML"),
    (
        "torchtitan",
        ".toml",
        "[parallelism]\ntensor_parallel_degree = 0\n",
        "field parallelism.tensor_parallel_degree: must be a positive integer",
    ),
    (
        "torchtitan",
        ".toml",
        '[model]\nflavor = "8B"\n[parallelism]\npipeline_parallel_degree = 2\n'
        'pipeline_parallel_schedule = "1F2B"\n',
        "field parallelism.pipeline_parallel_schedule",
    ),
    ("torchtitan", ".toml", '[model]\nname = "llama3"\nflavor = "1B"\n', "field model"),
    ("torchtitan", ".txt", "--module llama3 --config llama3_1b\n", "field --config"),
    (
        "megatron",
        ".txt",
        "--tensor-model-parallel-size x\n",
        "field --tensor-model-parallel-size: must be an integer",
    ),
    ("megatron", ".txt", "--tensor-model-parallel-size 3\n", "does not divide the cluster's 8"),
    ("megatron", ".txt", "--num-layers 4 --hidden-size 64\n", "field --num-attention-heads"),
    ("megatron", ".txt", "--recompute-granularity most\n", "field --recompute-granularity"),
    ("deepspeed", ".json", "{nope", "not valid JSON"),
    (
        "deepspeed",
        ".json",
        '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,'
        ' "gradient_accumulation_steps": 2}',
        "field train_batch_size: 64 != ",
    ),
    (
        "deepspeed",
        ".json",
        '{"train_batch_size": 8, "zero_optimization": {"stage": 4}}',
        "field zero_optimization.stage",
    ),
]


@pytest.mark.parametrize("framework,suffix,text,needle", BAD)
def test_bad_files_one_line(tmp_path, framework, suffix, text, needle):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    args = ["estimate", "--from", f"{framework}:{path}", "--cluster", "dgx-h100", "--gpus", "8"]
    if framework == "deepspeed":
        args += ["--model", "tiny"]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert str(path) in lines[0] and needle in lines[0], lines[0]


@pytest.mark.parametrize(
    "args,needle",
    [
        (["estimate", "--from", "titan:x.toml"], "FRAMEWORK:FILE"),
        (["estimate", "--from", "megatron:/nonexistent/args.txt"], "cannot read"),
        (["estimate", "--from", "megatron:a.txt", "--tp", "2"], "leave out --tp"),
        (["plan", "--export", "nemo", "-o", "x"], "--export must be one of"),
        (["plan", "--export", "megatron"], "give -o FILE"),
        (["plan", "--closest"], "--closest goes with --export"),
    ],
)
def test_cli_usage_errors(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_cli_estimate_from_and_plan_baseline(tmp_path):
    args = tmp_path / "args.txt"
    args.write_text(
        "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --ffn-hidden-size 688\n"
        "--group-query-attention --num-query-groups 4 --vocab-size 1024 --swiglu\n"
        "--normalization RMSNorm --position-embedding-type rope --seq-length 256\n"
        "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2\n"
        "--micro-batch-size 1 --global-batch-size 8 --cpu-offloading-num-layers 2\n"
    )
    result = runner.invoke(
        app, ["estimate", "--from", f"megatron:{args}", "--cluster", "cpu", "--gpus", "4"]
    )
    assert result.exit_code == 0, result.output
    assert "read megatron config" in result.stdout
    assert "not priced: --cpu-offloading-num-layers 2: activation/weight CPU" in result.stdout
    out = tmp_path / "ds.json"
    result = runner.invoke(
        app,
        [
            "plan",
            "--baseline",
            f"megatron:{args}",
            "--cluster",
            "cpu",
            "--gpus",
            "4",
            "--time-limit",
            "2",
            "--compress",
            "off",
            "--export",
            "deepspeed",
            "--closest",
            "-o",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "meshplan / baseline" in result.stdout and out.exists()
    assert configs.load(f"deepspeed:{out}", world_size=4, model="tiny").parallel.global_batch == 8


SHAPE_30 = "--num-layers 30 --hidden-size 1024 --num-attention-heads 16 --vocab-size 32000 "
SHAPE_30 += "--seq-length 1024 --pipeline-model-parallel-size 4 --global-batch-size 16 "


@pytest.mark.parametrize(
    "extra,virtual,rank_layers,chunk_layers",
    [
        # 30 layers + embedding + loss = 32 over 4 ranks: 8 a rank, 4 a virtual stage, the
        # first and the last chunk one layer short: chunks (3,4,4,4 | 4,4,4,3), ranks 7,8,8,7
        (
            "--num-layers-per-virtual-pipeline-stage 4 --account-for-embedding-in-pipeline-split "
            "--account-for-loss-in-pipeline-split",
            2,
            (7, 8, 8, 7),
            ((3, 4), (4, 4), (4, 4), (4, 3)),
        ),
        # the same without virtual stages: 8 a rank, the first and the last one short
        (
            "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
            None,
            (7, 8, 8, 7),
            None,
        ),
    ],
)
def test_megatron_uneven_layout_priced_as_megatron_builds_it(
    tmp_path, extra, virtual, rank_layers, chunk_layers
):
    from meshplan.passes.partition import layer_counts

    path = tmp_path / "args.txt"
    path.write_text(SHAPE_30 + extra + "\n")
    cfg = configs.load(f"megatron:{path}", world_size=8)
    assert cfg.parallel.virtual_stages == virtual and cfg.unpriced == ()
    cluster = meshplan.Cluster.preset("cpu", gpus=8)
    graph = configs.trace_model(cfg)
    plan = configs.estimate(cfg, cluster, graph)
    assert configs.stage_layer_counts(plan) == rank_layers
    if chunk_layers:
        assert tuple(tuple(layer_counts(graph, st.chunks)) for st in plan.stages) == chunk_layers


def test_megatron_uneven_first_last_with_virtual_stages_priced_as_read(tmp_path, llama8b):
    # first 6 and last 6 of 32 layers, 10 on each middle rank, each rank's layers halved over
    # 2 virtual stages: chunks (3,5,5,3 | 3,5,5,3) in model order, chunk k on rank k % 4
    # (megatron-core `get_num_layers_to_build`); priced as read, not as meshplan's 4 each
    from meshplan.passes.partition import layer_counts

    path = tmp_path / "args.txt"
    path.write_text(
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 "
        "--num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 6 "
        "--decoder-last-pipeline-num-layers 6\n"
    )
    cfg = configs.load(f"megatron:{path}", world_size=64, model="llama3-8b")
    assert cfg.parallel.virtual_stages == 2
    assert cfg.unpriced == ()
    assert cfg.stage_layers == (3, 5, 5, 3, 3, 5, 5, 3)
    assert configs.megatron_chunk_layers(32, 4, 2, 6, 6) == (3, 5, 5, 3, 3, 5, 5, 3)
    plan = configs.estimate(cfg, meshplan.Cluster.preset("dgx-h100", gpus=64), llama8b)
    # rank r holds chunks r and r + 4: 3 + 3, 5 + 5, 5 + 5, 3 + 3 layers
    assert [layer_counts(llama8b, st.chunks) for st in plan.stages] == [
        (3, 3),
        (5, 5),
        (5, 5),
        (3, 3),
    ]
    assert configs.stage_layer_counts(plan) == (6, 10, 10, 6)


@pytest.mark.parametrize("text", ["", "not: [valid\n", "# only a comment\npretrain_gpt.py\n"])
def test_a_megatron_file_without_arguments_is_refused(tmp_path, text):
    """Found in session 23: a YAML file given as Megatron arguments read as every default."""
    path = tmp_path / "args.txt"
    path.write_text(text)
    with pytest.raises(configs.ConfigError, match="no Megatron-LM arguments"):
        configs.load(f"megatron:{path}", world_size=16)


def test_megatron_fsdp_flags_read_as_zero_stages(tmp_path):
    cases = {
        "--use-distributed-optimizer": 1,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads": 2,
        "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params": 3,
        "--use-megatron-fsdp": 0,  # Megatron's default strategy is no_shard
        "--use-torch-fsdp2": 3,
        "--use-torch-fsdp2 --torch-fsdp2-no-reshard-after-forward": 2,
    }
    for flags, zero in cases.items():
        path = tmp_path / "args.txt"
        path.write_text(f"--tensor-model-parallel-size 2 {flags}\n")
        assert configs.load(f"megatron:{path}", world_size=16).parallel.zero == zero, flags


def test_megatron_cp_comm_type_read_as_the_cp_attention_mode_and_written_back(tmp_path, llama8b):
    """Megatron-LM's --cp-comm-type (default p2p: ring attention) is meshplan's cp_mode, and
    export writes it back: import(export(plan)) keeps the mode."""
    cases = {"": "ring", "--cp-comm-type p2p": "ring", "--cp-comm-type all_gather": "allgather"}
    cases |= {"--cp-comm-type a2a": "heads"}
    path = tmp_path / "args.txt"
    for flags, mode in cases.items():
        path.write_text(f"--context-parallel-size 2 {flags}\n")
        assert configs.load(f"megatron:{path}", world_size=16).parallel.cp_mode == mode, flags
    path.write_text("--context-parallel-size 1 --cp-comm-type a2a\n")
    assert configs.load(f"megatron:{path}", world_size=16).parallel.cp_mode is None
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    for mode in ("heads", "allgather"):
        pins = Parallel(tp=4, cp=2, global_batch=32, cp_mode=mode)
        plan = meshplan.plan(llama8b, cluster=cluster, parallel=pins)
        assert round_trip(tmp_path, plan, "megatron").parallel.cp_mode == mode


def test_megatron_hierarchical_cp_is_usp_both_ways(tmp_path, llama8b):
    """--cp-comm-type a2a+p2p with --hierarchical-context-parallel-sizes A P (Megatron-LM's
    two-level CP: a2a among A adjacent cp ranks, p2p across the P groups) is cp attention
    "usp" with cp_head_degree A; export writes both flags back; a missing or inconsistent
    level list is refused naming the flag."""
    path = tmp_path / "args.txt"
    path.write_text(
        "--context-parallel-size 4 --cp-comm-type a2a+p2p "
        "--hierarchical-context-parallel-sizes 2 2 --tensor-model-parallel-size 2\n"
    )
    read = configs.load(f"megatron:{path}", world_size=16)
    assert (read.parallel.cp_mode, read.parallel.cp_head_degree) == ("usp", 2)
    assert not read.unknown
    assert not any("hierarchical" in n for n in read.unpriced)
    for bad in ("", "--hierarchical-context-parallel-sizes 2 4"):
        path.write_text(f"--context-parallel-size 4 --cp-comm-type a2a+p2p {bad}\n")
        with pytest.raises(configs.ConfigError, match="hierarchical-context-parallel-sizes"):
            configs.load(f"megatron:{path}", world_size=16)
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=16)
    pins = Parallel(tp=2, cp=4, global_batch=32, cp_mode="usp", cp_head_degree=2)
    plan = meshplan.plan(llama8b, cluster=cluster, parallel=pins)
    back = round_trip(tmp_path, plan, "megatron").parallel
    assert (back.cp_mode, back.cp_head_degree) == ("usp", 2)


@pytest.mark.parametrize(
    "key", ["mics_shard_size", "mics_hierarchical_params_gather", "zeropp_loco_param"]
)
def test_deepspeed_keys_deepspeed_removed_are_refused_naming_the_field(tmp_path, key):
    # deepspeed 0.19.8 raises DeepSpeedConfigError for these (runtime/config.py)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 64, "zero_optimization": {"stage": 3, key: 8}}))
    with pytest.raises(configs.ConfigError, match=f"field zero_optimization.{key}: .*remove it"):
        configs.load(f"deepspeed:{path}", world_size=16, model="llama3-8b")


def test_deepspeed_ulysses_reads_as_head_parallel_context_parallelism(tmp_path):
    # DeepSpeed-Ulysses (`sequence_parallel_size`) exchanges the sequence by all-to-alls over
    # the attention heads: meshplan's cp_mode "heads", not the default all-gather
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 16, "sequence_parallel_size": 2}))
    cfg = configs.load(f"deepspeed:{path}", world_size=16, model="llama3-8b")
    assert (cfg.parallel.cp, cfg.parallel.cp_mode, cfg.parallel.dp) == (2, "heads", 8)
    assert any("head-parallel" in n for n in cfg.unpriced)


@pytest.mark.parametrize(
    "zero_cfg, pipeline, overlapped",
    [
        ({"stage": 2, "overlap_comm": True}, None, True),
        ({"stage": 2}, None, False),  # deepspeed's default: overlap_comm = (stage == 3)
        ({"stage": 1, "overlap_comm": False}, None, False),
        ({}, None, False),  # ZeRO-0: all-reduced after the backward
        ({"stage": 3}, None, True),  # ZeRO-3 keeps its per-unit overlap
        ({"stage": 1, "overlap_comm": True}, 2, False),  # the pipeline engine's ReduceGrads
    ],
)
def test_deepspeed_reduces_gradients_when_deepspeed_does(tmp_path, zero_cfg, pipeline, overlapped):
    data = {"train_batch_size": 64, "zero_optimization": zero_cfg}
    if pipeline:
        data["pipeline"] = {"stages": pipeline}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(data))
    cfg = configs.load(f"deepspeed:{path}", world_size=16, model="llama3-8b")
    assert cfg.engine.dp_overlap is overlapped
    assert cfg.unpriced == () and cfg.unknown == ()


def test_deepspeed_export_asks_for_the_overlap_it_was_priced_with(tmp_path, llama8b):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=64)
    plan = meshplan.estimate_plan(
        llama8b, cluster=cluster, parallel=Parallel(zero=1, global_batch=256, micro_batch=2)
    )
    text = configs.export(plan, "deepspeed").text
    assert json.loads(text)["zero_optimization"] == {"stage": 1, "overlap_comm": True}


MEGATRON_SMALL = (
    "--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 --vocab-size 1024 --micro-batch-size 1 "
    "--global-batch-size 8 --bf16 --use-distributed-optimizer"
)


@pytest.mark.parametrize("flag, overlapped", [("--overlap-grad-reduce", True), ("", False)])
def test_megatron_reduces_gradients_under_the_backward_only_when_asked(tmp_path, flag, overlapped):
    # Megatron-LM's default: finalize_model_grads reduces them after the backward
    path = tmp_path / "args.txt"
    path.write_text(f"{MEGATRON_SMALL} {flag}\n")
    cfg = configs.load(f"megatron:{path}", world_size=8)
    assert cfg.engine.dp_overlap is overlapped
    assert cfg.unpriced == cfg.unknown == ()


def test_megatron_export_asks_for_the_overlap_it_was_priced_with(tmp_path, llama8b):
    cluster = meshplan.Cluster.preset("dgx-h100", gpus=64)
    plan = meshplan.estimate_plan(
        llama8b, cluster=cluster, parallel=Parallel(zero=1, global_batch=256, micro_batch=2)
    )
    text = configs.export(plan, "megatron").text
    assert "--overlap-grad-reduce" in text and "--overlap-param-gather" in text
    after = configs.export(plan, "megatron", engine=configs.Engine(dp_overlap=False)).text
    assert "--overlap-grad-reduce" not in after
