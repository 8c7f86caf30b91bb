"""Rehearse one tensor-parallel rank on fake tensors, so that TP the model's code cannot run
is refused at plan time instead of crashing, or silently computing something else, on GPUs.

Under tensor parallelism the runtime hands the model's own code local shards: a
column-parallel projection returns `out / tp` features, a row-parallel one reads `in / tp`,
and the head-count attributes of each attention/MLP region are divided by tp
(`runtime.tensor_parallel`). Code that takes a width from somewhere else (`C // self.n_head`
with `C` the full model width, `view(b, s, C)`, a head count under an attribute name the
runtime does not know) then either fails on the shard's shapes or, worse, runs with heads of
the wrong size (`view(b, s, self.nh, -1)` with `self.nh` unchanged gives head_dim / tp).

So the planner traces the model once more as tp rank 0 would run it: the parameters the
plan shards inside the repeated layers get their shard's shape (`trace(..., param_shapes=)`),
the runtime's own choice of regions localises head counts (`runtime.tensor_parallel.tp_styles`
and `localise_head_counts`, undone afterwards), and every attention of the rehearsal must see
heads / tp heads of the unsharded head_dim. A failure or a mismatch becomes the model's "tp"
blocker (`ModelInfo.blockers`), which the planner honours like any other (`ir.facts`).

Skipped, as already covered by the runtime's parity tests: the zoo's decoder and HuggingFace
decoders of the families checked there (`ir.facts.is_verified_hf_decoder`). A model whose TP
is already blocked is not rehearsed.
"""

from __future__ import annotations

import dataclasses
import math
import types

import torch
from meshplan.ir import Graph, OpKind
from meshplan.ir.facts import Dataflow, is_verified_hf_decoder, is_zoo_model, pipeline_cut
from meshplan.ir.trace import TraceError, trace
from meshplan.passes.sharding import tp_param_placements
from torch import nn

# The runtime modules used below are imported where they are used: importing
# `meshplan.runtime` loads torch.distributed's tensor and pipelining packages (about 1.5 s),
# which `meshplan plan` needs only for models it rehearses (module docstring: not the zoo's
# decoder or a HuggingFace decoder of a checked family).


def rehearsal_degree(graph: Graph) -> int:
    """The tp degree rehearsed: the smallest >= 2 dividing the heads and KV heads; 2 when the
    trace found no attention heads (attention written out, or SDPA with a mask, which fake
    tensors decompose): the model's code is still run on its shards."""
    info = graph.info
    heads = math.gcd(info.heads, info.kv_heads or info.heads)
    if not heads:
        return 2
    return next((t for t in range(2, heads + 1) if heads % t == 0), 0)


def shard_shapes(model: nn.Module, view, tp: int) -> dict[str, tuple[int, ...]]:
    """The shape the model's code sees of every nn.Linear weight the runtime shards on rank 0
    (`runtime.tensor_parallel.tp_styles`): a row-parallel projection reads a share of its input
    features anywhere; a column-parallel one hands on a share of its output features inside
    the repeated layers, while outside them (an LM head, a projection before the layers) the
    runtime gathers its output, so the code sees the whole width there."""
    from meshplan.runtime.tensor_parallel import placement_of

    placements = dict(view.placements)
    shapes: dict[str, tuple[int, ...]] = {}
    for path, mod in model.named_modules():
        if not isinstance(mod, nn.Linear):
            continue
        p = placement_of(f"{path}.weight", view, placements)
        inside = any(path.startswith(u + ".") for u in view.model.units if not u.startswith("<"))
        if p == "S(0)" and inside:  # column-parallel: a share of the output features
            shapes[f"{path}.weight"] = (mod.out_features // tp, mod.in_features)
            if mod.bias is not None:
                shapes[f"{path}.bias"] = (mod.out_features // tp,)
        elif p == "S(1)":  # row-parallel: a share of the input features
            shapes[f"{path}.weight"] = (mod.out_features, mod.in_features // tp)
    return shapes


def rehearse_tensor_parallel(
    model: nn.Module,
    graph: Graph,
    example_inputs: tuple,
    kwargs: dict | None,
    flow: Dataflow,
) -> Graph:
    """`graph` with a "tp" blocker when one tensor-parallel rank cannot run the model's code
    correctly (module docstring); `graph` unchanged otherwise. `graph` and `flow` are the
    whole model's trace and its data-flow facts (`trace(..., flow_out=)`)."""
    info = graph.info
    if info.blocker("tp") or is_zoo_model(model) or is_verified_hf_decoder(model):
        return graph
    tp = rehearsal_degree(graph)
    if not tp:
        return graph
    why = _rehearse(model, graph, flow, example_inputs, kwargs or {}, tp)
    if not why:
        return graph
    blockers = tuple(sorted((*info.blockers, ("tp", why))))
    return dataclasses.replace(graph, info=dataclasses.replace(info, blockers=blockers))


def _rehearse(
    model: nn.Module, graph: Graph, flow: Dataflow, inputs: tuple, kwargs: dict, tp: int
) -> str:
    from meshplan.runtime.errors import RuntimePlanError
    from meshplan.runtime.tensor_parallel import HEAD_COUNT_ATTRS, localise_head_counts, tp_styles

    view = types.SimpleNamespace(  # the parts of a Plan `tp_styles` reads
        parallel=types.SimpleNamespace(tp=tp, sequence_parallel=False),
        placements=tp_param_placements(graph),
        model=types.SimpleNamespace(units=tuple(u.name for u in graph.units)),
    )
    try:
        styles, regions = tp_styles(model, view)  # type: ignore[arg-type]
    except RuntimePlanError as exc:
        return str(exc).removeprefix("runtime: ")
    if why := _unsharded_inside_region(model, styles, regions):
        return why
    saved = [
        (model.get_submodule(path), attr, getattr(model.get_submodule(path), attr))
        for path in regions
        for attr in HEAD_COUNT_ATTRS
        if isinstance(getattr(model.get_submodule(path), attr, None), int)
    ]
    flows: list[Dataflow] = []
    try:
        localise_head_counts(model, regions)
        shapes = shard_shapes(model, view, tp)
        rank = trace(model, *inputs, kwargs=kwargs, param_shapes=shapes, flow_out=flows)
    except (RuntimePlanError, TraceError) as exc:
        first = str(exc).removeprefix("runtime: ")
        return f"one tp={tp} rank cannot run the model's code on its shards: {first}"
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)
    return _compare_attention(graph, rank, tp) or _compare_made(flow, flows[0], tp)


def _compare_made(whole: Dataflow, rank: Dataflow, tp: int) -> str:
    """The tensors the forward makes of its own (`Dataflow.made`) must not change shape on the
    rehearsed rank: one that does was sized from a head count the runtime divided by tp, so
    its values are per head (ALiBi slopes from `self.n_heads`), and each rank would compute
    those of the first heads instead of its own: wrong numbers, not a failure."""
    for (module, how, shape), (_, _, got) in zip(whole.made, rank.made):
        if shape != got:
            return (
                f"{module or '<root>'} makes a tensor of its own ({how.removeprefix('aten.')}, "
                f"shape {list(shape)}) whose shape follows its head count ({list(got)} under "
                f"tp={tp}): its values are per head, and each rank would compute those of the "
                "first heads, not its own"
            )
    if len(whole.made) != len(rank.made):
        return f"under tp={tp} the forward makes other tensors of its own than on one rank"
    return ""


def _unsharded_inside_region(model: nn.Module, styles: dict, regions: dict[str, int]) -> str:
    """A module with parameters of its own inside a TP region (the parent of a row- and
    column-parallel projection, whose input the runtime turns into a replicated DTensor)
    that the runtime does not shard: its plain parameters would meet that DTensor. OPT's
    decoder layer holds its MLP projections itself, so the layer is the region and its
    layer norms sit inside it (session 23: tp failed inside the ranks)."""
    for region in regions:
        for path, mod in model.get_submodule(region).named_modules():
            full = f"{region}.{path}" if path else region
            if full in styles or not any(True for _ in mod.parameters(recurse=False)):
                continue
            return (
                f"{full} ({type(mod).__name__}) has parameters inside the tensor-parallel "
                f"region {region} (the parent of its row- and column-parallel projections), "
                "where the runtime hands modules replicated DTensors; it shards only the "
                "projections: plan without tp, or move the projections into their own module"
            )
    return ""


def _compare_attention(whole: Graph, rank: Graph, tp: int) -> str:
    """Every attention of the rehearsed rank must see heads / tp heads of full head_dim."""
    from meshplan.runtime.tensor_parallel import HEAD_COUNT_ATTRS

    want = [op for _, b in whole.unit_blocks() for op in b.ops if op.kind is OpKind.ATTENTION]
    got = [
        (u.name, op) for u, b in rank.unit_blocks() for op in b.ops if op.kind is OpKind.ATTENTION
    ]
    for w, (unit, g) in zip(want, got):
        where = ".".join(p for p in (unit if not unit.startswith("<") else "", g.module) if p)
        heads, head_dim = w.attr("heads"), w.attr("head_dim")
        if (g.attr("heads"), g.attr("head_dim")) != (heads // tp if heads else None, head_dim):
            return (
                f"under tp={tp} the attention in {where or '<root>'} would run "
                f"{g.attr('heads')} heads of {g.attr('head_dim')} features instead of "
                f"{heads // tp} of {head_dim}: its head count is not an attribute the runtime "
                f"divides by tp ({', '.join(HEAD_COUNT_ATTRS[:4])}, ...)"
            )
    return ""


def rehearse_pipeline_cut(model: nn.Module, graph: Graph, example_inputs: tuple) -> Graph:
    """`graph` with a "pp" blocker when the runtime cannot cut `model` from its exported
    graph (`runtime.graph_stages`, the cut for models without a hook that are neither the
    zoo's nor an HF decoder): the cut is made once here, into two halves, on fake tensors, at
    the traced input (the first example input: the runner passes one), so what torch.export
    cannot capture is refused when the plan is made instead of when the ranks start."""
    info = graph.info
    layers = [u.name for u in graph.units if not u.name.startswith("<")]
    if info.blocker("pp") or len(layers) < 2 or pipeline_cut(model) != "graph":
        return graph
    first = next((t for t in example_inputs if isinstance(t, torch.Tensor)), None)
    if first is None:
        why = "the model takes no tensor input to export it with"
    else:
        from meshplan.runtime.errors import RuntimePlanError
        from meshplan.runtime.graph_stages import graph_cut

        half = len(layers) // 2
        try:
            graph_cut(model, first, {u: int(i >= half) for i, u in enumerate(layers)}, 2)
            return graph
        except RuntimePlanError as exc:
            why = str(exc).removeprefix("runtime: ")
    blockers = tuple(sorted((*info.blockers, ("pp", why))))
    return dataclasses.replace(graph, info=dataclasses.replace(info, blockers=blockers))
