"""The `meshplan` CLI: a real plan with no arguments, and one-line errors for user mistakes."""

import json
import os
import subprocess
import sys
import textwrap

from meshplan.cli import app
from typer.testing import CliRunner

runner = CliRunner()


def run(*args):
    return runner.invoke(app, list(args))


def assert_user_error(result, *needles):
    assert result.exit_code == 2, (result.exit_code, result.output, result.stderr)
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr  # exactly one line, never a traceback
    assert lines[0].startswith("error:")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_plan_without_arguments_prints_a_real_plan():
    """The README's main job, through the installed entry point."""
    proc = subprocess.run(
        [sys.executable, "-m", "meshplan.cli", "plan"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert proc.returncode == 0, proc.stderr
    for needle in ("parallel configuration", "tokens/s", "MFU", "fits: yes", "stage"):
        assert needle in proc.stdout


def test_plan_json_output_and_validate(tmp_path):
    path = tmp_path / "plan.json"
    r = run(
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "16",
        "--global-batch",
        "32",
        "-o",
        str(path),
    )
    assert r.exit_code == 0, r.output + r.stderr
    data = json.loads(path.read_text())
    assert data["global_batch"] == 32
    r = run("validate", str(path))
    assert r.exit_code == 0 and "valid" in r.output
    r = run("validate", str(path), "--cluster", "dgx-a100", "--gpus", "16")
    assert_user_error(r, "made for cluster")


def test_pinned_choice_is_honoured():
    r = run(
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "16",
        "--tp",
        "2",
        "--global-batch",
        "32",
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["degrees"]["tp"] == 2


def test_estimate_reports_a_user_configuration():
    r = run(
        "estimate",
        "--model",
        "tiny",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "8",
        "--tp",
        "2",
        "--pp",
        "2",
        "--global-batch",
        "16",
        "--json",
    )
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert (d["degrees"]["tp"], d["degrees"]["pp"], d["degrees"]["dp"]) == (2, 2, 2)
    assert d["solver"]["status"] == "fixed"


def test_models_and_clusters_list_presets():
    r = run("models")
    assert r.exit_code == 0 and "llama3-405b" in r.output and "mixtral-8x7b" in r.output
    r = run("clusters")
    assert r.exit_code == 0 and "dgx-h100" in r.output and "H100" in r.output


def test_unknown_gpu_type_lists_known_ones():
    assert_user_error(run("plan", "--model", "tiny", "--cluster", "H900"), "H100", "A100")


def test_unknown_model_lists_known_ones():
    assert_user_error(run("plan", "--model", "llama9-1t"), "llama3-8b")


def test_cluster_file_with_bad_field_names_field_and_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(
        textwrap.dedent("""\
        name: bad
        groups:
          - {name: g0, gpu: H100, nodes: 2, gpus_per_node: 0, intra_link: nvlink4,
             inter_link: ib-ndr}
        """)
    )
    assert_user_error(
        run("plan", "--model", "tiny", "--cluster", str(path)), "bad.yaml", "gpus_per_node"
    )


def test_untraceable_model_names_the_module(tmp_path):
    path = tmp_path / "dyn.py"
    path.write_text(
        textwrap.dedent("""\
        import torch
        from torch import nn

        class Branchy(nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = nn.Linear(16, 16)
            def forward(self, x):
                y = self.proj(x)
                if y.sum() > 0:          # data-dependent control flow
                    y = y * 2
                return y.sum()

        class Outer(nn.Module):
            def __init__(self):
                super().__init__()
                self.block = Branchy()
            def forward(self, x):
                return self.block(x)

        def factory():
            return Outer(), (torch.randn(4, 16),)
        """)
    )
    r = run("plan", "--model", f"{path}:factory", "--cluster", "dgx-h100", "--gpus", "8")
    assert_user_error(r, "block")


def test_model_that_fits_nowhere_says_how_much_memory(tmp_path):
    r = run(
        "plan",
        "--model",
        "llama3-405b",
        "--seq-len",
        "1024",
        "--cluster",
        "RTX4090",
        "--gpus",
        "8",
        "--global-batch",
        "8",
    )
    assert_user_error(r, "GiB")


def test_estimate_with_nondividing_tp_is_a_user_error():
    assert_user_error(
        run("estimate", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "3"),
        "tp=3",
    )


def test_objective_flags_reach_the_solver():
    # min_gpus: the fewest GPUs whose plan meets the target; with a target this low, one node
    # of the 16 is plenty and the plan must use fewer GPUs than the cluster has
    args = ("plan", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "16", "--json")
    r = run(*args, "--objective", "min_gpus", "--target-tokens-per-s", "1000")
    assert r.exit_code == 0, r.output + r.stderr
    data = json.loads(r.stdout)
    used = sum(1 for row in data["ranks"] if len(row) == 8)
    assert used < 16 and data["predicted"]["tokens_per_s"] >= 1000
    assert data["solver"]["objective"] == "min_gpus"
    assert_user_error(run(*args, "--objective", "fastest"), "objective must be one of")
    assert_user_error(run(*args, "--objective", "min_gpus"), "target_tokens_per_s")
    assert_user_error(run(*args, "--price", "H100"), "--price wants GPU=DOLLARS")


def test_schedule_pin_gives_zero_bubble_with_its_chunks(tmp_path):
    path = tmp_path / "zb.json"
    r = run(
        "plan",
        "--model",
        "tiny",
        "--cluster",
        "dgx-h100",
        "--gpus",
        "8",
        "--pp",
        "2",
        "--schedule",
        "zero_bubble",
        "--global-batch",
        "16",
        "-o",
        str(path),
    )
    assert r.exit_code == 0, r.output + r.stderr
    data = json.loads(path.read_text())
    assert data["schedule"] == "zero_bubble" and data["virtual_stages"] == 2
    # ZB-V's V shape: rank 0 runs the first and the last chunk (embedding and LM head)
    first, last = data["stages"][0]["chunks"]
    assert first[0] == 0 and last[1] == len(data["model"]["units"])
    assert_user_error(
        run("plan", "--model", "tiny", "--pp", "3", "--schedule", "zero_bubble"), "zero_bubble"
    )


def test_compress_and_quantize_flags_reach_the_plan():
    args = ("plan", "--model", "tiny", "--cluster", "two-sites", "--json")
    r = run(*args, "--compress", "off", "--quantize", "gradients")
    assert r.exit_code == 0, r.output + r.stderr
    data = json.loads(r.stdout)
    assert data["quantization"]["mode"] == "gradients" and data["compression"]["mode"] == "off"
    # compression off: no collective is coded losslessly, whatever the cost model says
    assert all(d["method"] != "lossless" for d in data["compression"]["collectives"])
    assert_user_error(run(*args, "--quantize", "all"), "quantize must be one of")
    assert_user_error(run(*args, "--compress", "yes"), "compress")


def test_estimate_engine_flags_price_another_stack():
    base = ("estimate", "--model", "tiny", "--cluster", "dgx-h100", "--gpus", "8", "--tp", "2")
    base += ("--global-batch", "16", "--json")
    eager = json.loads(run(*base).stdout)["predicted"]["step_time_s"]
    r = run(*base, "--compile", "--tp-overlap")
    assert r.exit_code == 0, r.stderr
    faster = json.loads(r.stdout)
    assert faster["predicted"]["step_time_s"] < eager
    assert any("engine fused+tp-overlap" in n for n in faster["predicted"]["notes"])
    assert_user_error(run(*base, "--float8", "rowwise"), "rowwise", "not modelled")
    a100 = ("estimate", "--model", "tiny", "--cluster", "dgx-a100", "--gpus", "8")
    assert_user_error(run(*a100, "--float8", "tensorwise"), "A100", "no FP8")
