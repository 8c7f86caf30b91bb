"""Model facts: what the runtime needs to know about a model, and which dimensions it cannot run.

A plan is only as good as the runtime's ability to execute it on the user's own code. Some
of what decides that is in the module tree (can the model be cut into pipeline stages? are
its MoE blocks a shape expert parallelism can shard?), some only in the data flow of one
traced step (is a projection's output split into q/k/v *before* it is split into heads? does
the model read token positions from the length of the sequence it holds?). Both are
collected here, once, and end up as `ModelInfo.blockers`: per parallel dimension, the first
reason the runtime cannot run it on this model (an empty tuple: every dimension runs). The
planner never plans a blocked dimension and refuses a pinned one with the reason; the runtime
re-checks the structural half on the real model before it shards anything.

Data-flow facts (`Dataflow`, fed every forward op by the tracer):

- **Fused projections.** Tensor parallelism splits a column-parallel projection's output
  features into tp contiguous blocks. That is right when the outermost factor the model's
  code makes of those features is the head index (`view(b, s, heads, d)`, also GPT-NeoX's
  per-head interleaved `view(b, s, heads, 3 * d)`), wrong when it is the *part* index: a
  fused q/k/v or gate/up projection whose output is split (`split`, `chunk`, a slice) or
  reshaped `(b, s, 3, heads, d)` and indexed on the 3 (timm). Then rank 0 would get all of q
  and part of k. The features of every projection's output are followed through views,
  permutes and same-shape pointwise ops to the first op that splits or indexes the
  outermost factor (fused: tp refused) or consumes them (plain).
- **Positions.** An `arange` as long as the sequence, and a slice of a buffer or constant to
  the sequence's length (RoPE tables `freqs[:T]`), count positions from the length of the
  tensor the code holds. Under context parallelism a rank holds a share of the sequence, so
  such code would put every rank at positions 0..S/cp. Reads the runtime re-positions are
  exempt (the zoo's `rope` argument and root `pos_embed`, HuggingFace decoders of the Llama
  shape, modules with a `context_parallel_attention(cp)` hook); any other blocks cp.
- **Position tables.** An embedding whose indices come from an `arange` is a table of
  learned positions, not a vocabulary: sharding passes replicate it, and sequence
  parallelism (which shards the token embedding's output on the sequence) is refused.
- **Attention.** Attention that is not one SDPA call (eager `q @ k^T`, softmax, `@ v`) cannot
  be redirected to context-parallel attention; an SDPA call outside a module the runtime can
  wrap (one with `q_proj`/`k_proj`/`v_proj` children, or the hook) neither.

Structural facts (`structural_blockers(model)`, also called by the runtime on the real
model): how a model is cut into pipeline stages (`pipeline_cut`), which MoE modules expert
parallelism can shard, parameters tied across pipeline stages.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

# Dimensions a blocker can name (`ModelInfo.blockers` keys); "zb": the zero-bubble (ZB-V)
# schedule, which puts a pipeline's first and last chunks on one rank.
DIMENSIONS = ("tp", "sp", "cp", "pp", "ep", "zb")

# Ops that only re-arrange a tensor's dims (the features are followed through them).
_VIEWS = frozenset(
    {
        "aten.view",
        "aten._unsafe_view",
        "aten.reshape",
        "aten.alias",
        "aten.detach",
        "aten.clone",
        "aten.contiguous",
        "aten._to_copy",
        "aten.lift_fresh",
    }
)
_PERMUTES = frozenset({"aten.permute", "aten.transpose", "aten.t"})
_SPLITS = frozenset(
    {
        "aten.split",
        "aten.split_with_sizes",
        "aten.chunk",
        "aten.unbind",
        "aten.select",
        "aten.slice",
        "aten.narrow",
        "aten.unsafe_split",
        "aten.unsafe_split_with_sizes",
    }
)
_PROJECTIONS = frozenset({"aten.addmm", "aten.mm", "aten.linear", "aten.matmul", "aten.bmm"})
# Ops that only change a shape (an arange through them is still the positions 0..n-1).
_SHAPE_ONLY = frozenset({"aten.unsqueeze", "aten.squeeze", "aten.expand", "aten.repeat"})
# Ops between attention scores and their softmax (scale, mask, bias, cast).
_SCORE_OPS = frozenset(
    {
        "aten.div",
        "aten.mul",
        "aten.add",
        "aten.sub",
        "aten.masked_fill",
        "aten.where",
        "aten.expand",
        "aten.unsqueeze",
        "aten.squeeze",
    }
)
_POSITION_SINKS = frozenset(
    {
        "aten.embedding",
        "aten.index",
        "aten.index_select",
        "aten.sin",
        "aten.cos",
        "aten.ge",
        "aten.gt",
        "aten.le",
        "aten.lt",
        "aten.eq",
        "aten.triu",
        "aten.tril",
    }
)


@dataclass(slots=True)
class _Features:
    """Where a projection's output features sit in a tensor: dims outermost first."""

    weight: str
    module: str
    dims: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(slots=True)
class Dataflow:
    """Data-flow facts of one traced forward (see module docstring).

    `on_op` is called by the tracer for every forward op with the op's module path and a
    lookup telling parameters (their names) and state (buffers, constants) from activations.
    """

    fused: dict[str, str] = field(default_factory=dict)  # weight -> how its output is split
    position_reads: list[tuple[str, str, int]] = field(default_factory=list)  # module, what, len
    position_tables: dict[str, str] = field(default_factory=dict)  # embedding weight -> module
    token_embeddings: list[str] = field(default_factory=list)  # embeddings of ids (weights)
    eager_attention: list[str] = field(default_factory=list)  # modules with q @ k^T
    attention_modules: list[tuple[str, ...]] = field(default_factory=list)  # SDPA module stacks
    _features: dict[int, _Features] = field(default_factory=dict)
    # id -> (module of the arange, its length, reached through views only)
    _positions: dict[int, tuple[str, int, bool]] = field(default_factory=dict)
    _scores: dict[int, str] = field(default_factory=dict)  # id -> module of q @ k^T
    _keep: list[torch.Tensor] = field(default_factory=list)
    unit_calls: list[str] = field(default_factory=list)  # repeated layers, in call order
    # Tensors a forward makes of its own inside a module: (module, how, shape) of every
    # creation op (no tensor input: arange, zeros, ...) and every tensor the trace does not
    # know that an op reads (one made from Python values, `torch.tensor([...])`). The tp
    # rehearsal compares them with the rank's (`planner.rehearse`): one whose shape follows
    # the head count holds per-head values each rank would compute for the first heads.
    made: list[tuple[str, str, tuple[int, ...]]] = field(default_factory=list)

    def alias(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """`new` stands for `old` (the tracer's stand-in for a layer's output): it carries
        the same position, score and feature tags."""
        for tags in (self._positions, self._scores, self._features):
            if id(old) in tags:
                tags[id(new)] = tags[id(old)]
        self._keep.append(new)

    # -- copied layers (the tracer's `_Capture.forward_or_copy`) --------------------------------
    def tags(self, t: torch.Tensor) -> tuple:
        """`t`'s position, score and feature tags, hashable (None where it has none)."""
        f = self._features.get(id(t))
        features = None if f is None else (f.weight, f.module, f.dims, f.sizes)
        return self._positions.get(id(t)), self._scores.get(id(t)), features

    def tag(self, t: torch.Tensor, tags: tuple) -> None:
        """Give `t` the tags `tags` (as `tags` returns them)."""
        position, score, features = tags
        if position is not None:
            self._positions[id(t)] = position
        if score is not None:
            self._scores[id(t)] = score
        if features is not None:
            self._features[id(t)] = _Features(*features)
        self._keep.append(t)

    _LISTS = ("position_reads", "token_embeddings", "eager_attention", "attention_modules", "made")

    def mark(self) -> tuple:
        """Where the facts stand now, for `since`."""
        return (
            tuple(len(getattr(self, n)) for n in self._LISTS),
            dict(self.fused),
            dict(self.position_tables),
        )

    def since(self, mark: tuple) -> tuple:
        """The facts added since `mark` (a layer's forward), for `replay`."""
        lengths, fused, tables = mark
        lists = tuple(tuple(getattr(self, n)[k:]) for n, k in zip(self._LISTS, lengths))
        new_fused = tuple((w, why) for w, why in self.fused.items() if fused.get(w) != why)
        new_tables = tuple((w, m) for w, m in self.position_tables.items() if tables.get(w) != m)
        return lists, new_fused, new_tables

    def replay(self, added: tuple, rename: Callable[[str], str]) -> None:
        """Add the facts `since` returned for another layer, its module and parameter names
        renamed to this layer's by `rename`. What `on_op` adds only when missing is added
        only when missing; the rest is appended (the readers use the first entry of a list,
        or whether it holds something, never how often)."""
        (reads, embeddings, eager, attention, made), fused, tables = added
        for module, what, n in reads:
            if (entry := (rename(module), what, n)) not in self.position_reads:
                self.position_reads.append(entry)
        for weight in embeddings:
            if rename(weight) not in self.token_embeddings:
                self.token_embeddings.append(rename(weight))
        for module in eager:
            if rename(module) not in self.eager_attention:
                self.eager_attention.append(rename(module))
        for stack in attention:
            self.attention_modules.append(tuple(rename(p) for p in stack))
        for module, how, shape in made:
            self.made.append((rename(module), how, shape))
        for weight, why in fused:
            module, sep, rest = why.partition(": ")
            self.fused.setdefault(rename(weight), rename(module) + sep + rest)
        for weight, module in tables:
            self.position_tables[rename(weight)] = rename(module)

    def on_unit(self, path: str) -> None:
        """The forward entered repeated layer `path` (a unit)."""
        self.unit_calls.append(path)

    def on_op(
        self,
        packet: str,
        args: tuple,
        kwargs: dict,
        out: object,
        stack: tuple[str, ...],
        param_of: Callable[[torch.Tensor], str | None],
        is_state: Callable[[torch.Tensor], bool],
    ) -> None:
        module = stack[-1] if stack else ""
        outs = [o for o in _tensors(out)]
        ins = [t for t in _tensors(args)] + [t for t in _tensors(kwargs)]
        if not outs:
            return
        if not ins:
            self.made.append((module, packet, tuple(outs[0].shape)))
        for t in ins:
            if param_of(t) is None and not isinstance(t, FakeTensor) and is_state(t):
                self.made.append((module, "a tensor of Python values", tuple(t.shape)))
        self._keep.extend(outs)
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        # Positions: aranges, and slices of state to some length (lengths judged later,
        # against the sequence length).
        if packet == "aten.arange":
            self._positions[id(outs[0])] = (module, outs[0].numel(), True)
        elif packet in ("aten.slice", "aten.narrow") and first is not None and is_state(first):
            dim = _arg(args, kwargs, 1, "dim", 0) % max(first.dim(), 1)
            # Kept whatever its length: a table exactly as long as the sequence is sliced to
            # the held length, which differs under context parallelism.
            n = outs[0].shape[dim] if outs[0].dim() else 0
            self.position_reads.append((module, "slice of a buffer", int(n)))
        tagged = [self._positions[id(t)] for t in ins if id(t) in self._positions]
        if tagged:
            origin, n, pure = tagged[0]
            if packet == "aten.embedding":
                weight = param_of(args[0]) if isinstance(args[0], torch.Tensor) else None
                if weight is not None:
                    self.position_tables[weight] = module
                    # Looked up with the arange itself (no offset): the runtime can hand it
                    # the rank's positions instead (`ModelInfo.position_tables`).
                    what = "position table" if pure else "arange"
                    self.position_reads.append((module if pure else origin, what, n))
            elif packet in _POSITION_SINKS:
                reads_state = packet not in ("aten.index", "aten.index_select") or (
                    first is not None and is_state(first)
                )
                if reads_state and (origin, "arange", n) not in self.position_reads:
                    self.position_reads.append((origin, "arange", n))
            else:
                keeps = packet in _VIEWS or packet in _PERMUTES or packet in _SHAPE_ONLY
                for o in outs:
                    self._positions[id(o)] = (origin, n, pure and keeps)
        if packet == "aten.embedding" and not tagged and isinstance(args[0], torch.Tensor):
            weight = param_of(args[0])
            if weight is not None and weight not in self.token_embeddings:
                self.token_embeddings.append(weight)
        # Attention.
        if packet in (
            "aten._scaled_dot_product_flash_attention_for_cpu",
            "aten.scaled_dot_product_attention",
            "aten._scaled_dot_product_efficient_attention",
            "aten._scaled_dot_product_flash_attention",
            "aten._scaled_dot_product_cudnn_attention",
        ):
            self.attention_modules.append(stack)
        # Eager attention: a product of two activations whose result reaches a softmax.
        scored = next((self._scores[id(t)] for t in ins if id(t) in self._scores), None)
        if packet in ("aten.bmm", "aten.matmul", "aten.baddbmm") and len(ins) >= 2:
            a, b = ins[0], ins[1]
            if not (is_state(a) or is_state(b)) and a.dim() >= 3 and b.dim() >= 3:
                self._scores[id(outs[0])] = module
        elif scored is not None:
            if packet in ("aten._softmax", "aten.softmax", "aten._safe_softmax"):
                if scored not in self.eager_attention:
                    self.eager_attention.append(scored)
            elif packet in _VIEWS or packet in _PERMUTES or packet in _SCORE_OPS:
                for o in outs:
                    self._scores[id(o)] = scored
        self._follow_features(packet, args, kwargs, ins, outs, module, param_of)

    def is_position(self, t: object) -> bool:
        """`t` was computed from an `arange` (token positions, not token ids)."""
        return isinstance(t, torch.Tensor) and id(t) in self._positions

    # -- fused projections ----------------------------------------------------------------------
    def _follow_features(self, packet, args, kwargs, ins, outs, module, param_of) -> None:
        if packet in _PROJECTIONS:
            weights = [param_of(t) for t in ins if t.dim() >= 2]
            weights = [w for w in weights if w is not None]
            o = outs[0]
            if weights and o.dim() >= 1:
                self._features[id(o)] = _Features(
                    weights[0], module, (o.dim() - 1,), (o.shape[-1],)
                )
            return
        src = ins[0] if ins else None
        f = self._features.get(id(src)) if src is not None else None
        if f is None:
            return
        if packet in _VIEWS:
            g = _reshaped(f, tuple(src.shape), tuple(outs[0].shape))
            if g is not None:
                self._features[id(outs[0])] = g
        elif packet in _PERMUTES:
            order = _permutation(packet, args, src.dim())
            new_dims = tuple(order.index(d) for d in f.dims)
            self._features[id(outs[0])] = _Features(f.weight, f.module, new_dims, f.sizes)
        elif packet == "aten.unsqueeze":
            at = _arg(args, kwargs, 1, "dim", 0) % (src.dim() + 1)
            dims = tuple(d + 1 if d >= at else d for d in f.dims)
            self._features[id(outs[0])] = _Features(f.weight, f.module, dims, f.sizes)
        elif packet in _SPLITS:
            dim = _arg(args, kwargs, 1, "dim", 0 if packet != "aten.select" else 0)
            if packet in (
                "aten.split",
                "aten.split_with_sizes",
                "aten.chunk",
                "aten.unsafe_split",
                "aten.unsafe_split_with_sizes",
            ):
                dim = _arg(args, kwargs, 2, "dim", 0)
            dim %= src.dim()
            whole = packet not in ("aten.select", "aten.unbind") and all(
                o.shape[dim] == src.shape[dim] for o in outs if o.dim() == src.dim()
            )
            if dim == f.dims[0] and not whole and f.weight not in self.fused:
                parts = (
                    max(len(outs), src.shape[dim] // max(outs[0].shape[dim], 1))
                    if (packet not in ("aten.select", "aten.unbind"))
                    else src.shape[dim]
                )
                self.fused[f.weight] = (
                    f"{f.module}: its output features are split into {parts} parts "
                    f"({packet.removeprefix('aten.')} on the outermost feature dim) before heads"
                )
        elif all(tuple(o.shape) == tuple(src.shape) for o in outs):  # pointwise: same layout
            for o in outs:
                self._features[id(o)] = f


def _tensors(obj: object):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


def _arg(args: tuple, kwargs: dict, i: int, name: str, default: int) -> int:
    v = args[i] if len(args) > i else kwargs.get(name, default)
    return int(v) if isinstance(v, (int, torch.SymInt)) else default


def _permutation(packet: str, args: tuple, ndim: int) -> list[int]:
    """The permuted tensor's dims as source dims (out dim i is source dim order[i])."""
    if packet == "aten.permute":
        return [int(d) % ndim for d in args[1]]
    order = list(range(ndim))
    if packet == "aten.t":
        return order[::-1]
    a, b = int(args[1]) % ndim, int(args[2]) % ndim
    order[a], order[b] = order[b], order[a]
    return order


def _reshaped(f: _Features, src: tuple[int, ...], dst: tuple[int, ...]) -> _Features | None:
    """Where the features go through a reshape `src -> dst`, or None when they are mixed with
    other dims (then nobody splits them by parts any more: stop following)."""
    dims = sorted(f.dims)
    if dims != list(range(dims[0], dims[-1] + 1)):
        return None  # not contiguous: a reshape would interleave them with other dims
    before = _prod(src[: dims[0]])
    inner = _prod(src[dims[0] : dims[-1] + 1])
    start = end = None
    acc = 1
    for i, d in enumerate(dst):
        if acc == before and start is None:
            start = i
        acc *= d
        if start is not None and acc == before * inner:
            end = i
            break
    if start is None or end is None or end < start:
        return None
    # Outermost first: the dims in order (a reshape keeps the row-major order).
    new_dims = tuple(range(start, end + 1))
    return _Features(f.weight, f.module, new_dims, tuple(dst[start : end + 1]))


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


# -- structural facts: the module tree --------------------------------------------------------

# The zoo's decoder (`meshplan.models.transformer.Transformer`) and the parts of a
# HuggingFace Llama-family decoder body: the two shapes the runtime cuts into stages itself.
_ZOO_MODULE = "meshplan.models.transformer"
_HF_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")


def is_zoo_model(model: nn.Module) -> bool:
    """The zoo's decoder (its forward is the one `TransformerStage` re-implements per stage)."""
    return type(model).__module__ == _ZOO_MODULE and type(model).__name__ == "Transformer"


def is_hf_decoder(model: nn.Module) -> bool:
    """A HuggingFace decoder-only LM of the Llama family's shape: `model.embed_tokens`,
    `model.layers`, `model.norm`, `model.rotary_emb`, `lm_head` (LlamaForCausalLM, Mistral,
    Qwen2, ...). Read off attribute names only, so a pipeline stage keeping them passes too."""
    inner = getattr(model, "model", None)
    return (
        inner is not None
        and hasattr(model, "lm_head")
        and all(hasattr(inner, a) for a in _HF_DECODER_PARTS)
    )


# HuggingFace decoder families whose forward `runtime.pipeline_parallel.HFDecoderStage`
# (embed, rotary tables, layers without a mask, norm, head) reproduces exactly, checked
# against one process under pp and tp (tests/runtime/test_model_matrix.py and
# test_parity_hf_families.py). Others of the same module shape do more in their own forward
# (Gemma 2: logit soft-capping, per-layer sliding-window masks; an eager attention needs
# the mask the stage does not pass): they are cut from their exported graph instead, and
# their tensor parallelism is rehearsed like any user model's.
HF_DECODER_FAMILIES = ("llama", "mistral", "qwen2", "phi3", "qwen2_moe", "mixtral")


def is_verified_hf_decoder(model: nn.Module) -> bool:
    """`is_hf_decoder` of a family in `HF_DECODER_FAMILIES` built with SDPA attention (HF's
    SDPA path is causal without a mask; its eager path is not)."""
    config = getattr(model, "config", None)
    return (
        is_hf_decoder(model)
        and getattr(config, "model_type", None) in HF_DECODER_FAMILIES
        and getattr(config, "_attn_implementation", None) == "sdpa"
    )


def pipeline_cut(model: nn.Module) -> str:
    """How the runtime cuts `model` into pipeline stages: "hook" (the model's own
    `pipeline_stage`), "hf_decoder", "zoo", or "graph" (any other model: cut from its exported
    graph at the units, `runtime.graph_stages`, when the trace saw each unit called once, in
    order: `Dataflow.unit_calls`)."""
    if hasattr(model, "pipeline_stage"):
        return "hook"
    if is_verified_hf_decoder(model):
        return "hf_decoder"
    if is_zoo_model(model):
        return "zoo"
    return "graph"


def is_zoo_moe(m: nn.Module) -> bool:
    """An MoE module of the zoo's shape: `router(x_th) -> (weights_tk, experts_tk)`,
    `capacity(tokens)`, `top_k`, `experts` (stacked weights), optional `shared`."""
    return all(hasattr(m, a) for a in ("router", "experts", "capacity", "top_k"))


def is_hf_experts(m: nn.Module) -> bool:
    """A HuggingFace experts module (transformers >= 5: Mixtral, Qwen2-MoE, Qwen3-MoE, ...):
    weights stacked along dim 0 (`num_experts` of them), called as
    `experts(hidden (t, h), top_k_index (t, k), top_k_weights (t, k)) -> (t, h)`."""
    n = getattr(m, "num_experts", None)
    params = list(m.parameters(recurse=False))
    if not isinstance(n, int) or not params or any(p.shape[0] != n for p in params):
        return False
    try:
        names = list(inspect.signature(m.forward).parameters)
    except (TypeError, ValueError):
        return False
    return "top_k_index" in names and "top_k_weights" in names


def cp_wrappable(m: nn.Module) -> bool:
    """A module whose attention the runtime makes context-parallel: it has the hook, or
    q/k/v projection children (its forward's SDPA calls are redirected)."""
    return hasattr(m, "context_parallel_attention") or all(
        isinstance(getattr(m, a, None), nn.Module) for a in ("q_proj", "k_proj", "v_proj")
    )


def _rope_argument(m: nn.Module) -> bool:
    try:
        return "rope" in inspect.signature(m.forward).parameters
    except (TypeError, ValueError):
        return False


def tied_parameters(model: nn.Module) -> list[tuple[str, ...]]:
    """Names of parameters that are one tensor (input and output embeddings tied), each group
    in `named_parameters` order (the first name is the one the trace and plans keep)."""
    by_id: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [tuple(names) for names in by_id.values() if len(names) > 1]


def structural_blockers(
    model: nn.Module, layer_names: tuple[str, ...], expert_modules: tuple[str, ...] = ()
) -> dict[str, str]:
    """Dimensions the runtime cannot run on `model`, from its module tree alone.

    `layer_names`: the repeated units (`find_layer_container`); `expert_modules`: paths of
    the modules the traced expert GEMMs ran in (empty for a dense model)."""
    name = type(model).__name__
    out: dict[str, str] = {}
    if len(layer_names) < 2:
        # Tensor and context parallelism shard the attention/MLP regions of repeated layers
        # (what the cost model prices and the runtime splits); without them only data
        # parallelism, ZeRO and recomputation apply.
        why = f"{name} has no repeated layers (a stack of identical blocks)"
        out["pp"] = f"{why} to cut into pipeline stages"
        out["tp"] = f"{why} whose attention and MLP regions tensor parallelism splits"
        out["cp"] = f"{why} whose attention context parallelism shards"
        out["ep"] = f"{why} with experts to shard"
    elif (ties := tied_parameters(model)) and pipeline_cut(model) != "hook":
        # The runtime sums the copies' gradients over the stages holding them
        # (`runtime.pipeline_parallel.TiedGradients`), unless one rank holds both (ZB-V).
        first, second = ties[0][:2]
        out["zb"] = (
            f"parameters {first} and {second} are one tensor (tied) and ZB-V holds both on "
            "pipeline rank 0"
        )
    for path in expert_modules:
        hf = _enclosing(model, path, is_hf_experts)
        if hf is not None:  # EP by token dispatch (`runtime.expert_parallel`); no expert TP
            out.setdefault(
                "tp",
                f"experts {hf[0]!r} ({type(hf[1]).__name__}) run expert parallelism but not "
                "tensor parallelism (only the zoo's MoE shape is a TP region)",
            )
            continue
        moe = _enclosing(model, path, lambda m: is_zoo_moe(m) or getattr(m, "stacked_experts", 0))
        if moe is None:
            cls = type(model.get_submodule(path)).__name__ if path else name
            why = (
                f"MoE experts {path!r} ({cls}) are not of a shape the runtime shards (the zoo's "
                "MoE: router/experts/capacity/top_k; a HuggingFace experts module with "
                "stacked weights; or an experts module marked `stacked_experts = True`)"
            )
            out.setdefault("ep", why)
            out.setdefault("tp", why)
        elif not is_zoo_moe(moe[1]):
            out.setdefault("tp", f"experts {moe[0]!r} marked `stacked_experts` run with tp=1 only")
    return out


def _enclosing(model: nn.Module, path: str, pred) -> tuple[str, nn.Module] | None:
    parts = path.split(".") if path else []
    for i in range(len(parts), -1, -1):
        p = ".".join(parts[:i])
        try:
            m = model.get_submodule(p)
        except AttributeError:
            continue
        if pred(m):
            return p, m
    return None


def dataflow_blockers(
    model: nn.Module,
    flow: Dataflow,
    seq_len: int,
    tp_params: dict[str, str],
    hf_positions_ok: bool,
    layer_names: tuple[str, ...] = (),
) -> dict[str, str]:
    """Dimensions the traced data flow rules out (module docstring).

    `tp_params`: parameters tensor parallelism would shard (name -> the op kind reading
    them: "matmul", "experts", "embedding"), for the owner-type check; `hf_positions_ok`: the
    model's positions are given by the runtime's HuggingFace rotary hook."""
    out: dict[str, str] = {}
    # TP: fused projections, and sharded parameters of modules the runtime cannot shard.
    for weight, why in sorted(flow.fused.items()):
        out.setdefault("tp", f"fused projection {why}; a column split would mix the parts")
    for pname, kind in sorted(tp_params.items()):
        if pname in flow.position_tables:
            continue
        owner_path, _, attr = pname.rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            continue
        ok = isinstance(owner, nn.Linear) if kind == "matmul" else True
        if kind == "embedding":
            ok = isinstance(owner, nn.Embedding)
        if kind == "experts":
            ok = True  # judged by structural_blockers (the MoE's shape)
        if not ok and "tp" not in out:
            out["tp"] = (
                f"{pname} is a projection weight held by {type(owner).__name__} "
                f"({owner_path or '<root>'}), not nn.Linear/nn.Embedding: the runtime can only "
                "shard nn.Linear and nn.Embedding modules"
            )
    # SP: the sequence enters sharded through the vocab-parallel token embedding (learned
    # position tables are cut to the same share by the runtime); without one, the layers
    # would take a whole sequence for a shard.
    if not flow.token_embeddings:
        out["sp"] = (
            f"{type(model).__name__} has no token embedding (an nn.Embedding of ids) whose "
            "output sequence parallelism shards"
        )
    # CP: attention the runtime can redirect, positions it can give.
    if flow.eager_attention:
        out["cp"] = (
            f"{flow.eager_attention[0]} computes attention without "
            "F.scaled_dot_product_attention (q @ k^T, softmax, @ v), which context parallelism "
            "cannot redirect"
        )
    units = set(layer_names)
    for stack in flow.attention_modules:
        if "cp" in out:
            break
        # Wrapped where it is: a module with q/k/v projections or the hook, else its layer.
        if not any(p in units or _wrappable_at(model, p) for p in stack):
            where = stack[-1] if stack else "<root>"
            out["cp"] = (
                f"the attention in {where!r} is outside the repeated layers and not in a module "
                "the runtime can make context-parallel (one with q_proj/k_proj/v_proj "
                "children, or a `context_parallel_attention(cp)` method)"
            )
    if "cp" not in out and not hf_positions_ok:
        for module, what, n in flow.position_reads:
            if n != seq_len or n <= 1 or _positions_handled(model, module, what):
                continue
            out["cp"] = (
                f"{module or '<root>'} reads positions from the length of the sequence it "
                f"holds ({what} of {n}); under context parallelism each rank would count "
                "from 0: give the module a `context_parallel_attention(cp)` method and use "
                "cp.positions(...)"
            )
            break
    # PP: a model cut from its exported graph needs each unit called once, in order.
    if layer_names and len(layer_names) > 1 and pipeline_cut(model) == "graph":
        calls = flow.unit_calls
        for path in layer_names:
            if calls.count(path) != 1:
                out["pp"] = (
                    f"{path} runs {calls.count(path)} times in one forward; pipeline stages "
                    "are cut between repeated layers that each run once"
                )
                break
        else:
            if calls != list(layer_names):
                out["pp"] = (
                    f"the repeated layers run out of order ({', '.join(calls[:3])}, ...); "
                    "pipeline stages are cut between layers that run in the order they are "
                    "listed"
                )
    return out


def _wrappable_at(model: nn.Module, path: str) -> bool:
    try:
        return cp_wrappable(model.get_submodule(path))
    except AttributeError:
        return False


def _positions_handled(model: nn.Module, module: str, what: str) -> bool:
    """A position read the runtime re-positions: inside a module with the CP hook; the zoo's
    `rope` tables sliced inside a wrapped attention; a table of learned positions looked up
    with the arange itself."""
    parts = module.split(".") if module else []
    for i in range(len(parts), -1, -1):
        try:
            m = model.get_submodule(".".join(parts[:i]))
        except AttributeError:
            continue
        if hasattr(m, "context_parallel_attention"):
            return True
        if what != "arange" and cp_wrappable(m) and _rope_argument(m):
            return True
    # A table of learned positions looked up with 0..n-1: the runtime looks it up with the
    # rank's positions (`context_parallel.apply_context_parallel`, `ModelInfo.position_tables`).
    return what == "position table"


# -- the rule every layer applies -----------------------------------------------------------

# (blocker dimension, `Parallel` field, the field's value that leaves the dimension off)
_FIELDS = (
    ("tp", "tp", 1),
    ("sp", "sequence_parallel", False),
    ("cp", "cp", 1),
    ("pp", "pp", 1),
    ("ep", "ep", 1),
)


def blocked_dimension(info, parallel) -> str | None:
    """Why `parallel` (a `Parallel`, unset fields ignored) uses a dimension the runtime
    cannot run on the model `info` (a `ModelInfo`) describes, in one line; None when it
    does not. Called by candidate enumeration, the API's config check and `meshplan verify`."""
    for dim, name, off in _FIELDS:
        value = getattr(parallel, name)
        if value is None or value == off or value is False:
            continue
        why = info.blocker(dim)
        if why:
            return f"{name}={value} cannot run on this model: {why}; use {name}={off}"
    schedule = getattr(parallel.schedule, "value", parallel.schedule)
    if schedule == "zero_bubble" and (why := info.blocker("zb")):
        return f"schedule zero_bubble cannot run on this model: {why}; use 1f1b"
    return None


def without_blocked(info, parallel):
    """`parallel` with every blocked dimension that is not pinned set to off."""
    changes = {
        name: off
        for dim, name, off in _FIELDS
        if info.blocker(dim) and getattr(parallel, name) is None
    }
    return dataclasses.replace(parallel, **changes) if changes else parallel
