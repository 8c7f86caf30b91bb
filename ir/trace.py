"""`trace`: one training step of a PyTorch model -> meshplan's IR `Graph`, without real memory.

How it works (the capture half; `lower.py` is the IR half):

1. Parameters, buffers and example inputs are replaced by *fake* CPU tensors (FakeTensorMode:
   shapes and dtypes, no data), so a 405B model on `torch.device("meta")` traces in a few
   hundred MB. CPU rather than meta, so that SDPA dispatches to the fused CPU flash-attention
   op instead of decomposing into bmm/softmax.
2. The model runs its forward with the fake parameters swapped in (the context manager behind
   `torch.func.functional_call`, held through the backward so that checkpointed regions
   recompute with them); a scalar loss is taken from the output (the output itself, `.loss`,
   or `.sum()` of the first output) and `torch.autograd.grad` runs the backward with respect
   to the parameters.
3. A `TorchDispatchMode` (`_Recorder`) sees every aten op of forward and backward:
   - forward ops are recorded with shapes, FLOPs, bytes and the module they ran in (a stack kept
     by global module pre/post forward hooks);
   - autograd numbers the backward node of each op just before dispatching it, so the sequence
     numbers taken since the previous op name the op's node (the tensors a dispatch mode sees
     are not the ones autograd attaches `grad_fn` to, so `out.grad_fn` cannot be used);
     during backward `torch._C._current_autograd_node()._sequence_nr()` names the forward op
     whose backward is running and every backward FLOP and byte is charged to it (ops of
     nodes with no owner, e.g. AccumulateGrad, go to the op whose backward ran last);
   - after the forward, the autograd graph is walked from the loss and each node's saved
     tensors (`grad_fn._saved_*`) are read: bytes kept for backward per op, deduplicated by
     storage within each layer, parameters and buffers excluded, each storage charged to the
     first op (in forward order) of the layer that saves it.
4. Metadata-only ops (views, `t`, `detach`, `prim.device`, ...) are folded into the first real
   op that consumes their result (else the op that produced their input), costs included.

Data-dependent shapes. Fake tensors have no values, so an op whose output size depends on them
(`nonzero`, `torch.where(cond)`, boolean-mask indexing `x[mask]`, `masked_select`, `unique`,
`bincount`) cannot be run. Inside an MoE's expert dispatch (`_ExpertDispatch`: a module
holding `experts`, an MoE class or an experts module, anywhere on the module stack) such an
op gets the size of its balanced expectation instead: a selection over one expert's share of
the routing keeps tokens x top_k / experts rows (rounded up), with tokens, top_k and experts
read off the router's `topk` (its input's rows and width, its k), else off the modules'
attributes (`top_k`, `num_experts`, `len(experts)`, ...; top-1 when no k is found). The
assumption is written into `ModelInfo.assumptions` (plans print it among their notes).
Everywhere else, and for data-dependent *values* (`.item()`, `if mask.any():`), tracing
stops with a one-line `TraceError` naming the op and the module.

Activation checkpointing inside the model (non-reentrant: `use_reentrant=False`, HF's
`gradient_checkpointing_enable` with it) is traced as it runs (its recomputation lands in the
backward costs), but ops under someone else's saved-tensor hooks report no saved bytes: trace
models without checkpointing and let the planner decide recomputation. Reentrant
checkpointing cannot run under `torch.autograd.grad` and is refused in one line.

Repeated layers are traced once per distinct call. A layer called the same way as an earlier
one (`_Capture._call_key`: the same module classes, attributes, parameter and buffer metadata,
the class attributes and module globals its code could read (plain values, and the sizes of
caches: dicts, lists, sets), the same argument structure, plain values and tensor metadata,
the same gradient mode, autocast and saved-tensor hooks) gets a copy of that layer's recorded
forward ops, renamed to its own modules and parameters and reading its own arguments
(`forward_or_copy`; an MoE layer's routing, priced at its balanced load, is copied with it).
A layer is only copied from if its own forward changed none of that state, read only
activations it was handed, changed no argument in place and returned tensors it made;
anything else (an attribute holding the layer index, an object argument such as a cache)
makes every such layer run its own forward. What the key cannot see is assumed not to
matter: a forward that reads a closure or a global of another module that changes between
layers would be copied wrongly (`DEDUPE_FORWARD = False` traces every forward).

The backward of a layer whose forward is identical to an earlier layer's (same ops,
shapes, attributes, costs and data flow inside it, parameters named alike relative to the
layer, the same gradient mode) is not run again: autograd's backward is a function of the
forward graph, so the earlier layer's backward costs and saved bytes are copied
(`_Capture.skip_backward`). Its output reaches the loss through a stand-in autograd node
that hands zero gradients (fake, so free) to the layer's inputs, and the layer's own nodes
are never reached. A layer that reads an activation it was not handed keeps its own
backward; anything else the stand-in cannot vouch for (a layer called twice, an input whose
gradient other readers sum, a backward that still reaches the layer some other way) makes
the tracer run the step again without copies (`DEDUPE_BACKWARD`);
`tests/ir/test_trace_dedupe.py` checks the graphs are equal op for op, on models written to
defeat both copies among others. Llama 3 70B traces in 0.6 s instead of 4.4 s on a 2-core
CPU (benchmarks/trace_speed.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import functools
import importlib.util
import logging
import sys
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .facts import (
    _HF_DECODER_PARTS,
    Dataflow,
    dataflow_blockers,
    is_hf_decoder,
    structural_blockers,
)
from .flops import ATTENTION_TARGETS, is_metadata_op, iter_tensors, op_bytes, op_flops, packet_name
from .graph import DTYPE_BYTES, Graph, OpKind, Param, TensorMeta
from .lower import (
    LOSS_MODULE,
    OpRecord,
    Source,
    TraceRecord,
    _is_experts_module,
    _is_moe_module,
    lower,
)

__all__ = [
    "TraceError",
    "find_layer_container",
    "hf_decoder_body",
    "hf_models",
    "is_hf_decoder",
    "is_transformers_model",
    "sequence_sharding_blocker",
    "sliding_window",
    "trace",
]


class TraceError(ValueError):
    """A model could not be traced; the message (one line) names the module/op and the fix."""


ProgressArg = Callable[[str], None] | bool | None

# Phases of one traced step.
_FORWARD, _LOSS, _BACKWARD = "forward", "loss", "backward"

# Copy the backward of a layer identical to an earlier one instead of running it (module
# docstring). False traces every backward (the tests compare both).
DEDUPE_BACKWARD = True
# Copy the forward of a layer called like an earlier one too (needs DEDUPE_BACKWARD).
DEDUPE_FORWARD = True


class _Retrace(Exception):
    """The backward of a skipped layer was needed after all: trace again without skipping."""


# -- public API -----------------------------------------------------------------------------
def trace(
    model: nn.Module,
    *example_inputs: object,
    kwargs: dict[str, object] | None = None,
    name: str | None = None,
    progress: ProgressArg = None,
    param_shapes: dict[str, tuple[int, ...]] | None = None,
    flow_out: list[Dataflow] | None = None,
) -> Graph:
    """Trace one training step (forward + backward) of `model` into a `meshplan.ir.Graph`.

    `model` may live on meta (built under `torch.device("meta")`) or be a real model;
    `example_inputs` (and `kwargs`, passed by keyword to `forward`) may be real, fake or meta
    tensors: only their shapes and dtypes are used, and no parameter or activation memory is
    ever allocated. The loss is the model's output if it is a scalar, else its `.loss`, else
    the `.sum()` of its first tensor output.

    Costs follow FlopCounterMode's convention (matmul-class and attention FLOPs only; see
    `meshplan.ir.flops`) for one micro-batch of the example inputs' shape. The repeated layer
    container is found structurally (`find_layer_container`); its children become units and
    identical layers share one block.

    `progress` is a callback taking one-line messages, or True for a rich progress bar.
    `param_shapes` gives some parameters another shape for this trace (their shards on one
    tensor-parallel rank: `meshplan.rehearse`); `flow_out`, a list, gets the trace's data-flow
    facts (`ir.facts.Dataflow`, the rehearsal compares them).
    Raises `TraceError` for data-dependent control flow, ops fake tensors cannot run, and
    models with no differentiable output. Data-dependent output shapes are refused too,
    except in an MoE's expert dispatch, which is sized at its balanced load and noted in
    `ModelInfo.assumptions` (module docstring).
    """
    report = _Progress(progress)
    args = (model, example_inputs, dict(kwargs or {}), name, report, param_shapes or {}, flow_out)

    def run() -> Graph:
        try:
            return _trace(*args, dedupe=DEDUPE_BACKWARD)
        except _Retrace:
            return _trace(*args, dedupe=False)

    try:
        try:
            with without_compiler() as stand_in:
                graph = run()
            if stand_in is not None and stand_in.needed:  # asked for more, and it was caught
                raise _NeedsCompiler("torch._dynamo")
        except _NeedsCompiler:  # the model needs more of the compiler: trace with it loaded
            importlib.import_module("torch._dynamo")
            graph = run()
    finally:
        report.close()
    return graph


def find_layer_container(model: nn.Module) -> tuple[str | None, tuple[str, ...]]:
    """The repeated layer container of a model and the full paths of its children.

    Candidates are `nn.ModuleList` / `nn.Sequential` modules anywhere in the tree with at least
    two children of one class of which at least two have an identical structure (class names
    and parameter shapes, recursively); the one holding the most parameters wins. Containers
    named `experts` are skipped, so a 1-layer MoE model does not turn its experts into layers.
    Children may still differ (dense and MoE layers of one class): they become distinct block
    templates. Returns `(None, ())` when there is no such container; the whole model is then
    one `<prologue>` unit.
    """
    best: tuple[int, str, tuple[str, ...]] | None = None
    for path, mod in model.named_modules():
        if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) < 2:
            continue
        if path.rsplit(".", 1)[-1] in ("experts", "expert"):
            continue
        children = list(mod.named_children())
        if len({type(c).__name__ for _, c in children}) != 1:
            continue
        structures = [_structure(c) for _, c in children]
        if len(set(structures)) == len(structures):
            continue  # no two children alike: not a stack of repeated layers
        n_params = sum(p.numel() for p in mod.parameters())
        names = tuple(f"{path}.{n}" if path else n for n, _ in children)
        if best is None or n_params > best[0]:
            best = (n_params, path, names)
    if best is None:
        return None, ()
    return best[1], best[2]


def is_transformers_model(model: nn.Module) -> bool:
    """Whether `model`'s class is (or derives from) a HuggingFace transformers class."""
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def hf_models(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost HuggingFace models in `model`'s tree, the root included (modules of a
    transformers class that hold a `config`), with their paths: the user's model itself, or
    the HF models a user's module wraps."""
    found: list[tuple[str, nn.Module]] = []
    for path, m in model.named_modules():
        inside = any(p == "" or path.startswith(p + ".") for p, _ in found)
        if not inside and hasattr(m, "config") and is_transformers_model(m):
            found.append((path, m))
    return found


def hf_decoder_body(model: nn.Module) -> nn.Module | None:
    """The module of a HuggingFace model that embeds, runs the layers and computes the rotary
    tables (`embed_tokens`, `layers`, `norm`, `rotary_emb`): the model itself (`LlamaModel`)
    or its `model` (`LlamaForCausalLM`); None for other shapes."""
    for body in (model, getattr(model, "model", None)):
        if isinstance(body, nn.Module) and all(hasattr(body, a) for a in _HF_DECODER_PARTS):
            return body
    return None


def sliding_window(config: object) -> int:
    """The sliding-window length of a HuggingFace config, 0 when attention is not windowed:
    HF writes "no window" as `sliding_window` None or 0, and Qwen2-style configs keep a size
    but switch it off with `use_sliding_window=False`."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False:
        return 0
    return window if isinstance(window, int) and window > 0 else 0


def sequence_sharding_blocker(model: nn.Module, seq_len: int = 0) -> str:
    """Why `model` cannot run on a share of each sequence (sequence parallelism shards the
    hidden state over tp, context parallelism the tokens over cp), or "" when it can.

    Only HuggingFace models are judged, the user's model itself or those it wraps
    (`hf_models`). They count token positions (rotary tables, the causal mask) from the
    length of the hidden state they hold, which SP and CP shard; the runtime gives one shape
    the positions of the whole sequence (`runtime.context_parallel.reposition_hf_decoder`):
    the Llama family's decoder (`hf_decoder_body`: LlamaForCausalLM, LlamaModel, Mistral,
    Qwen2, ...) whose layers' `self_attn` have `q_proj`/`k_proj`/`v_proj`, built with SDPA
    attention (the mask is then left to SDPA's `is_causal`, and CP redirects SDPA), and with
    no sliding window shorter than `seq_len` tokens (0: unknown, not checked). Models outside
    transformers are taken to follow the runtime's contract (positions from the tokens,
    docs/runtime.md).
    """
    for path, hf in hf_models(model):
        name = type(hf).__name__ + (f" (at {path!r})" if path else "")
        body = hf_decoder_body(hf)
        if body is None:
            return (
                f"{name} is a HuggingFace model outside the Llama decoder shape (embed_tokens, "
                "layers, norm, rotary_emb): it counts positions from its sequence-sharded "
                "hidden state"
            )
        for i, layer in enumerate(body.layers):
            attn = getattr(layer, "self_attn", None)
            if not all(hasattr(attn, a) for a in ("q_proj", "k_proj", "v_proj")):
                return f"{name} layer {i} has no self_attn with q_proj/k_proj/v_proj"
        impl = getattr(hf.config, "_attn_implementation", None)
        if impl != "sdpa":
            return (
                f"{name} uses attention implementation {impl!r}; sharded sequences need "
                "attn_implementation='sdpa'"
            )
        window = sliding_window(hf.config)
        if window and seq_len > window:
            return f"{name} attends through a sliding window of {window} < {seq_len} tokens"
    return ""


def _structure(module: nn.Module) -> tuple:
    mods = tuple((n, type(m).__name__) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters())
    return mods, params


# Values compared as themselves in a layer's call key and module state (`_plain`).
_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _plain(v: object, depth: int = 0) -> object:
    """A hashable stand-in for `v` that is equal when a layer's forward could not tell the
    two apart: plain values themselves, tensors by metadata, containers element by element,
    other objects by identity and (near the top) their attributes, functions and modules by
    identity."""
    if isinstance(v, _PLAIN):
        return type(v).__name__, v
    if isinstance(v, torch.Tensor):
        return "tensor", tuple(v.shape), tuple(v.stride()), v.dtype, v.requires_grad
    if depth < 4 and isinstance(v, (tuple, list)):
        return type(v).__name__, tuple(_plain(x, depth + 1) for x in v)
    if depth < 4 and isinstance(v, (set, frozenset)):
        return type(v).__name__, tuple(sorted((_plain(x, depth + 1) for x in v), key=repr))
    if depth < 4 and isinstance(v, dict):
        return "dict", tuple((_plain(k, depth + 1), _plain(x, depth + 1)) for k, x in v.items())
    if depth < 2 and not callable(v) and not isinstance(v, nn.Module) and hasattr(v, "__dict__"):
        # an object a forward may read and change (a config, a cache holder): its own
        # attributes too, one level down
        return "object", id(v), tuple((k, _plain(x, 3)) for k, x in vars(v).items())
    return "object", id(v)


def _module_state(layer: nn.Module) -> tuple:
    """Everything of `layer`'s modules a forward could read besides its arguments: per
    module its class, every attribute (`_plain`; the tracer's own `forward` on the layer
    and state-dict hooks left out), parameters and buffers by metadata; and the class
    attributes and module globals of their classes (`_shared_state`: a counter a forward
    bumps, a cache it fills show here)."""
    mods = []
    classes: dict[type, None] = {}
    for name, m in layer.named_modules():
        classes.setdefault(type(m))
        attrs = tuple(
            (k, _plain(v))
            for k, v in vars(m).items()
            if k not in ("_parameters", "_buffers", "_modules")
            and "state_dict" not in k
            and not (k == "forward" and name == "")
        )
        tensors = tuple(
            (kind, k, None if t is None else _plain(t))
            for kind, held in (("p", m._parameters), ("b", m._buffers))
            for k, t in held.items()
        )
        mods.append((name, type(m), attrs, tensors))
    shared = []
    for cls in classes:
        for klass in cls.__mro__:
            if klass.__module__.startswith("torch."):
                continue
            module = sys.modules.get(klass.__module__)
            glob = vars(module) if module is not None else {}
            shared.append((klass, _shared_state(vars(klass)), _shared_state(glob)))
    return tuple(mods), tuple(shared)


def _shared_state(names: dict) -> tuple:
    """The plain values of a class's or module's namespace, and the sizes of its dicts, lists
    and sets (a cache that a first call fills, e.g. masks by length)."""
    out = []
    for k, v in names.items():
        if k.startswith("__"):
            continue
        if isinstance(v, _PLAIN):
            out.append((k, v))
        elif isinstance(v, (dict, list, set)):
            out.append((k, type(v).__name__, len(v)))
    return tuple(out)


# -- progress -------------------------------------------------------------------------------
class _Progress:
    """Progress reporting: a user callback, a rich progress bar (`True`), or nothing."""

    def __init__(self, progress: ProgressArg) -> None:
        self._callback: Callable[[str], None] | None = None
        self._bar = None
        self._task = None
        if callable(progress):
            self._callback = progress
        elif progress is True:
            from rich.progress import Progress

            self._bar = Progress(transient=True)
            self._bar.start()

    def set_total(self, total: int) -> None:
        if self._bar is not None:
            self._task = self._bar.add_task("tracing", total=max(total, 1))

    def __call__(self, message: str, advance: int = 0) -> None:
        if self._callback is not None:
            self._callback(message)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=message, advance=advance)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


# -- capture --------------------------------------------------------------------------------
@dataclass(slots=True)
class _TensorInfo:
    """What the tracer knows about a live forward tensor (views share their base's info)."""

    key: int
    producer: int | None  # forward position of the real op that made it; -1 graph input
    meta: TensorMeta
    param: str | None = None  # canonical parameter name, for parameters and their views
    is_state: bool = False  # parameter or buffer: not an activation


@dataclass(slots=True)
class _MetaOp:
    """A folded metadata-only forward op: where its (backward) costs and its name go."""

    fx_name: str
    producer: int | None  # real op that produced its input, if any
    fold: int | None = None  # real op it folds into
    packet: str = ""  # its overload packet (a copied layer names its copy from it)


@dataclass
class _Pending:
    """A layer running its own forward that may become a `_ForwardTemplate`."""

    key: tuple  # its call (`_call_key`)
    flow: tuple  # the data-flow facts before it (`Dataflow.mark`)
    dispatch: tuple  # the MoE dispatch state before it
    inputs: list[torch.Tensor]  # its tensor arguments, flattened
    infos: tuple[tuple[int, int | None] | None, ...]  # their (key, producer) when called


@dataclass
class _ForwardTemplate:
    """A layer's recorded forward, for the later layers called the same way to copy."""

    layer: int
    path: str
    start: int  # its forward positions: [start, end)
    end: int
    inputs: tuple[tuple[int, int | None] | None, ...]  # (key, producer) per tensor argument
    out_spec: object  # the pytree spec of its output
    out_leaves: tuple  # ("v", value) or ("t", key, producer, meta, shape, stride, dtype,
    #                    requires_grad, view chain, origin packet, data-flow tags)
    flow: tuple  # the data-flow facts it added (`Dataflow.since`)
    routed: tuple  # the MoE routings it found and priced (`_ExpertDispatch.since`)


class _Capture:
    """All capture state of one trace: forward records, autograd-node map, backward costs."""

    def __init__(
        self,
        layer_of_path: dict[str, int],
        n_layers: int,
        report: _Progress,
        dispatch: _ExpertDispatch | None = None,
        dedupe: bool = False,
    ) -> None:
        self.phase = _FORWARD
        self.layer_of_path = layer_of_path
        self.n_layers = n_layers
        self.report = report
        self.records: dict[int, OpRecord] = {}  # real forward ops by position
        self.meta_ops: dict[int, _MetaOp] = {}  # metadata forward ops by position
        self.n_fwd = 0
        self.info: dict[int, _TensorInfo] = {}  # id(tensor) -> info; tensors kept alive
        self.keep: list[torch.Tensor] = []  # so that ids stay unique during the trace
        self.view_chain: dict[int, tuple[int, ...]] = {}  # id(view) -> metadata ops behind it
        self.origin: dict[int, tuple[str, torch.Tensor | None]] = {}  # id(t) -> (packet, input)
        self.fx_counts: dict[str, int] = {}
        self.next_key = 0
        self.seq_owner: dict[int, int] = {}  # autograd node sequence number -> forward position
        self.next_seq = 0  # sequence numbers below this one have an owner
        self.foreign_saved: set[int] = set()  # ops run under someone else's saved-tensor hooks
        self.module_stack: list[str] = []
        self.layer_stack: list[int | None] = []
        self.last_owner: int | None = None
        self.bwd_layer: int | None = None
        self.error_op: str | None = None
        self.error_module: str | None = None
        self.meta_cache: dict[tuple[tuple[int, ...], torch.dtype], TensorMeta] = {}
        self.flow = Dataflow()  # what the runtime needs to know (`facts`)
        self.dispatch = dispatch or _ExpertDispatch({})  # MoE dispatch priced at balanced load
        # Backward of repeated identical layers (`skip_backward`)
        self.dedupe = dedupe
        self.suppress = False  # the stand-in's own ops: not part of the traced step
        self.layer_start: dict[int, int] = {}  # layer -> forward position it was entered at
        self.layer_end: dict[int, int] = {}  # layer -> forward position after its exit
        self.templates: dict[tuple, int] = {}  # forward signature -> first layer with it
        self.skipped: dict[int, int] = {}  # layer -> the earlier layer its backward copies
        self.grad_inputs: dict[int, tuple[int, ...]] = {}  # layer -> keys of inputs with grad
        self.frozen: set[str] = set()  # parameters without requires_grad
        # Forward of repeated identical layers (`forward_or_copy`)
        self.copy_forward = dedupe and DEDUPE_FORWARD
        self.make_fake: Callable[[TensorMeta, tuple[int, ...]], torch.Tensor] | None = None
        self.pending: dict[int, _Pending] = {}  # layer running for real -> what it started as
        self.fwd_templates: dict[tuple, _ForwardTemplate] = {}  # call key -> layer to copy
        self.fwd_copied: dict[int, int] = {}  # layer -> the earlier layer its forward copies

    # -- helpers ----------------------------------------------------------------------------
    def tensor_meta(self, t: torch.Tensor) -> TensorMeta:
        shape = tuple(int(d) for d in t.shape)
        cache_key = (shape, t.dtype)
        meta = self.meta_cache.get(cache_key)
        if meta is None:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in DTYPE_BYTES:
                raise TraceError(
                    f"dtype {dtype} (shape {list(shape)}) in module '{self.module_path()}' is "
                    "not in meshplan's DTYPE_BYTES table; add it to ir/graph.py"
                )
            meta = TensorMeta(shape=shape, dtype=dtype)
            self.meta_cache[cache_key] = meta
        return meta

    def param_of(self, t: torch.Tensor) -> str | None:
        info = self.info.get(id(t))
        return info.param if info is not None else None

    def is_state(self, t: torch.Tensor) -> bool:
        """A parameter, buffer or constant made outside the step (not an activation)."""
        info = self.info.get(id(t))
        return info is None or info.is_state

    def new_key(self) -> int:
        self.next_key += 1
        return self.next_key

    def module_path(self) -> str:
        if self.phase == _LOSS:
            return LOSS_MODULE
        return self.module_stack[-1] if self.module_stack else ""

    def register_leaf(
        self, t: torch.Tensor, producer: int | None, param: str | None, is_state: bool
    ) -> None:
        self.info[id(t)] = _TensorInfo(
            self.new_key(), producer, self.tensor_meta(t), param, is_state
        )
        self.keep.append(t)

    def fx_name(self, packet: str) -> str:
        short = packet.split(".", 1)[1] if "." in packet else packet
        n = self.fx_counts.get(short, 0)
        self.fx_counts[short] = n + 1
        return short if n == 0 else f"{short}_{n}"

    # -- module hooks -----------------------------------------------------------------------
    def enter_module(self, path: str) -> None:
        layer = self.layer_of_path.get(path)
        if layer is None and self.layer_stack:
            layer = self.layer_stack[-1]
        elif layer is not None:
            self.report(f"forward: layer {layer + 1}/{self.n_layers}", advance=1)
            if self.phase == _FORWARD:
                self.flow.on_unit(path)  # the order pipeline stages are cut in (`facts`)
                if layer in self.skipped:  # called again: its records would mix two calls
                    raise _Retrace(path)
                self.layer_start.setdefault(layer, self.n_fwd)
        self.module_stack.append(path)
        self.layer_stack.append(layer)

    def exit_module(self) -> None:
        if self.module_stack:
            self.module_stack.pop()
            self.layer_stack.pop()

    # -- forward ----------------------------------------------------------------------------
    def on_forward(
        self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object
    ) -> None:
        pos = self.n_fwd
        self.n_fwd += 1
        packet = packet_name(func)
        ins = [*iter_tensors(args), *iter_tensors(kwargs)]
        outs = list(iter_tensors(out))
        if not outs:
            return  # a query (prim.device, sym_size, ...): no tensor, no node, no cost
        if self.phase == _FORWARD:
            self.flow.on_op(
                packet, args, kwargs, out, tuple(self.module_stack), self.param_of, self.is_state
            )
            if packet in _ROUTING_OPS:
                self.dispatch.on_routing(func, args, kwargs, tuple(self.module_stack))
        first_in = ins[0] if ins else None
        for o in outs:
            self.origin[id(o)] = (packet, first_in)
            self.keep.append(o)
        # Autograd creates an op's backward node (taking the next sequence number) just before
        # it dispatches the op, so the nodes numbered since the last op with outputs are ours.
        seq = torch._C._autograd._get_sequence_nr()
        for s in range(self.next_seq, seq):
            self.seq_owner[s] = pos
        self.next_seq = max(self.next_seq, seq)
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            # Someone else (activation checkpointing, offloading) decides what is saved here;
            # reading its saved tensors would run its unpack hooks.
            self.foreign_saved.add(pos)

        if is_metadata_op(func):
            src = self.info.get(id(first_in)) if first_in is not None else None
            producer = src.producer if src is not None and src.producer is not None else None
            self.meta_ops[pos] = _MetaOp(
                self.fx_name(packet), producer if producer != -1 else None, packet=packet
            )
            chain = (
                (*self.view_chain.get(id(first_in), ()), pos) if first_in is not None else (pos,)
            )
            for o in outs:
                if src is not None:
                    self.info[id(o)] = src
                self.view_chain[id(o)] = chain
            return

        sources: list[Source] = []
        params: list[str] = []
        for t in ins:
            for m in self.view_chain.get(id(t), ()):
                meta_op = self.meta_ops[m]
                if meta_op.fold is None:
                    meta_op.fold = pos
            info = self.info.get(id(t))
            if info is None:
                continue  # a constant made outside the traced step: not an activation
            if info.param is not None:
                if info.param not in params:
                    params.append(info.param)
            elif not info.is_state:
                sources.append(
                    Source(info.producer if info.producer is not None else -1, info.key, info.meta)
                )
        out_keys: list[int] = []
        for o in outs:
            info = _TensorInfo(self.new_key(), pos, self.tensor_meta(o))
            self.info[id(o)] = info
            self.view_chain.pop(id(o), None)
            out_keys.append(info.key)
        layer = self.layer_stack[-1] if self.layer_stack and self.phase == _FORWARD else None
        record = OpRecord(
            pos=pos,
            target=str(func),
            packet=packet,
            fx_name=self.fx_name(packet),
            module=self.module_path(),
            module_stack=tuple(self.module_stack) if self.phase == _FORWARD else (),
            layer=layer,
            inputs=tuple(self.tensor_meta(t) for t in ins),
            outputs=tuple(self.tensor_meta(o) for o in outs),
            sources=tuple(sources),
            output_keys=tuple(out_keys),
            params=tuple(params),
            attrs=self.attrs(func, packet, args, kwargs),
            fwd_flops=op_flops(func, args, kwargs, out),
            fwd_bytes=op_bytes(args, kwargs, out),
        )
        self.records[pos] = record

    def attrs(
        self, func: torch._ops.OpOverload, packet: str, args: tuple, kwargs: dict
    ) -> dict[str, int | float | bool | str]:
        """Op-specific facts: attention geometry, top-k's k."""
        if packet in ATTENTION_TARGETS:
            bound = _bind(func, args, kwargs)
            q, k = bound.get("query"), bound.get("key")
            if not isinstance(q, torch.Tensor) or not isinstance(k, torch.Tensor) or q.dim() != 4:
                return {}
            heads, head_dim = int(q.shape[1]), int(q.shape[-1])
            return {
                "causal": bool(bound.get("is_causal", False)),
                "head_dim": head_dim,
                "heads": heads,
                "kv_heads": self.kv_heads(k, head_dim),
                "masked": bound.get("attn_mask", bound.get("attn_bias")) is not None,
            }
        if packet == "aten.topk":
            bound = _bind(func, args, kwargs)
            return {"k": int(bound.get("k", 0))}
        if packet == "aten.embedding" and len(args) > 1 and self.flow.is_position(args[1]):
            return {"positions": True}  # a table of learned positions, not a vocabulary
        return {}

    def kv_heads(self, key: torch.Tensor, head_dim: int) -> int:
        """KV heads of an attention's key, looking through a `repeat_kv` (expand + reshape)
        that widened grouped-query keys to the query's head count before SDPA."""
        heads = int(key.shape[1])
        for _, t in self.repeat_kv_origins(key):
            if t is None:
                break
            # (batch, heads, [n_rep,] seq, head_dim) layouts only: same seq and head_dim
            if t.dim() >= 4 and t.shape[-1] == head_dim and t.shape[-2] == key.shape[-2]:
                heads = min(heads, int(t.shape[1]))
        return heads

    def repeat_kv_origins(self, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor | None]]:
        """(packet, its input) of the ops `t` was made by, walking back while they are
        `_REPEAT_KV_OPS` (at most 8; an input the trace did not keep ends the walk)."""
        src: torch.Tensor | None = t
        for _ in range(8):
            origin = self.origin.get(id(src)) if src is not None else None
            if origin is None or origin[0] not in _REPEAT_KV_OPS:
                return
            yield origin
            src = origin[1]

    # -- repeated layers ----------------------------------------------------------------------
    def layer_records(self, layer: int) -> list[OpRecord]:
        """The forward records of `layer`'s call, in order (positions from its entry to its
        exit, once `skip_backward` has seen it exit; else to now)."""
        start = self.layer_start.get(layer, self.n_fwd)
        end = self.layer_end.get(layer, self.n_fwd)
        return [
            r
            for p in range(start, end)
            if (r := self.records.get(p)) is not None and r.layer == layer
        ]

    def _signature(
        self, layer: int, path: str, recs: list[OpRecord], grad: dict[int, bool]
    ) -> tuple[tuple, set[int]]:
        """What decides a layer's backward: its forward ops in order (target, module and
        parameters relative to the layer, which parameters are frozen, shapes, attributes,
        costs, whether someone else's saved-tensor hooks ran), the data flow between them
        and whether each input from outside needs a gradient (`grad`, by key: the first
        layer's often does not); and the keys of the activations it reads from outside."""

        def rel(name: str) -> str:
            return name[len(path) + 1 :] if name.startswith(path + ".") else name

        index = {r.pos: i for i, r in enumerate(recs)}
        external: set[int] = set()
        ops = []
        for r in recs:
            sources = []
            for src in r.sources:
                if src.producer in index:
                    sources.append(index[src.producer])
                else:
                    external.add(src.key)
                    sources.append(("in", src.meta, grad.get(src.key)))
            ops.append(
                (
                    r.target,
                    "" if r.module == path else rel(r.module),
                    r.inputs,
                    r.outputs,
                    tuple((rel(p), p in self.frozen) for p in r.params),
                    tuple(sorted(r.attrs.items())),
                    r.fwd_flops,
                    r.fwd_bytes,
                    tuple(sources),
                    r.pos in self.foreign_saved,
                )
            )
        # Under torch.no_grad the same ops record no backward (a frozen first layer).
        return (torch.is_grad_enabled(), tuple(ops)), external

    def after_layer(
        self, layer: int, path: str, module: nn.Module, args: object, kwargs: object, out: object
    ):
        """After a layer's forward: remember it for later layers to copy (`remember_forward`)
        and put its output behind the stand-in when its backward can be copied
        (`skip_backward`). A copied forward must be: its own ops are never run, so nothing
        else could give its inputs their gradients."""
        if not self.dedupe:
            return None
        self.layer_end[layer] = self.n_fwd
        self.remember_forward(layer, path, module, out)
        new = self.skip_backward(layer, path, args, kwargs, out)
        if new is None and layer in self.fwd_copied:
            flat, _ = tree_flatten(out)
            if any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
                raise _Retrace(f"{path}: a copied forward whose backward is not copied")
        return new

    def skip_backward(self, layer: int, path: str, args: object, kwargs: object, out: object):
        """After a layer's forward: when an earlier layer had the same forward (`_signature`),
        return its output behind a stand-in node (`_SkipBackward`) so that backward never
        reaches this layer's ops; `copy_skipped` fills in their backward costs afterwards.
        None (output unchanged) otherwise."""
        recs = self.layer_records(layer)
        if not recs:
            return None
        by_key: dict[int, torch.Tensor] = {}
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and (info := self.info.get(id(t))) is not None:
                by_key[info.key] = t
        grad = {k: t.requires_grad for k, t in by_key.items()}
        sig, external = self._signature(layer, path, recs, grad)
        if not external <= by_key.keys():
            return None  # reads an activation it was not handed: keep its backward
        grad_keys = tuple(k for k in sorted(external) if by_key[k].requires_grad)
        self.grad_inputs[layer] = grad_keys
        template = self.templates.setdefault(sig, layer)
        if template == layer:
            return None
        grad_inputs = [by_key[k] for k in grad_keys]
        flat, _ = tree_flatten(out)
        if not any(isinstance(t, torch.Tensor) and t.requires_grad for t in flat):
            return None

        def stand_in(t: object) -> object:
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                return t
            new = _SkipBackward.apply(self, t.detach(), *grad_inputs)
            # Later ops read it as this layer's output: same info, the views it was made by
            # (folded into its readers), its origin and its data-flow tags.
            if (info := self.info.get(id(t))) is not None:
                self.info[id(new)] = info
            if id(t) in self.view_chain:
                self.view_chain[id(new)] = self.view_chain[id(t)]
            if id(t) in self.origin:
                self.origin[id(new)] = self.origin[id(t)]
            self.flow.alias(t, new)
            self.keep.append(new)
            return new

        self.suppress = True
        try:
            out = tree_map(stand_in, out)
        finally:
            self.suppress = False
            # the stand-ins' autograd nodes belong to no traced op
            self.next_seq = max(self.next_seq, torch._C._autograd._get_sequence_nr())
        self.skipped[layer] = template
        return out

    def copy_skipped(self) -> None:
        """Backward costs and saved bytes of every skipped layer, copied from its template.
        A skipped layer that backward reached anyway (an output the stand-in did not cover)
        means the copy would be wrong: trace again without skipping. So does a skipped layer
        or its template whose gradients meet others' (an input with gradient that something
        else reads too, like an encoder output every decoder layer attends to): autograd sums
        such gradients inside whichever reader runs last, so that layer's backward is not
        every layer's. (Sums of a layer's output gradients happen in its readers' backward,
        which is traced.)"""
        if not self.skipped:
            return
        readers: dict[int, set[object]] = {}
        for r in self.records.values():
            for src in r.sources:
                readers.setdefault(src.key, set()).add(r.layer if r.layer is not None else r.pos)
        for layer in {*self.skipped, *self.skipped.values()}:
            if any(readers.get(k, set()) != {layer} for k in self.grad_inputs.get(layer, ())):
                raise _Retrace(f"layer {layer}: an input's gradient has several sources")
        for layer, template in self.skipped.items():
            recs, src = self.layer_records(layer), self.layer_records(template)
            if len(recs) != len(src) or any(
                r.bwd_flops or r.bwd_bytes or r.saved_bytes for r in recs
            ):
                raise _Retrace(f"layer {layer}")
            for r, t in zip(recs, src, strict=True):
                r.bwd_flops, r.bwd_bytes, r.saved_bytes = t.bwd_flops, t.bwd_bytes, t.saved_bytes
            self.report(f"backward: layer {layer + 1}/{self.n_layers} (as {template + 1})", 1)

    # -- repeated layers: forward -------------------------------------------------------------
    def forward_or_copy(
        self, layer: int, path: str, module: nn.Module, original: Callable, *args, **kwargs
    ) -> object:
        """The forward of repeated layer `layer` (installed as its `forward` while tracing):
        a copy of an earlier layer's recorded forward when that layer was called the same
        way (`_call_key`: same modules, attributes, parameter and argument metadata), else
        the layer's own forward, remembered for later layers to copy (`remember_forward`)."""
        if self.phase != _FORWARD or not self.copy_forward or self.suppress:
            return original(*args, **kwargs)
        try:
            key = self._call_key(module, args, kwargs)
        except Exception:  # an attribute or argument the key cannot read: run it, no copy
            key = None
        template = self.fwd_templates.get(key) if key is not None else None
        if template is not None:
            return self._copy_forward(layer, path, template, args, kwargs)
        if key is not None:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            infos = tuple(
                None if (info := self.info.get(id(t))) is None else (info.key, info.producer)
                for t in tensors
            )
            self.pending[layer] = _Pending(
                key, self.flow.mark(), self.dispatch.mark(), tensors, infos
            )
        return original(*args, **kwargs)

    def _call_key(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
        """What decides a layer's forward ops: its modules' classes, attributes, parameters
        and buffers (`_module_state`), the plain globals and class attributes its code could
        read, and its arguments: structure, plain values, and per tensor its metadata,
        whether it needs a gradient, what the trace knows of it (parameter, state, which
        arguments share its base or producer), its data-flow tags and the repeat_kv ops
        behind it (`kv_heads` walks them); plus grad mode, autocast and saved-tensor hooks.
        None when an argument is an object the layer could change (a cache, a list)."""
        flat, spec = tree_flatten((args, kwargs))
        leaves: list[tuple] = []
        first: dict[int, int] = {}
        base: dict[int, int] = {}
        made_by: dict[int, int] = {}
        for i, x in enumerate(flat):
            if not isinstance(x, torch.Tensor):
                if not isinstance(x, _PLAIN):
                    return None
                leaves.append(("v", type(x).__name__, x))
                continue
            if id(x) in first:
                leaves.append(("same", first[id(x)]))
                continue
            first[id(x)] = i
            info = self.info.get(id(x))
            known: tuple = ("constant",)
            if info is not None:
                producer = info.producer
                if producer is not None and producer >= 0:
                    producer = ("op", made_by.setdefault(producer, i))
                known = (info.param, info.is_state, base.setdefault(info.key, i), producer)
            chain = [
                (packet, None if src is None else tuple(src.shape))
                for packet, src in self.repeat_kv_origins(x)
            ]
            leaves.append(
                (
                    "t",
                    tuple(x.shape),
                    tuple(x.stride()),
                    x.dtype,
                    x.requires_grad,
                    known,
                    self.flow.tags(x),
                    tuple(chain),
                )
            )
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        context = (
            torch.is_grad_enabled(),
            torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"),
            hooks,
        )
        return str(spec), tuple(leaves), _module_state(module), context

    def remember_forward(self, layer: int, path: str, module: nn.Module, out: object) -> None:
        """After `layer` ran its own forward (`forward_or_copy`): keep it as the template of
        its call key if a copy of it can stand for a layer called the same way: it changed
        no attribute, class attribute or global of its modules, every op
        in its span is its own, it read only activations it was handed, and its outputs are
        plain values or tensors it made (no argument handed back, no repeat_kv view). The MoE
        routings it priced are copied with it (`_ExpertDispatch.since`)."""
        pending = self.pending.pop(layer, None)
        if pending is None:
            return
        try:
            if _module_state(module) != pending.key[2]:
                return
        except Exception:
            return
        start, end = self.layer_start[layer], self.layer_end[layer]
        inside = range(start, end)
        recs = [r for p in inside if (r := self.records.get(p)) is not None]
        if any(r.layer != layer for r in recs):
            return
        inputs: list[tuple[int, int | None] | None] = []
        for t in pending.inputs:
            info = self.info.get(id(t))
            inputs.append(None if info is None else (info.key, info.producer))
        if tuple(inputs) != pending.infos:
            return  # changed an argument in place: its readers after the layer see the change
        handed = {k for k, _ in filter(None, inputs)}
        handed_producers = {p for _, p in filter(None, inputs)}
        if any(s.key not in handed for r in recs for s in r.sources if s.producer not in inside):
            return
        for p in inside:
            m = self.meta_ops.get(p)
            if m is not None and m.producer is not None and m.producer not in inside:
                if m.producer not in handed_producers:
                    return
        flat, spec = tree_flatten(out)
        leaves: list[tuple] = []
        seen: set[int] = set()
        for x in flat:
            if not isinstance(x, torch.Tensor):
                if not isinstance(x, _PLAIN):
                    return
                leaves.append(("v", x))
                continue
            info = self.info.get(id(x))
            chain = self.view_chain.get(id(x), ())
            origin = self.origin.get(id(x))
            if (
                id(x) in seen
                or info is None
                or info.param is not None
                or info.is_state
                or info.producer not in inside
                or any(c not in inside for c in chain)
                or (origin is not None and origin[0] in _REPEAT_KV_OPS)
            ):
                return
            seen.add(id(x))
            leaves.append(
                (
                    "t",
                    info.key,
                    info.producer,
                    info.meta,
                    tuple(x.shape),
                    tuple(x.stride()),
                    x.dtype,
                    x.requires_grad,
                    chain,
                    origin[0] if origin is not None else None,
                    self.flow.tags(x),
                )
            )
        added = self.flow.since(pending.flow)
        routed = self.dispatch.since(pending.dispatch)
        template = _ForwardTemplate(
            layer, path, start, end, tuple(inputs), spec, tuple(leaves), added, routed
        )
        self.fwd_templates.setdefault(pending.key, template)

    def _copy_forward(
        self, layer: int, path: str, tpl: _ForwardTemplate, args: tuple, kwargs: dict
    ) -> object:
        """Record `tpl`'s forward ops again as `layer`'s (module and parameter names moved
        to `path`, positions and tensor keys its own, sources its arguments) and return
        fresh fake outputs of the template's metadata; `skip_backward` then puts them behind
        the stand-in node, so backward reaches the layer's arguments as before."""
        assert self.make_fake is not None
        old = tpl.path

        def rename(name: str) -> str:
            if name == old or name.startswith(old + "."):
                return path + name[len(old) :]
            return name

        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        handed: dict[int, _TensorInfo] = {}  # template key -> this call's argument
        producers: dict[int | None, int | None] = {}  # template producer -> this call's
        for was, t in zip(tpl.inputs, tensors, strict=True):
            info = self.info.get(id(t))
            if was is None or info is None:
                continue
            handed[was[0]] = info
            producers[was[1]] = info.producer
        shift = self.n_fwd - tpl.start
        keys: dict[int, int] = {}
        for p in range(tpl.start, tpl.end):
            r = self.records.get(p)
            if r is not None:
                sources = []
                for src in r.sources:
                    if tpl.start <= src.producer < tpl.end:
                        sources.append(Source(src.producer + shift, keys[src.key], src.meta))
                    else:
                        info = handed[src.key]
                        producer = info.producer if info.producer is not None else -1
                        sources.append(Source(producer, info.key, info.meta))
                out_keys = []
                for k in r.output_keys:
                    keys[k] = self.new_key()
                    out_keys.append(keys[k])
                self.records[p + shift] = OpRecord(
                    pos=p + shift,
                    target=r.target,
                    packet=r.packet,
                    fx_name=self.fx_name(r.packet),
                    module=rename(r.module),
                    module_stack=tuple(rename(m) for m in r.module_stack),
                    layer=layer,
                    inputs=r.inputs,
                    outputs=r.outputs,
                    sources=tuple(sources),
                    output_keys=tuple(out_keys),
                    params=tuple(rename(n) for n in r.params),
                    attrs=dict(r.attrs),
                    fwd_flops=r.fwd_flops,
                    fwd_bytes=r.fwd_bytes,
                )
            m = self.meta_ops.get(p)
            if m is not None:
                producer = m.producer
                if producer is not None:
                    if tpl.start <= producer < tpl.end:
                        producer += shift
                    else:
                        producer = producers[producer]
                        producer = producer if producer != -1 else None
                fold = (
                    m.fold + shift if m.fold is not None and tpl.start <= m.fold < tpl.end else None
                )
                self.meta_ops[p + shift] = _MetaOp(self.fx_name(m.packet), producer, fold, m.packet)
            if p in self.foreign_saved:
                self.foreign_saved.add(p + shift)
        self.n_fwd += tpl.end - tpl.start
        outs: list[object] = []
        self.suppress = True
        try:
            for leaf in tpl.out_leaves:
                if leaf[0] == "v":
                    outs.append(leaf[1])
                    continue
                _, k, producer, meta, shape, stride, dtype, grad, chain, origin, tags = leaf
                t = self.make_fake(shape, stride, dtype)
                if grad:
                    t.requires_grad_(True)
                self.info[id(t)] = _TensorInfo(keys[k], producer + shift, meta)
                if chain:
                    self.view_chain[id(t)] = tuple(c + shift for c in chain)
                if origin is not None:
                    self.origin[id(t)] = (origin, None)
                position, score, features = tags
                if position is not None:
                    position = (rename(position[0]), *position[1:])
                if features is not None:
                    features = (rename(features[0]), rename(features[1]), *features[2:])
                self.flow.tag(t, (position, rename(score) if score else score, features))
                self.keep.append(t)
                outs.append(t)
        finally:
            self.suppress = False
        self.flow.replay(tpl.flow, rename)
        self.dispatch.replay(tpl.routed, rename)
        self.fwd_copied[layer] = tpl.layer
        self.report(f"forward: layer {layer + 1}/{self.n_layers} (as {tpl.layer + 1})")
        return tree_unflatten(outs, tpl.out_spec)

    # -- between forward and backward -------------------------------------------------------
    def end_forward(self, loss: torch.Tensor, params_and_buffers: list[torch.Tensor]) -> None:
        """Resolve fold targets and saved bytes before backward frees the saved tensors."""
        real = sorted(self.records)
        for pos, m in self.meta_ops.items():
            if m.fold is None:
                m.fold = m.producer if m.producer is not None else _nearest(real, pos)
        state = {StorageWeakRef(t.untyped_storage()) for t in params_and_buffers}
        # Deduplicated per layer (prologue and epilogue together), not globally: a tensor that
        # several layers save (RoPE tables, masks) is charged to each, so every layer is
        # self-contained, as it is when layers sit on different pipeline stages.
        seen: set[tuple[int | None, StorageWeakRef]] = set()
        for seq, node in _autograd_nodes(loss):
            pos = self.seq_owner.get(seq)
            if pos is None or pos in self.foreign_saved:
                continue
            target = self.fold_target(pos)
            if target is None:
                continue
            record = self.records[target]
            for t in _saved_tensors(node):
                ref = StorageWeakRef(t.untyped_storage())
                if ref in state or (record.layer, ref) in seen:
                    continue
                seen.add((record.layer, ref))
                record.saved_bytes += t.untyped_storage().nbytes()

    def fold_target(self, pos: int) -> int | None:
        if pos in self.records:
            return pos
        m = self.meta_ops.get(pos)
        return m.fold if m is not None else None

    # -- backward ---------------------------------------------------------------------------
    def on_backward(
        self, func: torch._ops.OpOverload, args: tuple, kwargs: dict, out: object
    ) -> None:
        node = torch._C._current_autograd_node()
        owner = self.seq_owner.get(node._sequence_nr()) if node is not None else None
        if owner is None:
            owner = self.last_owner if self.last_owner is not None else max(self.records)
        self.last_owner = owner
        if is_metadata_op(func):
            return
        target = self.fold_target(owner)
        if target is None:
            return
        record = self.records[target]
        record.bwd_flops += op_flops(func, args, kwargs, out)
        record.bwd_bytes += op_bytes(args, kwargs, out)
        if record.layer is not None and record.layer != self.bwd_layer:
            self.bwd_layer = record.layer
            self.report(f"backward: layer {record.layer + 1}/{self.n_layers}", advance=1)

    # -- data-dependent shapes ---------------------------------------------------------------
    def dispatch_stack(self) -> tuple[str, ...]:
        """The module stack an op runs in: the current one in forward, in backward the one of
        the forward op whose backward is running."""
        if self.phase != _BACKWARD:
            return tuple(self.module_stack)
        node = torch._C._current_autograd_node()
        owner = self.seq_owner.get(node._sequence_nr()) if node is not None else None
        target = self.fold_target(owner) if owner is not None else None
        return self.records[target].module_stack if target is not None else ()

    def finish(self) -> list[OpRecord]:
        """The real forward records in order, with folded metadata names attached."""
        for pos in sorted(self.meta_ops):
            m = self.meta_ops[pos]
            if m.fold is not None and m.fold in self.records:
                self.records[m.fold].folded.append(m.fx_name)
        return [self.records[p] for p in sorted(self.records)]


# Ops a repeat_kv / GQA broadcast is made of (walked backwards from an attention's key).
_REPEAT_KV_OPS = frozenset(
    {
        "aten.expand",
        "aten.view",
        "aten._unsafe_view",
        "aten.reshape",
        "aten.clone",
        "aten.unsqueeze",
        "aten.slice",
        "aten.repeat_interleave",
        "aten.repeat",
        "aten.index_select",
        "aten.contiguous",
        "aten._to_copy",
    }
)


def _autograd_nodes(root: torch.Tensor) -> list[tuple[int, object]]:
    """Every autograd node the loss depends on, as (sequence number, node), in creation order
    (so that "first saver" means first in forward order)."""
    start = root.grad_fn
    if start is None:
        return []
    found: dict[int, object] = {}
    stack = [start]
    visited: set[object] = set()
    while stack:
        node = stack.pop()
        if node in visited:
            continue
        visited.add(node)
        found.setdefault(node._sequence_nr(), node)
        for nxt, _ in node.next_functions:
            if nxt is not None and nxt not in visited:
                stack.append(nxt)
    return sorted(found.items(), key=lambda kv: kv[0])


def _nearest(real: list[int], pos: int) -> int | None:
    """The closest real op before `pos`, else after it."""
    import bisect

    i = bisect.bisect_left(real, pos)
    if i > 0:
        return real[i - 1]
    return real[0] if real else None


_BIND_CACHE: dict[torch._ops.OpOverload, tuple[str, ...]] = {}


def _bind(func: torch._ops.OpOverload, args: tuple, kwargs: dict) -> dict[str, object]:
    """Map an op's positional and keyword arguments to its schema argument names."""
    names = _BIND_CACHE.get(func)
    if names is None:
        names = tuple(a.name for a in func._schema.arguments)
        _BIND_CACHE[func] = names
    bound = dict(zip(names, args, strict=False))
    bound.update(kwargs)
    return bound


_SAVED_ATTRS: dict[type, tuple[str, ...]] = {}


def _saved_tensors(node: object) -> Iterator[torch.Tensor]:
    """The tensors an autograd node saved for its backward (`_saved_*` attributes, or a custom
    autograd.Function's `saved_tensors`)."""
    attrs = _SAVED_ATTRS.get(type(node))
    if attrs is None:
        attrs = tuple(a for a in dir(node) if a.startswith("_saved_"))
        if hasattr(node, "saved_tensors"):
            attrs = (*attrs, "saved_tensors")
        _SAVED_ATTRS[type(node)] = attrs
    for a in attrs:
        try:
            value = getattr(node, a)
        except RuntimeError:
            continue  # freed or invalidated: nothing kept
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (tuple, list)):
            for v in value:
                if isinstance(v, torch.Tensor):
                    yield v


# -- MoE expert dispatch with data-dependent shapes -------------------------------------------

# Ops whose output size depends on values (`torch.Tag.dynamic_output_shape`) that expert
# dispatch code uses, and the routing ops the balanced expectation is read from.
_SELECTIONS = frozenset(
    {
        "aten.nonzero",  # also torch.where(cond) and nonzero(as_tuple=True)
        "aten.index",  # x[mask] with a boolean mask
        "aten.masked_select",
        "aten._unique",
        "aten._unique2",
        "aten.unique_consecutive",
        "aten.bincount",
    }
)
_ROUTING_OPS = frozenset({"aten.topk", "aten.argmax"})
# Attribute names models give an MoE's top-k and its number of experts.
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "topk", "moe_top_k", "n_activated_experts", "k")
_NUM_EXPERTS_ATTRS = ("num_experts", "n_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True, slots=True)
class _MoEScope:
    """A module expert dispatch may run in, with what its attributes say about the routing
    (0: not said)."""

    top_k: int = 0
    experts: int = 0


@dataclass(frozen=True, slots=True)
class _Route:
    """How one MoE spreads its tokens: each of `tokens` rows goes to `top_k` of `experts`
    experts. `scope` is the module it was found for, `source` where the numbers came from."""

    scope: str
    tokens: int
    top_k: int
    experts: int
    source: str

    @property
    def per_expert(self) -> int:
        """Balanced expectation of one expert's rows: tokens x top_k / experts, rounded up."""
        return -(-self.tokens * self.top_k // self.experts)

    def selected(self, numel: int) -> int | None:
        """Balanced expectation of the entries a selection over `numel` values keeps.

        A mask over tokens (numel a multiple of them: one expert's `(tokens,)` or
        `(tokens, top_k)` choices) keeps one expert's share; a mask over tokens x experts
        (a one-hot of all the choices) keeps every routed row; a mask over the experts
        (numel at most experts + 1, e.g. "experts hit") keeps every expert. None otherwise:
        then it is not recognisably dispatch."""
        if numel == 0:
            return 0
        if numel % (self.tokens * self.experts) == 0:
            return self.tokens * self.top_k
        if numel % self.tokens == 0:
            return self.per_expert
        if numel <= self.experts + 1:
            return min(numel, self.experts)
        return None


def _moe_scopes(model: nn.Module) -> dict[str, _MoEScope]:
    """The modules of `model` inside which a data-dependent selection counts as expert
    dispatch: those holding an `experts` (or `expert`) child, MoE classes (`Moe`, `MoE`,
    `SparseMLP` in the name) and experts modules (`lower.classify`'s rules), each with the
    top-k and expert count its attributes (or its experts container's length) give."""
    scopes: dict[str, _MoEScope] = {}
    for path, m in model.named_modules():
        cls = type(m).__name__
        experts = getattr(m, "experts", None) or getattr(m, "expert", None)
        holder = isinstance(experts, nn.Module)
        if not (holder or _is_moe_module(cls) or (path and _is_experts_module(path, cls))):
            continue
        top_k = _int_attr(m, _TOP_K_ATTRS)
        n = _int_attr(m, _NUM_EXPERTS_ATTRS)
        if not n and holder:
            n = _int_attr(experts, _NUM_EXPERTS_ATTRS)
            if not n and isinstance(experts, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
                n = len(experts)
        scopes[path] = _MoEScope(top_k, n if n > 1 else 0)
    return scopes


def _int_attr(m: nn.Module, names: tuple[str, ...]) -> int:
    for name in names:
        v = getattr(m, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return 0


class _ExpertDispatch:
    """Prices an MoE's data-dependent dispatch at its balanced load (module docstring).

    Fed the routing ops (`on_routing`) and the inputs of MoE modules (`on_enter`) as the
    forward runs; `balanced_output` makes the output of a selection fake tensors could not
    size; `notes` says what was assumed, once per distinct routing."""

    def __init__(self, scopes: dict[str, _MoEScope]) -> None:
        self.scopes = scopes
        self.routes: dict[str, _Route] = {}  # scope -> its last top-k's routing
        self.tokens: dict[str, int] = {}  # scope -> rows of its (last) input
        self.rows: dict[int, int] = {}  # id(mask) -> rows chosen, so backward agrees
        self.keep: list[torch.Tensor] = []  # masks whose ids `rows` holds
        # (tokens, top_k, experts, source) -> (scopes, ops) it was applied in
        self.used: dict[tuple[int, int, int, str], tuple[list[str], list[str]]] = {}

    def mark(self) -> tuple:
        """The dispatch state now (for `since`)."""
        return (
            dict(self.routes),
            dict(self.tokens),
            {k: (len(scopes), len(ops)) for k, (scopes, ops) in self.used.items()},
        )

    def since(self, mark: tuple) -> tuple:
        """What a layer's forward added since `mark`: routings and token counts by MoE module,
        and the modules and ops each priced routing was applied in (for `replay`)."""
        routes, tokens, used = mark
        new_routes = tuple(r for s, r in self.routes.items() if routes.get(s) != r)
        new_tokens = tuple((s, n) for s, n in self.tokens.items() if tokens.get(s) != n)
        new_used = []
        for key, (scopes, ops) in self.used.items():
            ns, no = used.get(key, (0, 0))
            if len(scopes) > ns or len(ops) > no:
                new_used.append((key, tuple(scopes[ns:]), tuple(ops[no:])))
        return new_routes, new_tokens, tuple(new_used)

    def replay(self, added: tuple, rename: Callable[[str], str]) -> None:
        """Add what `since` returned for another layer, its module names renamed to this
        layer's: a copied MoE layer routes as its template did. (Masks' rows are not copied:
        a copied layer's backward never runs.)"""
        routes, tokens, used = added
        for r in routes:
            self.routes[rename(r.scope)] = dataclasses.replace(r, scope=rename(r.scope))
        for scope, n in tokens:
            self.tokens[rename(scope)] = n
        for key, scopes, ops in used:
            have_scopes, have_ops = self.used.setdefault(key, ([], []))
            for scope in scopes:
                if rename(scope) not in have_scopes:
                    have_scopes.append(rename(scope))
            for op in ops:
                if op not in have_ops:
                    have_ops.append(op)

    def on_enter(self, path: str, args: object) -> None:
        if path not in self.scopes:
            return
        x = next((t for t in iter_tensors(args) if t.is_floating_point() and t.dim()), None)
        if x is not None and x.shape[-1]:
            self.tokens[path] = x.numel() // int(x.shape[-1])

    def on_routing(self, func, args: tuple, kwargs: dict, stack: tuple[str, ...]) -> None:
        """A `topk` (k of the router's width) or `argmax` (top-1) inside an MoE module."""
        scope = next((p for p in reversed(stack) if p in self.scopes), None)
        bound = _bind(func, args, kwargs)
        scores = bound.get("self")
        if scope is None or not isinstance(scores, torch.Tensor) or scores.dim() == 0:
            return
        if packet_name(func) == "aten.argmax":
            if bound.get("dim") is None:
                return
            dim, k = int(bound["dim"]), 1
        else:
            dim, k = int(bound.get("dim", -1)), int(bound.get("k", 0))
        width = int(scores.shape[dim])
        if 0 < k < width:
            source = "top_k and experts from the router's topk"
            if k == 1 and packet_name(func) == "aten.argmax":
                source = "top-1 and experts from the router's argmax"
            self.routes[scope] = _Route(scope, scores.numel() // width, k, width, source)

    def route(self, stack: tuple[str, ...]) -> _Route | None:
        """The routing of the innermost MoE module on `stack` that has one: its top-k's,
        else its attributes' (top-1 when no top-k is known) over its input's rows."""
        scopes = [p for p in reversed(stack) if p in self.scopes]
        for p in scopes:
            if p in self.routes:
                return self.routes[p]
        top_k = next((self.scopes[p].top_k for p in scopes if self.scopes[p].top_k), 0)
        for p in scopes:
            n, tokens = self.scopes[p].experts, self.tokens.get(p, 0)
            if n and tokens:
                k = top_k if 0 < top_k < n else 1
                source = "no topk seen: experts from the module's attributes, " + (
                    f"top_k {k} from its attributes" if k == top_k else "top-1 assumed"
                )
                return _Route(p, tokens, k, n, source)
        return None

    def balanced_output(self, func, args: tuple, kwargs: dict, stack: tuple[str, ...]):
        """The output of data-dependent selection `func` at its balanced size, or None when
        it is not expert dispatch (or not a selection this knows how to size)."""
        packet = packet_name(func)
        route = self.route(stack) if packet in _SELECTIONS else None
        if route is None or func._overloadname == "out":
            return None
        bound = _bind(func, args, kwargs)
        x = bound.get("self")
        if not isinstance(x, torch.Tensor):
            return None
        if packet == "aten.nonzero":
            n = self.selected(x, x.numel(), route, packet)
            return None if n is None else x.new_empty((n, x.dim()), dtype=torch.int64)
        if packet == "aten.masked_select":
            mask = bound.get("mask")
            shape = torch.broadcast_shapes(x.shape, mask.shape)
            n = self.selected(mask, _numel(shape), route, packet)
            return None if n is None else x.new_empty((n,))
        if packet == "aten.index":
            # As aten does: each boolean mask becomes the indices of its True entries (one
            # index tensor per mask dim), then the index is static.
            indices = []
            for ix in bound.get("indices", ()):
                if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
                    n = self.selected(ix, ix.numel(), route, packet)
                    if n is None:
                        return None
                    indices += [ix.new_empty((n,), dtype=torch.int64)] * ix.dim()
                else:
                    indices.append(ix)
            return func(x, indices)
        if packet == "aten.bincount":
            # A count per expert id: one bin per expert at least.
            self.note(route, packet)
            n = max(int(bound.get("minlength", 0) or 0), route.experts)
            w = bound.get("weights")
            dtype = torch.int64 if w is None else w.dtype
            dtype = dtype if dtype in (torch.int64, torch.float32) else torch.float64
            return x.new_empty((n,), dtype=dtype)
        # unique of expert ids: under balanced load every expert appears.
        self.note(route, packet)
        n = min(x.numel(), route.experts)
        inverse = bound.get("return_inverse", False)
        outs = [x.new_empty((n,))]
        outs.append(x.new_empty(tuple(x.shape) if inverse else (0,), dtype=torch.int64))
        if packet != "aten._unique":
            counts = bound.get("return_counts", False)
            outs.append(x.new_empty((n,) if counts else (0,), dtype=torch.int64))
        return tuple(outs)

    def selected(self, mask: torch.Tensor, numel: int, route: _Route, packet: str) -> int | None:
        """Rows kept by a selection over `mask` (`_Route.selected`), the same for every op
        reading this mask (a forward `x[mask]` and its backward's `index_put`)."""
        n = self.rows.get(id(mask))
        if n is None:
            n = route.selected(numel)
            if n is None:
                return None
            self.rows[id(mask)] = n
            self.keep.append(mask)
        self.note(route, packet)
        return n

    def note(self, route: _Route, packet: str) -> None:
        key = (route.tokens, route.top_k, route.experts, route.source)
        scopes, ops = self.used.setdefault(key, ([], []))
        if route.scope not in scopes:
            scopes.append(route.scope)
        if packet not in ops:
            ops.append(packet)

    def notes(self) -> tuple[str, ...]:
        """One sentence per distinct routing the balanced expectation was applied to."""
        out = []
        for (tokens, top_k, experts, source), (scopes, ops) in self.used.items():
            per = -(-tokens * top_k // experts)
            where = (
                f"'{scopes[0] or '<root>'}'"
                if len(scopes) == 1
                else f"{len(scopes)} MoE modules ('{scopes[0]}' .. '{scopes[-1]}')"
            )
            out.append(
                "expert load priced at its balanced expectation, tokens x top_k / experts rows "
                f"per expert (traced: {tokens} tokens x top_k {top_k} / {experts} experts = "
                f"{per} rows), for the data-dependent {', '.join(ops)} in {where} ({source}); "
                "real routing is uneven"
            )
        return tuple(out)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class _NeedsCompiler(BaseException):
    """Raised inside a trace under `without_compiler` when torch asks the stand-in for more
    than it answers; `trace` then runs again with the real package. A BaseException, so that
    torch's own `except Exception` fallbacks do not take it for a failed op."""


class _CompilerStandIn(types.ModuleType):
    """Stands in for the `torch._dynamo` package (the compiler) while `trace` runs, where
    nothing has imported it yet (`without_compiler`).

    Importing the package takes ~1.0 s of a ~5 s `meshplan plan` on the 2-core machine, and
    tracing usually needs two things of it:
    - the settings module `torch._dynamo.config`, read by FakeTensorMode's constructor; it is
      loaded alone under this stand-in;
    - `disable`, which `torch._compile._disable_dynamo` asks for, with `wrapping=False`, on
      the first call of every function it wraps (every TorchDispatchMode's
      `__torch_dispatch__`, torch's Python references), caching the answer on the function.
      Nothing in a trace runs under the compiler, so the answer is the function itself;
      `without_compiler` drops those answers afterwards, so a later call asks the real
      package.
    Anything else while the block runs (another submodule, another name, `disable` called
    any other way) raises `_NeedsCompiler` and marks the stand-in `needed`: `trace` runs the
    trace again with the real package imported first. After the block, anything still holding
    the stand-in reads the real package through it."""

    def __init__(self, path: list[str]):
        super().__init__("torch._dynamo")
        self.__path__ = path
        self.active = True
        self.needed = False
        self.answered: list[Callable] = []

    def disable(self, fn=None, recursive=True, *, reason=None, wrapping=True):
        if self.active and fn is not None and not wrapping and reason is None:
            self.answered.append(fn)
            return fn
        return self._real("disable")(fn, recursive, reason=reason, wrapping=wrapping)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self._real(name), name)

    def _real(self, what: str):
        if self.active:
            self.needed = True
            raise _NeedsCompiler(f"torch._dynamo.{what}")
        return importlib.import_module("torch._dynamo")


class _StandInImports:
    """A meta-path finder that stops any `torch._dynamo` submodule but `config` from loading
    under an active stand-in (`_CompilerStandIn`)."""

    def __init__(self, stand_in: _CompilerStandIn):
        self.stand_in = stand_in

    def find_spec(self, fullname, path=None, target=None):
        if (
            self.stand_in.active
            and fullname.startswith("torch._dynamo.")
            and fullname != "torch._dynamo.config"
        ):
            self.stand_in.needed = True
            raise _NeedsCompiler(fullname)
        return None


# The attribute `torch._compile._disable_dynamo` caches its answer in (set from a function, so
# the name is not mangled there; spelt as a string here, where it would be).
_DISABLE_CACHE = "__dynamo_disable"


@contextlib.contextmanager
def without_compiler() -> Iterator[_CompilerStandIn | None]:
    """Run the block with `_CompilerStandIn` in place of an unimported `torch._dynamo` (yielded;
    None, and nothing done, once the real package is loaded). Afterwards the stand-in and its
    import guard are gone, the cached `disable` answers are dropped, and a later
    `import torch._dynamo` runs the real package, which adopts the settings module already
    loaded (`from . import config` finds it in `sys.modules`). `tests/ir/test_trace_imports.py`
    checks the trace is the same either way, that a trace needing more of the compiler runs
    again with it, and that torch.compile works afterwards."""
    spec = None if "torch._dynamo" in sys.modules else importlib.util.find_spec("torch._dynamo")
    if spec is None or not spec.submodule_search_locations:
        yield None
        return
    stand_in = _CompilerStandIn(list(spec.submodule_search_locations))
    if "torch._dynamo.config" in sys.modules:  # loaded by an earlier trace
        stand_in.config = sys.modules["torch._dynamo.config"]
    guard = _StandInImports(stand_in)
    sys.meta_path.insert(0, guard)
    sys.modules["torch._dynamo"] = stand_in
    try:
        yield stand_in
    finally:
        stand_in.active = False
        sys.meta_path.remove(guard)
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if torch.__dict__.get("_dynamo") is stand_in:
            del torch._dynamo
        for fn in stand_in.answered:
            if getattr(fn, _DISABLE_CACHE, None) is fn:
                delattr(fn, _DISABLE_CACHE)


@contextlib.contextmanager
def quiet_fake_tensor_log() -> Iterator[None]:
    """Hold back the tracebacks torch logs when an op fails on fake tensors: meshplan turns
    such failures into one-line reasons (a `TraceError`, a blocker, a `RuntimePlanError`)."""
    fake_log = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake_log.level
    fake_log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        fake_log.setLevel(level)


class _SkipBackward(torch.autograd.Function):
    """Stand-in for a skipped layer (`_Capture.skip_backward`): its output, and in backward a
    zero (fake) gradient for each input the layer read, so the backward upstream runs as
    before. Its own ops are not recorded."""

    @staticmethod
    def forward(ctx, cap: _Capture, out: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.cap = cap
        ctx.metas = [(t.shape, t.dtype, t.device) for t in inputs]
        return out.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cap: _Capture = ctx.cap
        cap.suppress = True
        try:
            zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.metas]
        finally:
            cap.suppress = False
        return (None, None, *zeros)


class _Recorder(TorchDispatchMode):
    """Records every aten op of the traced step into a `_Capture`."""

    def __init__(self, capture: _Capture) -> None:
        super().__init__()
        self.capture = capture

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        cap = self.capture
        if cap.suppress:
            return func(*args, **kwargs)
        try:
            out = func(*args, **kwargs)
        except DynamicOutputShapeException:
            # An output size that depends on values: inside an MoE's expert dispatch it gets
            # its balanced expectation (module docstring), elsewhere tracing stops here.
            cap.error_op = str(func)
            cap.error_module = cap.module_path()
            out = cap.dispatch.balanced_output(func, args, kwargs, cap.dispatch_stack())
            if out is None:
                raise
        except Exception:
            # Remember where it failed; the exception itself propagates unchanged so a model
            # that catches it still behaves as it would untraced.
            cap.error_op = str(func)
            cap.error_module = cap.module_path()
            raise
        cap.error_op = None
        if cap.phase == _BACKWARD:
            cap.on_backward(func, args, kwargs, out)
        else:
            cap.on_forward(func, args, kwargs, out)
        return out


# -- driver ---------------------------------------------------------------------------------
def _trace(
    model: nn.Module,
    example_inputs: tuple,
    kwargs: dict[str, object],
    name: str | None,
    report: _Progress,
    param_shapes: dict[str, tuple[int, ...]],
    flow_out: list[Dataflow] | None,
    dedupe: bool = False,
) -> Graph:
    container, layer_names = find_layer_container(model)
    layer_of_path = {p: i for i, p in enumerate(layer_names)}
    module_names: dict[int, str] = {}
    module_classes: dict[str, str] = {}
    for path, mod in model.named_modules():
        module_names.setdefault(id(mod), path)
        module_classes[path] = type(mod).__name__
    graph_name = name or type(model).__name__
    named_params = list(model.named_parameters())
    named_buffers = list(model.named_buffers())
    report.set_total(2 * len(layer_names) + 2)
    report(
        f"{graph_name}: {sum(p.numel() for _, p in named_params) / 1e9:.3f}B params, "
        f"{len(layer_names)} layers in '{container or '-'}'",
    )

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
    dispatch = _ExpertDispatch(_moe_scopes(model))
    cap = _Capture(layer_of_path, len(layer_names), report, dispatch, dedupe)

    def fake_like(t: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        # Fake *CPU* tensors whatever the source device (meta, cpu, cuda): CPU dispatch picks
        # the fused CPU attention kernel, meta would decompose it.
        with fake_mode:
            return torch.empty(shape or tuple(t.shape), dtype=t.dtype, device="cpu")

    params: dict[str, torch.Tensor] = {}
    trainable: list[torch.Tensor] = []
    for pname, p in named_params:
        fp = fake_like(p, param_shapes.get(pname))
        if p.requires_grad:
            fp.requires_grad_(True)
            trainable.append(fp)
        else:
            cap.frozen.add(pname)
        params[pname] = fp
        cap.register_leaf(fp, None, pname, True)
    buffers: dict[str, torch.Tensor] = {}
    for bname, b in named_buffers:
        fb = fake_like(b)
        buffers[bname] = fb
        cap.register_leaf(fb, None, None, True)
    if not trainable:
        raise TraceError(
            f"{graph_name} has no parameter with requires_grad=True: nothing to train; "
            "unfreeze parameters before tracing"
        )

    def fake_input(x: object) -> object:
        if not isinstance(x, torch.Tensor):
            return x
        fx = fake_like(x)
        if x.requires_grad and fx.is_floating_point():
            fx.requires_grad_(True)
        cap.register_leaf(fx, -1, None, False)
        return fx

    args = tree_map(fake_input, example_inputs)
    fkwargs = tree_map(fake_input, kwargs)
    input_metas = tuple(
        cap.tensor_meta(t) for t in tree_flatten((args, fkwargs))[0] if isinstance(t, torch.Tensor)
    )

    def pre_hook(module: nn.Module, args: object) -> None:
        path = module_names.get(id(module), type(module).__name__)
        cap.enter_module(path)
        if cap.phase == _FORWARD:
            dispatch.on_enter(path, args)

    def post_hook(module: nn.Module, args: object, kwargs: object, out: object) -> object:
        cap.exit_module()
        path = module_names.get(id(module))
        if cap.phase == _FORWARD and path in layer_of_path:
            return cap.after_layer(layer_of_path[path], path, module, args, kwargs, out)
        return None

    def make_fake(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype):
        with fake_mode:
            return torch.empty_strided(shape, stride, dtype=dtype, device="cpu")

    cap.make_fake = make_fake
    state = [*params.values(), *buffers.values()]
    recorder = _Recorder(cap)
    handles = [
        nn.modules.module.register_module_forward_pre_hook(pre_hook),
        nn.modules.module.register_module_forward_hook(post_hook, with_kwargs=True),
    ]
    # Repeated layers run through `forward_or_copy` (a layer with a `forward` of its own
    # instance keeps it and is traced as it is).
    wrapped: list[nn.Module] = []
    if cap.copy_forward:
        for i, lpath in enumerate(layer_names):
            layer_mod = model.get_submodule(lpath)
            if "forward" in vars(layer_mod):
                continue
            layer_mod.forward = functools.partial(
                cap.forward_or_copy, i, lpath, layer_mod, layer_mod.forward
            )
            wrapped.append(layer_mod)
    try:
        # The fake parameters stay in place through the backward too (what
        # `torch.func.functional_call` does for the forward alone): activation checkpointing
        # inside the model recomputes in backward and must see them, not the model's own
        # (meta) tensors. `tie_weights` as functional_call's default. Torch's own log of a
        # failing op is held back: failures become one-line TraceErrors below.
        swap = _reparametrize_module(model, {**params, **buffers}, tie_weights=True)
        with (
            quiet_fake_tensor_log(),
            _fake_tensor_attributes(model, fake_like),
            fake_mode,
            recorder,
            swap,
        ):
            # The sequence counter is per thread and keeps counting across autograd graphs.
            cap.next_seq = torch._C._autograd._get_sequence_nr()
            out = model(*args, **fkwargs)
            cap.phase = _LOSS
            cap.module_stack.clear()
            cap.layer_stack.clear()
            loss = _scalar_loss(out, graph_name)
            cap.end_forward(loss, state)
            report("backward", advance=1)
            cap.phase = _BACKWARD
            torch.autograd.grad(loss, trainable, allow_unused=True)
            cap.copy_skipped()
    except (TraceError, _Retrace):
        raise
    except Exception as exc:
        raise _trace_error(exc, cap, module_classes) from exc
    finally:
        for h in handles:
            h.remove()
        for layer_mod in wrapped:
            del layer_mod.forward

    loss_info = cap.info.get(id(loss))
    record = TraceRecord(
        name=graph_name,
        inputs=input_metas,
        params=tuple(
            Param(n, tuple(int(d) for d in params[n].shape), str(p.dtype).removeprefix("torch."))
            for n, p in named_params
        ),
        ops=cap.finish(),
        container=container,
        layer_names=layer_names,
        module_classes=module_classes,
        output_key=loss_info.key if loss_info is not None else None,
        output_meta=loss_info.meta if loss_info is not None else None,
    )
    report("lowering", advance=1)
    graph = lower(record, _pointwise_packets(cap))
    graph = with_declared_tp_roles(graph, model)
    blocker = sequence_sharding_blocker(model, graph.info.seq_len)
    blockers = model_blockers(model, graph, cap.flow, layer_names, not blocker)
    reads = cap.flow.position_reads
    tables = tuple(sorted({m for m, what, _ in reads if what == "position table"}))
    assumptions = dispatch.notes()
    if blocker or blockers or tables or assumptions:
        info = dataclasses.replace(
            graph.info,
            no_sequence_sharding=blocker,
            blockers=tuple(sorted(blockers.items())),
            position_tables=tables,
            assumptions=assumptions,
        )
        graph = dataclasses.replace(graph, info=info)
    report(graph.summary())
    if flow_out is not None:
        flow_out.append(cap.flow)
    return graph


# Roles a model may declare for its projections (`meshplan_tp_roles`), as `passes.sharding`
# names them.
DECLARABLE_TP_ROLES = ("column", "row", "replicated")


def with_declared_tp_roles(graph: Graph, model: nn.Module) -> Graph:
    """`graph` with the tensor-parallel roles `model` declares for its parameters: a dict
    `model.meshplan_tp_roles` of parameter-name patterns (fnmatch, on names relative to a
    repeated layer, e.g. "mlp.down_proj.weight", or to the model outside the layers) to
    "column", "row" or "replicated", as torchtitan declares a plan per model. Each op reading a
    matching parameter gets the attr `tp_role`, which `passes.sharding` applies in place of its
    own rule (for models whose projections its op-order rule misreads: an MLP whose inner
    width equals the model width). A bad role is a `TraceError` naming the pattern."""
    declared = getattr(model, "meshplan_tp_roles", None)
    if not declared:
        return graph
    if not isinstance(declared, dict):
        raise TraceError(
            f"{type(model).__name__}.meshplan_tp_roles must be a dict of parameter-name "
            f"patterns to roles, got {type(declared).__name__}"
        )
    for pattern, role in declared.items():
        if role not in DECLARABLE_TP_ROLES:
            raise TraceError(
                f"{type(model).__name__}.meshplan_tp_roles[{pattern!r}] = {role!r}: roles are "
                + ", ".join(DECLARABLE_TP_ROLES)
            )
    blocks = []
    for key, block in graph.blocks:
        ops = []
        for op in block.ops:
            role = next(
                (r for pat, r in declared.items() for n in op.params if fnmatch.fnmatch(n, pat)),
                None,
            )
            if role is not None:
                attrs = tuple(sorted({**dict(op.attrs), "tp_role": role}.items()))
                op = dataclasses.replace(op, attrs=attrs)
            ops.append(op)
        blocks.append((key, dataclasses.replace(block, ops=tuple(ops))))
    return dataclasses.replace(graph, blocks=tuple(blocks))


def model_blockers(
    model: nn.Module, graph: Graph, flow: Dataflow, layer_names: tuple[str, ...], hf_ok: bool
) -> dict[str, str]:
    """Per parallel dimension, why the runtime cannot run it on `model` (`ir.facts`): the
    module tree's reasons first, then the traced data flow's. `hf_ok`: no HuggingFace model
    inside whose positions the runtime cannot give (`sequence_sharding_blocker`)."""
    sharded: dict[str, str] = {}
    experts: set[str] = set()
    kinds = {OpKind.MATMUL: "matmul", OpKind.EXPERTS: "experts", OpKind.EMBEDDING: "embedding"}
    for unit, block in graph.unit_blocks():
        prefix = "" if unit.name.startswith("<") else unit.name + "."
        for op in block.ops:
            kind = kinds.get(op.kind)
            if kind is None or op.attr("positions") or op.target.startswith("aten.convolution"):
                continue  # replicated under TP (`passes.sharding`)
            if op.kind is OpKind.EXPERTS:
                experts.add(prefix + op.module if op.module else unit.name)
            for p in op.params:
                shape = next((q.shape for q in block.params if q.name == p), ())
                if kind == "embedding" or len(shape) >= 2:
                    sharded.setdefault(prefix + p, kind)
    out = structural_blockers(model, tuple(layer_names), tuple(sorted(experts)))
    hf_positions = hf_ok and bool(hf_models(model))
    flow_blockers = dataflow_blockers(
        model, flow, graph.info.seq_len, sharded, hf_positions, tuple(layer_names)
    )
    for dim, why in flow_blockers.items():
        out.setdefault(dim, why)
    # The runner cuts every input on dim 1 under context parallelism: each must be laid out
    # (batch, sequence, ...) for the model's sequence.
    seq = graph.info.seq_len
    for i, t in enumerate(graph.inputs):
        if seq and len(t.shape) >= 2 and t.shape[1] != seq and "cp" not in out:
            out["cp"] = (
                f"input {i} has shape {list(t.shape)}, not (batch, {seq} tokens, ...): context "
                "parallelism cuts every input along dim 1 as the sequence"
            )
    return out


def _pointwise_packets(cap: _Capture) -> frozenset[str]:
    """The traced aten packets tagged `torch.Tag.pointwise` (lowering stays torch-free)."""
    names = set()
    for packet in {r.packet for r in cap.records.values()}:
        if packet.startswith("aten."):
            op = getattr(torch.ops.aten, packet.removeprefix("aten."), None)
            if op is not None and any(
                torch.Tag.pointwise in getattr(op, o).tags for o in op.overloads()
            ):
                names.add(packet)
    return frozenset(names)


def _scalar_loss(out: object, graph_name: str) -> torch.Tensor:
    """The scalar to differentiate: the output if scalar, its `.loss` (when set), else the
    `.sum()` of its logits (`.logits`, or a `"logits"` key), else of its first floating-point
    tensor (tuples, lists, dicts and HuggingFace `ModelOutput`s searched in order)."""
    loss: torch.Tensor | None = None
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        loss = out.reshape(())
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    else:
        logits = getattr(out, "logits", None)
        if logits is None and isinstance(out, dict):
            logits = out.get("logits")
        if isinstance(logits, torch.Tensor) and logits.is_floating_point():
            loss = logits.sum()
        else:
            if hasattr(out, "values") and hasattr(out, "keys"):
                out = list(out.values())  # dict_values is a pytree leaf
            leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            floats = [t for t in leaves if t.is_floating_point() and t.requires_grad]
            if floats:
                loss = floats[0].sum()
    if loss is None or not loss.requires_grad:
        raise TraceError(
            f"{graph_name} produced no differentiable output (got {type(out).__name__}); return "
            "a loss or a floating-point tensor computed from trainable parameters"
        )
    return loss


@contextlib.contextmanager
def _fake_tensor_attributes(model: nn.Module, fake_like: Callable[[torch.Tensor], torch.Tensor]):
    """Temporarily replace plain tensor attributes on meta (not parameters or buffers, e.g. a
    cached RoPE table) with fake CPU tensors: a meta tensor cannot meet fake CPU tensors."""
    swapped: list[tuple[nn.Module, str, torch.Tensor]] = []
    try:
        for mod in model.modules():
            for attr, value in list(vars(mod).items()):
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, nn.Parameter)
                    and value.device.type == "meta"
                ):
                    swapped.append((mod, attr, value))
                    setattr(mod, attr, fake_like(value))
        yield
    finally:
        for mod, attr, value in swapped:
            setattr(mod, attr, value)


def _trace_error(exc: Exception, cap: _Capture, classes: dict[str, str]) -> TraceError:
    """One-line TraceError naming the module and op where tracing failed, and what to do."""
    module = cap.error_module if cap.error_module is not None else cap.module_path()
    where = f"module '{module or '<root>'}'"
    cls = classes.get(module)
    if cls:
        where += f" ({cls})"
    op = cap.error_op or getattr(exc, "func", None) or "?"
    first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    data_dependent = isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException))
    if not data_dependent:
        try:
            from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

            data_dependent = isinstance(exc, GuardOnDataDependentSymNode)
        except ImportError:  # pragma: no cover - older torch
            pass
    if isinstance(exc, DynamicOutputShapeException):
        return TraceError(
            f"data-dependent output shape in {where} at op {op}: tracing uses fake tensors "
            "without values, and only an MoE's expert dispatch (inside a module holding "
            "`experts`, routed by a topk) is sized at its balanced load; make it static (a "
            "mask multiply or torch.where(cond, a, b) instead of selecting rows)"
        )
    if data_dependent:
        return TraceError(
            f"data-dependent control flow or output shape in {where} at op {op}: tracing uses "
            "fake tensors without values; make it static (branch on config, not tensor values; "
            "for HF MoE models pass experts_implementation='batched_mm' or 'grouped_mm')"
        )
    if "grouped_mm" in str(op) and "BF16" in first_line:
        return TraceError(
            f"op {op} in {where} runs only in bfloat16 (HF MoE experts default to "
            "'grouped_mm'): build the model with torch_dtype=torch.bfloat16, or pass "
            "experts_implementation='batched_mm' to from_config/from_pretrained"
        )
    if "use_reentrant=True" in first_line:
        return TraceError(
            f"{where} uses reentrant activation checkpointing (torch.utils.checkpoint with "
            "use_reentrant=True), which cannot be traced: switch it off for planning "
            "(model.gradient_checkpointing_disable() for HuggingFace models) and let the plan "
            "choose recomputation (--recompute), or use use_reentrant=False"
        )
    if (
        isinstance(exc, UnsupportedOperatorException)
        or "fake impl" in first_line
        or "Meta kernel" in first_line
    ):
        return TraceError(
            f"op {op} in {where} cannot run on fake tensors (no fake/meta kernel); register "
            "one with torch.library.register_fake or replace the op"
        )
    return TraceError(f"tracing failed in {where} at op {op}: {type(exc).__name__}: {first_line}")
