"""Asymmetric against equal context-parallel shares on mixed H100 + A100 (issue 19,
docs/context_parallel.md), HexiSeq's setting in meshplan's cost model.

HexiSeq (PAPERS.md) trains long sequences with one cp group over H100s and A100s together
and gives each GPU a share of the sequence (and of the heads) in proportion to what it can
do; it reports 1.11x on average, up to 1.19x, over equal shares on its mixed H100 + A100
testbeds (and up to 1.72x in simulation with four GPU types), from 3B to 70B parameters and
up to a million tokens. Here each model and sequence length is placed with one cp group
spanning equal numbers of H100 SXM and A100 80GB SXM GPUs at one site (NDR and HDR
InfiniBand; `mixed-h100-a100`), dp 1, pp 1, ZeRO-3, full recomputation, one sequence per
step, and priced twice by `meshplan.estimate_plan`:

    equal       every cp rank S / cp tokens (and h / cp heads): the A100s set the pace
    balanced    `balance_cp=True`: the shares that equalise the ranks (`planner.cp_shares`)

for each attention mode that runs ("allgather"; "heads" where cp divides a tp rank's heads).
It prints both step times, their ratio beside HexiSeq's 1.11-1.19x, the H100 ranks' token
share (x the equal share), the H100s alone with cp over half the GPUs (what a user could run
instead, the A100s idle), and whether each fits in 80 GB.

    python benchmarks/hexiseq.py              # the grid below, ~2 min on 2 cores
    python benchmarks/hexiseq.py --quick      # 3B and 8B at 32K and 128K only
    python benchmarks/hexiseq.py --plan       # also what `meshplan.plan` picks, ~5 min

With --plan, each model and length is also planned by `meshplan.plan` on the same cluster
(one sequence per step, default budget): its step time and whether its cp group spans the
groups (the planner's step 5, `cp_shares.spanning_search`, against its plan inside groups).
"""

from __future__ import annotations

import argparse
import dataclasses
import time

# (preset, GPUs, tp): 3B to 70B; tp 8 and 64 GPUs for 70B (its ZeRO-3 states need them)
MODELS = (
    ("gpt3-2.7b", 16, 1),
    ("llama3-8b", 16, 1),
    ("llama2-13b", 32, 2),
    ("llama3-70b", 64, 8),
)
SEQS = (32768, 131072, 524288, 1048576)
PAPER = "1.11 mean, up to 1.19 (HexiSeq, H100 + A100 testbeds)"


def run(name: str, gpus: int, tp: int, seq: int, mode: str) -> dict | None:
    import meshplan
    from meshplan.api import as_graph
    from meshplan.ir import Cluster, Parallel

    model, inputs = meshplan.models.get(name, seq_len=seq)
    graph = as_graph(model, inputs, name=name)
    heads = graph.info.heads // tp
    cp = gpus // tp
    if mode == "heads" and heads % cp:
        return None
    cluster = Cluster.preset("mixed-h100-a100", gpus=gpus)
    p = Parallel(
        dp=1,
        tp=tp,
        pp=1,
        cp=cp,
        ep=1,
        micro_batch=1,
        global_batch=1,
        recompute="full",
        zero=3,
        sequence_parallel=tp > 1,
        cp_mode=mode,
    )
    equal = meshplan.estimate_plan(graph, cluster=cluster, parallel=p)
    balanced = meshplan.estimate_plan(graph, cluster=cluster, parallel=p, balance_cp=True)
    # What a user could do instead: the H100s alone, cp over half the GPUs (A100s idle).
    alone = None
    if mode != "heads" or heads % (cp // 2) == 0:
        h100s = Cluster.preset("dgx-h100", gpus=gpus // 2)
        half = dataclasses.replace(p, cp=cp // 2)
        alone = meshplan.estimate_plan(graph, cluster=h100s, parallel=half).predicted
    return {
        "equal": equal.predicted,
        "balanced": balanced.predicted,
        "alone": alone,
        "h100_share": balanced.parallel.cp_shares[0] * cp / seq,
        "span": equal.stages[0].cp_groups,
    }


def planner_choice(name: str, gpus: int, seq: int) -> tuple[float, str, float]:
    """What `meshplan.plan` picks for one sequence per step: (step s, description, wall s)."""
    import meshplan
    from meshplan.api import as_graph
    from meshplan.ir import Cluster

    model, inputs = meshplan.models.get(name, seq_len=seq)
    graph = as_graph(model, inputs, name=name)
    cluster = Cluster.preset("mixed-h100-a100", gpus=gpus)
    t0 = time.perf_counter()
    try:
        plan = meshplan.plan(graph, cluster=cluster, global_batch=1)
    except meshplan.InfeasibleError as e:
        return float("nan"), f"no plan ({e})", time.perf_counter() - t0
    p, st = plan.parallel, plan.stages[0]
    where = (
        "spanning " + " + ".join(f"{c} cp ranks of {g}" for g, c in st.cp_groups)
        if st.cp_groups
        else "inside " + ", ".join(sorted({g for g, _ in st.replicas}))
    )
    how = f"tp {p.tp} cp {p.cp} pp {p.pp} ({p.cp_mode or '-'}), {where}"
    return plan.predicted.step_time_s, how, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="3B and 8B at 32K and 128K only")
    ap.add_argument("--plan", action="store_true", help="also plan each with meshplan.plan")
    args = ap.parse_args(argv)
    models = MODELS[:2] if args.quick else MODELS
    seqs = SEQS[:2] if args.quick else SEQS
    print(f"{'model':<11} {'GPUs':>4} {'tp':>2} {'tokens':>8} {'mode':<9} {'equal s':>9} "
          f"{'balanced s':>10} {'ratio':>6} {'H100 share':>10} {'H100s alone s':>13} "
          "fits (equal / balanced / alone)")  # fmt: skip
    start, ratios, planned = time.perf_counter(), [], []
    for name, gpus, tp in models:
        for seq in seqs:
            for mode in ("allgather", "heads"):
                try:
                    r = run(name, gpus, tp, seq, mode)
                except ValueError as e:  # a configuration the model or cluster refuses
                    print(f"{name:<11} {gpus:>4} {tp:>2} {seq:>8} {mode:<9} refused: {e}")
                    continue
                if r is None:
                    continue
                if args.plan and mode == "allgather":
                    planned.append((name, gpus, seq, planner_choice(name, gpus, seq)))
                e, b, a = r["equal"], r["balanced"], r["alone"]
                ratio = e.step_time_s / b.step_time_s
                fit = [("yes" if x.fits else "no") if x else "-" for x in (e, b, a)]
                if e.fits and b.fits:
                    ratios.append(ratio)
                alone = f"{a.step_time_s:>13.2f}" if a else f"{'-':>13}"
                print(
                    f"{name:<11} {gpus:>4} {tp:>2} {seq:>8} {mode:<9} {e.step_time_s:>9.2f} "
                    f"{b.step_time_s:>10.2f} {ratio:>5.2f}x {r['h100_share']:>9.2f}x {alone} "
                    + " / ".join(fit)
                )
    if ratios:
        mean = sum(ratios) / len(ratios)
        print(
            f"\nbalanced over equal shares, rows where both fit: mean {mean:.2f}x, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)} rows); paper: {PAPER}"
        )
    if planned:
        print("\nmeshplan.plan (one sequence per step):")
        for name, gpus, seq, (step, how, wall) in planned:
            print(
                f"{name:<11} {gpus:>4} {seq:>8}  {step:>8.2f} s  {how}  (planned in {wall:.1f} s)"
            )
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
