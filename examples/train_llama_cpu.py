"""Train a small Llama-style model on CPU from a meshplan plan file.

Make a plan for 4 CPU processes (the plan must be made for this model: same sizes), then
launch it:

    python examples/train_llama_cpu.py --make-plan plan.json --dp 2 --tp 2
    meshplan launch plan.json -- python examples/train_llama_cpu.py --steps 5

Under `meshplan launch` (torchrun) the plan's path arrives in MESHPLAN_PLAN. Every rank builds
the same model from the same seed; `meshplan.runtime.apply` shards it as the plan says.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.nn.functional as F

# Small enough to train in seconds on a laptop CPU; Llama style (RMSNorm, SwiGLU, RoPE, GQA).
MODEL = dict(layers=4, hidden=64, heads=4, kv_heads=2, ffn=128, vocab=256, seq_len=32)


def build_model(seed: int = 0):
    import meshplan

    torch.manual_seed(seed)
    model, _ = meshplan.models.transformer(dtype="float32", device="cpu", **MODEL)
    return model


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def make_plan(path: str, gpus: int, **parallel: int) -> None:
    """Plan (a fixed configuration, priced by the cost model) and write it as JSON."""
    import meshplan

    model, inputs = meshplan.models.transformer(dtype="float32", **MODEL)  # meta device
    cluster = meshplan.Cluster.preset("cpu", gpus=gpus)
    plan = meshplan.estimate_plan(model, inputs, cluster, meshplan.Parallel(**parallel))
    plan.to_json(path)
    print(plan.explain())


def train(plan_path: str, steps: int) -> None:
    import meshplan.runtime as rt
    from meshplan.ir.plan import Plan

    rt.init_distributed(timeout_s=120)
    plan = Plan.from_json(plan_path)
    runner = rt.apply(build_model(), plan, loss_fn, lambda ps: torch.optim.AdamW(ps, lr=3e-3))
    gen = torch.Generator().manual_seed(1)
    # A learnable toy task: predict the next token of a fixed random sequence.
    data = torch.randint(
        0, MODEL["vocab"], (plan.parallel.global_batch, MODEL["seq_len"] + 1), generator=gen
    )
    tokens, targets = data[:, :-1], data[:, 1:]
    for step in range(steps):
        loss = runner.step(tokens, targets)
        if runner.ctx.rank == 0:
            print(f"step {step}: loss {loss:.4f}", flush=True)
    state = runner.full_state_dict()
    if runner.ctx.rank == 0:
        print(f"done: {len(state)} tensors, {sum(t.numel() for t in state.values()):,} params")
    torch.distributed.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--make-plan", metavar="PATH", help="write a plan for this model and exit")
    ap.add_argument("--gpus", type=int, default=4, help="CPU ranks of the plan (--make-plan)")
    for k in ("dp", "tp", "pp", "micro-batch", "global-batch"):
        ap.add_argument(f"--{k}", type=int, default=None)
    ap.add_argument("--zero", type=int, default=None)
    ap.add_argument("--virtual-stages", type=int, default=None)
    ap.add_argument(
        "--schedule", default=None, help="gpipe, 1f1b, interleaved_1f1b or zero_bubble (with --pp)"
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--plan", default=os.environ.get("MESHPLAN_PLAN"), help="plan JSON")
    args = ap.parse_args()
    if args.make_plan:
        fields = {
            k: getattr(args, k.replace("-", "_"))
            for k in (
                "dp",
                "tp",
                "pp",
                "micro-batch",
                "global-batch",
                "zero",
                "virtual-stages",
                "schedule",
            )
        }
        make_plan(
            args.make_plan,
            args.gpus,
            **{k.replace("-", "_"): v for k, v in fields.items() if v is not None},
        )
        return
    if not args.plan:
        ap.error("no plan: run under `meshplan launch plan.json -- ...` or pass --plan")
    train(args.plan, args.steps)


if __name__ == "__main__":
    main()
