"""Pipeline stages for any model, cut from its exported graph at the plan's unit boundaries.

Models the runtime knows (the zoo's decoder, HuggingFace decoder LMs, models with their own
`pipeline_stage` hook) are cut by hand in `pipeline_parallel`. Every other model with a stack
of repeated layers (the plan's units) is cut here, from its own code:

1. **Which modules are called from the model's glue** (`_top_calls`): one forward on fake
   tensors with hooks. The units, and every other module called exactly once outside the
   units that is not an ancestor of one (embeddings, final norm, head, a whole encoder beside
   a decoder's layers), are kept as the user's modules; everything else is inlined.
2. **torch.export** (non-strict) with those modules' call signatures preserved, then
   `torch.export.unflatten`; the glue between them is flattened into one fx graph (`_flat`)
   whose `call_module` nodes call the *original* modules, so parameter names, module classes
   and the other dimensions' wrappers (TP, CP, EP, recompute, FSDP per unit) are unchanged.
3. **Stage assignment** (`_homes`): a unit call runs on its chunk-stage; other nodes run as
   early as their inputs allow (ASAP), and everything downstream of the last unit runs on the
   last chunk (the epilogue). Values that depend on neither inputs nor parameters (position
   aranges, rotary tables sliced from buffers, pytree plumbing) are recomputed on every stage
   that uses them; a parameter read by the glue lives on the first stage that reads it.
4. **One stage after another** (`_stage_graphs`): torch's schedules send activations only
   between neighbouring stages, so a tensor made on stage i and read on stage j > i + 1 (an
   encoder's output read by every decoder layer, a residual skipping a stage) is passed
   through the stages between, as an extra output and input of each. torch's own tracer
   frontend (`pipeline()`) sends it directly and then fails in backward ("Backward of skip
   connections not supported yet", docs/torch_notes.md). Non-tensor values never cross a stage.
5. **Side effects stay**: in-place writes (BART's shifted decoder inputs) and calls whose
   result nobody reads run on their stage; what an in-place write touches is not recomputed.

Stage modules are fx `GraphModule`s holding the original modules and parameters under their
original names. Stage 0 takes the model's one input (the runner's micro-batch); every other
stage takes what the previous one sends, in order; the last returns the tensors of the
model's output, which `model_output` turns back into what the model returns (a tensor, a
tuple, a HuggingFace ModelOutput), so the loss sees the unsplit model's kind of output.

The export runs once per model and plan on each rank (cached) with a zero input of the
micro-batch's shape and dtype, recorded in the plan (`ModelRef.input`). It specialises
shapes: every micro-batch has that shape, as the runner guarantees.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from meshplan.ir.trace import quiet_fake_tensor_log
from torch import fx, nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from .errors import RuntimePlanError


@dataclass(frozen=True)
class GraphCut:
    """A model cut into chunk-stages: `stages[c]` runs chunk-stage c; `model_output` turns
    the last stage's tensors back into the model's kind of output."""

    stages: tuple[fx.GraphModule, ...]
    model_output: Callable[[object], object]


_CACHE: weakref.WeakKeyDictionary[nn.Module, dict[tuple, GraphCut]] = weakref.WeakKeyDictionary()


def graph_cut(
    model: nn.Module,
    example: torch.Tensor,
    unit_chunk: dict[str, int],
    num_chunks: int,
    epilogue_chunk: int | None = None,
) -> GraphCut:
    """Cut `model` into `num_chunks` chunk-stages: unit `u` (a module path) runs on chunk
    `unit_chunk[u]`, whatever follows the last unit on `epilogue_chunk` (default: the last).

    `example`: one micro-batch input (only its shape, dtype and device are used). Cached per
    model, so a rank cutting for several chunks (and for `tied_across_stages`) exports once.
    Raises RuntimePlanError with torch.export's reason when the model cannot be exported,
    and when its units do not follow one another (a unit reading what a later one makes)."""
    epi = num_chunks - 1 if epilogue_chunk is None else epilogue_chunk
    key = (tuple(sorted(unit_chunk.items())), num_chunks, epi, tuple(example.shape), example.dtype)
    per_model = _CACHE.setdefault(model, {})
    if key not in per_model:
        # torch logs a traceback when an op fails on fake tensors; the failure itself becomes
        # the one-line RuntimePlanError `_cut` raises
        with quiet_fake_tensor_log():
            per_model[key] = _cut(model, example, unit_chunk, num_chunks, epi)
    return per_model[key]


# -- 1-2: the model's glue as one fx graph over its own modules -----------------------------


def training_kwargs(model: nn.Module) -> dict:
    """Keyword arguments the export passes besides the input: `use_cache=False` for models
    that take it (HuggingFace LMs build a key/value cache object by default, which is no
    tensor and cannot pass between stages; training never reads it)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    return {"use_cache": False} if "use_cache" in params else {}


def _fake_mode() -> FakeTensorMode:
    """Fake tensors over the real parameters, with unbacked sizes for data-dependent ops (an
    MoE's `torch.where` per expert), as torch.export has."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())


def _run_fake(run: Callable[[FakeTensorMode], object]) -> None:
    """`run(mode)` under static fake tensors (no symbolic shapes: several times faster, 2.7 ->
    0.6 s for a 48-layer model's forward), and again under `_fake_mode` when an op's output
    size depends on values (the static mode cannot size it). `run` must start its records
    afresh each time it is called; what the two modes record is the same where both run
    (module calls, which graph nodes hold tensors), since the sizes only differ in being
    symbolic."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, torch.no_grad():
            run(mode)
            return
    except (DynamicOutputShapeException, DataDependentOutputException):
        pass
    with _fake_mode() as mode, torch.no_grad():
        run(mode)


def _top_calls(model: nn.Module, example: torch.Tensor, units: Sequence[str]) -> list[str]:
    """Module paths to keep as calls (step 1 of the module docstring), units first."""
    names = {m: n for n, m in model.named_modules()}
    calls: list[tuple[str, str]] = []  # (path, the path of the module calling it)
    stack: list[str] = []

    def pre(mod, _args):
        calls.append((names[mod], stack[-1] if stack else ""))
        stack.append(names[mod])

    def post(_mod, _args, _out):
        stack.pop()

    hooks = []
    for n, m in model.named_modules():
        if n:
            hooks += [m.register_forward_pre_hook(pre), m.register_forward_hook(post)]

    def run(mode: FakeTensorMode) -> None:
        calls.clear()
        stack.clear()
        model(mode.from_tensor(example), **training_kwargs(model))

    try:
        _run_fake(run)
    finally:
        for h in hooks:
            h.remove()
    count: dict[str, int] = {}
    for path, _ in calls:
        count[path] = count.get(path, 0) + 1
    for u in units:
        if count.get(u, 0) != 1:
            raise RuntimePlanError(
                f"runtime: unit {u!r} runs {count.get(u, 0)} times in one forward; a pipeline "
                "cut needs each repeated layer called exactly once"
            )

    def within(p: str, q: str) -> bool:
        return p == q or p.startswith(q + ".")

    keep = list(units)
    for path, parent in calls:
        if path in keep or count[path] != 1:
            continue
        if any(within(path, u) or within(u, path) for u in units):
            continue
        if parent == "" or any(within(u, parent) for u in units):  # called from the glue
            keep.append(path)
    return keep


def _flat(model: nn.Module, unflat: nn.Module, kept: set[str]) -> tuple[fx.Graph, dict]:
    """The unflattened program's root graph with every module not in `kept` inlined; its
    `get_attr` targets renamed to the model's own parameter and buffer names (constants and
    pytree specs get fresh names). Returns the graph and the objects its targets name."""
    graph = fx.Graph()
    objects: dict[str, object] = {}
    own: dict[str, object] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    name_of = {id(t): n for n, t in own.items()}

    def lookup(prefix: str, target: str) -> object:
        for base in ([prefix[:-1]] if prefix else []) + [""]:
            obj: object = unflat.get_submodule(base) if base else unflat
            try:
                for part in target.split("."):
                    obj = getattr(obj, part)
                return obj
            except AttributeError:
                continue
        raise RuntimePlanError(f"runtime: exported graph names {prefix}{target}, not found")

    def copy(sub: fx.Graph, prefix: str, args: Sequence[object]) -> object:
        env: dict[fx.Node, object] = {}
        placeholders = [n for n in sub.nodes if n.op == "placeholder"]
        env.update(zip(placeholders, args))
        result = None
        for n in sub.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = fx.node.map_arg(n.args[0], env.__getitem__)
                continue
            a = fx.node.map_arg(n.args, env.__getitem__)
            kw = fx.node.map_arg(n.kwargs, env.__getitem__)
            target = n.target
            if n.op == "call_module":
                target = prefix + n.target
                if target not in kept:  # inline it
                    env[n] = copy(unflat.get_submodule(target).graph, target + ".", a)
                    continue
                objects[target] = model.get_submodule(target)  # the user's own module
            elif n.op == "get_attr":
                full = prefix + n.target
                obj = own[full] if full in own else lookup(prefix, n.target)
                target = full if full in own else name_of.get(id(obj), f"_cut_const_{len(objects)}")
                objects[target] = obj
            new = graph.create_node(n.op, target, a, kw)
            new.meta = dict(n.meta)
            env[n] = new
        return result

    # The model's input is the graph's one placeholder; the export's keyword arguments
    # (`training_kwargs`) are constants of the graph.
    consts = training_kwargs(model)
    inputs: list[object] = []
    for n in (n for n in unflat.graph.nodes if n.op == "placeholder"):
        if not inputs:
            inputs.append(graph.placeholder(n.target))
        elif n.target in consts:
            inputs.append(consts[n.target])
        else:
            raise RuntimePlanError(
                f"runtime: {type(model).__name__}'s exported graph takes {n.target!r} besides "
                "its input; the runner passes one input tensor"
            )
    graph.output(copy(unflat.graph, "", inputs))
    return graph, objects


def _tensor_nodes(graph: fx.Graph, objects: dict, example: torch.Tensor) -> set[fx.Node]:
    """Nodes whose value is a tensor, from one run of the graph on fake tensors."""
    gm = fx.GraphModule(objects, graph)
    tensors: set[str] = set()

    class Record(fx.Interpreter):
        def run_node(self, n):
            v = super().run_node(n)
            if isinstance(v, torch.Tensor):
                tensors.add(n.name)
            return v

    def run(mode: FakeTensorMode) -> None:
        tensors.clear()
        Record(gm).run(mode.from_tensor(example))

    _run_fake(run)
    return {n for n in graph.nodes if n.name in tensors}


# -- 3-5: stages ------------------------------------------------------------------------------


def _mutates(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def _cut(
    model: nn.Module, example: torch.Tensor, unit_chunk: dict[str, int], n: int, epi: int
) -> GraphCut:
    units = list(unit_chunk)
    try:
        kept = _top_calls(model, example, units)
        with warnings.catch_warnings():  # unflatten's notes on the specs it stores
            warnings.simplefilter("ignore")
            program = torch.export.export(
                model,
                (example,),
                training_kwargs(model),
                strict=False,
                preserve_module_call_signature=tuple(kept),
            )
            unflat = torch.export.unflatten(program)
    except RuntimePlanError:
        raise
    except Exception as e:  # torch.export's own reasons (data-dependent control flow, ...)
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise RuntimePlanError(
            f"runtime: cannot cut {type(model).__name__} into pipeline stages: torch.export "
            f"failed ({type(e).__name__}: {first[:200]}); define `pipeline_stage(first_unit, "
            "last_unit, units)` on the model, or plan without pp"
        ) from None
    graph, objects = _flat(model, unflat, set(kept))
    tensors = _tensor_nodes(graph, objects, example)
    home, free = _homes(graph, objects, unit_chunk, model, epi)
    stages = _stage_graphs(graph, objects, home, free, tensors, n)
    out_spec = program.call_spec.out_spec
    leaves = pytree.tree_leaves(next(iter(reversed(graph.nodes))).args[0])
    return GraphCut(stages, _rebuild(leaves, out_spec))


def _homes(graph: fx.Graph, objects: dict, unit_chunk: dict[str, int], model: nn.Module, epi: int):
    """Chunk-stage of every node (step 3), and the set of nodes recomputed where used."""
    params = {id(p) for p in model.parameters()}
    home: dict[fx.Node, int] = {}
    free: set[fx.Node] = set()
    nodes = [n for n in graph.nodes if n.op != "output"]
    last_unit = list(unit_chunk)[-1]  # the plan's units are in model order
    after_last: set[fx.Node] = set()  # the epilogue: everything the last unit's output feeds
    for node in nodes:
        ins = node.all_input_nodes
        if node.op == "get_attr" and id(objects[node.target]) in params:
            continue  # placed with its first reader below
        if node.op == "placeholder":
            home[node] = 0
            continue
        if node.op == "call_module" and node.target in unit_chunk:
            home[node] = unit_chunk[node.target]
            late = [a for a in ins if home.get(a, 0) > home[node]]
            if late:
                raise RuntimePlanError(
                    f"runtime: unit {node.target!r} reads a value made on chunk-stage "
                    f"{home[late[0]]}, after its own ({home[node]}); the plan's units must "
                    "follow the order the model calls them in"
                )
            if node.target == last_unit:
                after_last.add(node)
            continue
        if node.op != "call_module" and all(a in free for a in ins):
            free.add(node)  # no input, no parameter: recomputed wherever it is read
            continue
        home[node] = max((home[a] for a in ins if a in home), default=0)
        if any(a in after_last for a in ins):
            after_last.add(node)
            home[node] = max(home[node], epi)
    for node in nodes:  # an in-place write's target (and what it views) is made once
        if _mutates(node):
            todo = list(node.all_input_nodes)
            while todo:
                a = todo.pop()
                if a in free:
                    free.discard(a)
                    home[a] = 0
                    todo.extend(a.all_input_nodes)
    for node in nodes:  # parameters read by the glue: on the first stage that reads them
        if node not in home and node not in free:
            home[node] = min((home[u] for u in node.users if u in home), default=0)
    return home, free


def _stage_graphs(graph, objects, home, free, tensors, n) -> tuple[fx.GraphModule, ...]:
    """One GraphModule per chunk-stage (step 4): the nodes it runs, its inputs (stage 0: the
    model's input; others: what the previous stage sends) and outputs."""
    nodes = list(graph.nodes)
    order = {node: i for i, node in enumerate(nodes)}
    runs: list[set[fx.Node]] = [set() for _ in range(n)]
    wanted_until: dict[fx.Node, int] = {}  # tensor -> last stage that reads it

    def need(v: fx.Node, s: int) -> None:
        """Make value `v` available on stage `s`."""
        movable = v in free or (v not in tensors and v.op != "call_module" and home[v] < s)
        if movable or home[v] == s:  # computed here (recomputed when movable)
            if v not in runs[s]:
                runs[s].add(v)
                for a in v.all_input_nodes:
                    need(a, s)
            return
        if home[v] > s:
            raise RuntimePlanError(
                f"runtime: {v.name} is read on chunk-stage {s} before it is made"
            )
        if v not in tensors:
            raise RuntimePlanError(
                f"runtime: {v.name} ({v.op} {v.target}) would pass between pipeline stages but "
                "is not a tensor; only tensors travel between stages"
            )
        wanted_until[v] = max(wanted_until.get(v, 0), s)
        need(v, home[v])

    output = nodes[-1]
    for node in nodes:
        if node.op == "call_module" and node in home:
            need(node, home[node])
        elif node.op == "call_function" and node not in free and (_mutates(node) or not node.users):
            need(node, home[node])  # side effects run on their stage
    leaves = [v for v in pytree.tree_leaves(output.args[0]) if isinstance(v, fx.Node)]
    for v in leaves:
        need(v, n - 1)

    out: list[fx.GraphModule] = []
    sent: list[fx.Node] = []
    for s in range(n):
        g = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        if s == 0:
            for node in nodes:
                if node.op == "placeholder":
                    env[node] = g.placeholder(node.target)
        else:
            for v in sent:
                env[v] = g.placeholder(v.name)
        for node in sorted(runs[s] - set(env), key=order.__getitem__):
            if node.op != "placeholder":
                env[node] = g.node_copy(node, env.__getitem__)
        if s < n - 1:
            sent = sorted(
                (v for v, until in wanted_until.items() if home[v] <= s < until),
                key=order.__getitem__,
            )
            # torch's p2p sends need contiguous buffers (slices and transposes are views)
            g.output(tuple(g.call_method("contiguous", (env[v],)) for v in sent))
        else:
            g.output(env[leaves[0]] if len(leaves) == 1 else tuple(env[v] for v in leaves))
        g.lint()
        held = {x.target: objects[x.target] for x in g.nodes if x.op in ("call_module", "get_attr")}
        out.append(fx.GraphModule(held, g))
    return tuple(out)


def _rebuild(leaves: list, out_spec) -> Callable[[object], object]:
    """The model's output from the last stage's tensors (constant leaves put back)."""
    where = [i for i, v in enumerate(leaves) if isinstance(v, fx.Node)]

    def model_output(last: object) -> object:
        got = list(last) if isinstance(last, tuple) and len(where) != 1 else [last]
        values = list(leaves)
        for i, t in zip(where, got):
            values[i] = t
        return pytree.tree_unflatten(values, out_spec) if out_spec is not None else values[0]

    return model_output


def on_device(stage: fx.GraphModule, device: torch.device | None) -> fx.GraphModule:
    """`stage` with the tensors its glue creates (aranges, masks) made on `device`: the export
    ran where the model was built, which for a model built on CPU is not where it runs."""
    if device is None:
        return stage
    changed = False
    for node in stage.graph.nodes:
        d = node.kwargs.get("device")
        if isinstance(d, torch.device) and d != torch.device(device):
            node.update_kwarg("device", torch.device(device))
            changed = True
    if changed:
        stage.recompile()
    return stage
