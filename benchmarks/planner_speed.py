"""Planner speed (docs/planner.md): trace time and solve time on the reference scenarios.

    python benchmarks/planner_speed.py             # all scenarios
    python benchmarks/planner_speed.py --only 8b   # scenarios whose name contains "8b"

Scenarios, work budgets and issue 17's solve-time targets (on the 2-core development
machine; each must also be optimal):

- Llama-3-8B on 64 homogeneous H100 (8 DGX H100 nodes)             budget 2,  target 2 s
- Llama-3-70B on 512 GPUs, 256 H100 + 256 A100, over three link tiers
  (NVLink inside nodes, InfiniBand NDR / HDR between nodes of a group, 100 GbE between
  the two groups)                                                    budget 10, target 5 s
- Llama-3-405B and DeepSeekMoE-16B on 4,096 GPUs, 2,048 H100 + 2,048 A100,
  same three tiers                                                   budget 60, target 20 s
- More GPU types (no issue target; each must be optimal): GPT-3 2.7B (GPT-Neo-2.7B's shape)
  on 128 A100-40GB + 128 V100-16GB + 128 T4, nodes of 4 with one 50 Gb/s Ethernet NIC
  (Sailor's network), and Llama-3-8B on 32 each of H100, A100-80GB, V100-16GB and T4 over
  InfiniBand HDR                                                     budget 10
- Memory-tight (no issue target; must be optimal): Llama-3-70B on 32 A100-40GB + 32 V100-16GB
  + 32 T4, nodes of 4 with one 25 Gb/s Ethernet NIC, where the V100 and T4 groups cannot
  hold the model's states by themselves                             budget 10

Tracing (fake tensors, once per model) is timed apart from the solve. The budget is the
solver's deterministic work (`time_limit_s`), kept from earlier sessions so the plans stay
comparable; a solve that needs all of it shows as status "feasible" with its proven gap. The
exit status is 0 when every solve is optimal within its target.
"""

from __future__ import annotations

import argparse
import time

GLOBAL_BATCH = {
    "llama3-8b": 512,
    "llama3-70b": 1024,
    "llama3-405b": 2048,
    "deepseek-moe-16b": 2048,
    "gpt3-2.7b": 2048,  # Sailor's GPT-Neo-2.7B scenarios
}


def mixed(gpus: int):
    """Half H100 (DGX H100: NVLink4, 8 x NDR), half A100-80GB (DGX A100: NVLink3, 8 x HDR),
    the two halves joined by 100 GbE."""
    from meshplan.ir import Cluster, DeviceGroup, GroupLink
    from meshplan.ir.hardware import LINK_TIERS, gpu_spec

    nodes = gpus // 16
    groups = (
        DeviceGroup("h100", gpu_spec("H100"), nodes, 8, "nvlink4", "ib-ndr", 8, site="a"),
        DeviceGroup("a100", gpu_spec("A100-80GB"), nodes, 8, "nvlink3", "ib-hdr", 8, site="b"),
    )
    tiers = ("nvlink4", "nvlink3", "ib-ndr", "ib-hdr", "100gbe")
    return Cluster(
        f"mixed-{gpus}",
        groups,
        tuple(LINK_TIERS[t] for t in tiers),
        (GroupLink("a", "b", "100gbe"),),
    )


def more_types(kinds: int, nodes: int = 32, gbits: int = 50):
    """kinds = 3: `nodes` nodes each of 4 A100-40GB, 4 V100-16GB and 4 T4, one `gbits` Gb/s
    Ethernet NIC per node (default: vs_sailor.py's network); kinds = 4: 4 DGX H100, 4 DGX
    A100, 8 nodes of 4 V100-16GB and 8 of 4 T4, InfiniBand HDR between nodes."""
    from meshplan.ir import Cluster, DeviceGroup, LinkKind, LinkTier
    from meshplan.ir.hardware import DEFAULT_EFFICIENCY, DEFAULT_LATENCY, gpu_spec, link_tier

    if kinds == 3:
        eth = LinkKind.ETHERNET
        net = LinkTier(
            f"eth-{gbits}g", eth, gbits * 1e9 / 8, DEFAULT_LATENCY[eth], DEFAULT_EFFICIENCY[eth]
        )
        groups = (
            DeviceGroup("a100", gpu_spec("A100-40GB"), nodes, 4, "nvlink3", net.name),
            DeviceGroup("v100", gpu_spec("V100-16GB"), nodes, 4, "nvlink2", net.name),
            DeviceGroup("t4", gpu_spec("T4"), nodes, 4, "nvlink2", net.name),
        )
        return Cluster(
            f"a100+v100+t4-{12 * nodes}", groups, (link_tier("nvlink3"), link_tier("nvlink2"), net)
        )
    groups = (
        DeviceGroup("h100", gpu_spec("H100"), 4, 8, "nvlink4", "ib-hdr"),
        DeviceGroup("a100", gpu_spec("A100-80GB"), 4, 8, "nvlink3", "ib-hdr"),
        DeviceGroup("v100", gpu_spec("V100-16GB"), 8, 4, "nvlink2", "ib-hdr"),
        DeviceGroup("t4", gpu_spec("T4"), 8, 4, "nvlink2", "ib-hdr"),
    )
    tiers = ("nvlink4", "nvlink3", "nvlink2", "ib-hdr")
    return Cluster("four-types-128", groups, tuple(link_tier(t) for t in tiers))


def homogeneous(gpus: int):
    from meshplan.ir import Cluster

    return Cluster.preset("dgx-h100", gpus=gpus)


# (name, model preset, cluster, work budget, solve-time target in seconds: issue 17's, or None)
SCENARIOS = [
    ("llama3-8b on 64 H100", "llama3-8b", lambda: homogeneous(64), 2.0, 2.0),
    ("llama3-70b on 512 H100+A100", "llama3-70b", lambda: mixed(512), 10.0, 5.0),
    ("llama3-405b on 4096 H100+A100", "llama3-405b", lambda: mixed(4096), 60.0, 20.0),
    ("deepseek-moe-16b on 4096 H100+A100", "deepseek-moe-16b", lambda: mixed(4096), 60.0, 20.0),
    ("gpt3-2.7b on 384 A100+V100+T4", "gpt3-2.7b", lambda: more_types(3), 10.0, None),
    ("llama3-8b on 128 of four types", "llama3-8b", lambda: more_types(4), 10.0, None),
    # memory-tight: only A100-40GB group can hold the model's states alone (1.24 TB of them)
    (
        "llama3-70b on 96 A100-40GB+V100+T4",
        "llama3-70b",
        lambda: more_types(3, nodes=8, gbits=25),
        10.0,
        None,
    ),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="run the scenarios whose name contains this")
    args = ap.parse_args(argv)
    import meshplan
    from meshplan.api import as_graph, resolve_precision
    from meshplan.cost_model.engine import EAGER
    from meshplan.ir import Parallel
    from meshplan.solver import solve

    graphs: dict[str, object] = {}
    rows = []
    for name, preset, make, budget, target in SCENARIOS:
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        if preset not in graphs:
            model, inputs = meshplan.models.get(preset)
            graphs[preset] = as_graph(model, inputs, name=preset)
        trace_s = time.perf_counter() - t0
        graph, cluster = graphs[preset], make()
        t1 = time.perf_counter()
        # the precision `meshplan plan` would take (fp16 where a GPU has no bf16: V100, T4)
        _, dtype, _, _ = resolve_precision(graph, cluster, None, EAGER)
        r = solve(
            graph,
            cluster,
            Parallel(),
            global_batch=GLOBAL_BATCH[preset],
            time_limit_s=budget,
            dtype=dtype,
        )
        solve_s = time.perf_counter() - t1
        rows.append((name, trace_s, solve_s, target, r))
        p = r.parallel
        mb = r.stages[0].shares
        ok = r.status == "optimal" and (target is None or solve_s <= target)
        print(
            f"{name:38s} trace {trace_s:6.2f} s  solve {solve_s:6.2f} s (target "
            f"{f'{target:4.0f} s' if target else 'none'}, {'ok' if ok else 'MISSED'}; budget "
            f"{budget:g})  {r.status} gap {r.gap * 100:.2f}%  "
            f"{r.candidates:,} configs, {r.splits:,} (config, split) pairs bounded, "
            f"{r.explored} priced, {r.placement_models} CP-SAT models",
            flush=True,
        )
        layers = [st.last_unit - st.first_unit for st in r.stages]
        print(
            f"{'':38s} tp{p.tp} pp{p.pp} dp{p.dp} cp{p.cp} ep{p.ep} mb{p.micro_batch} "
            f"ZeRO-{p.zero} {p.recompute.value} {p.schedule.value}"
            f"{f' v{p.virtual_stages}' if p.virtual_stages else ''}; units/stage "
            f"{layers if len(layers) <= 8 else str(layers[:8])[:-1] + ', ...]'}; "
            f"shares {mb or 'equal'}; step {r.prediction.step_time_s:.3f} s, "
            f"MFU {r.prediction.mfu * 100:.1f}%",
            flush=True,
        )
    return (
        0 if all(r.status == "optimal" and (t is None or s <= t) for _, _, s, t, r in rows) else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
