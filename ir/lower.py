"""Lowering: the tracer's per-op records -> meshplan's IR `Graph`.

`meshplan.ir.trace` runs the model once on fake tensors and produces a `TraceRecord`: the
forward aten ops (metadata-only ops already folded away), each with its module, shapes, costs
(its share of the backward included) and the activations it consumed. This module turns that
record into the IR, with no torch involved:

1. `_assign_units`: every op goes to the unit it ran in: a child of the repeated layer
   container (`model.layers.17`), or `<prologue>` / `<epilogue>` for what runs before the first
   / after the last layer op (the loss lands in the epilogue).
2. `classify`: each op gets an `OpKind` from its aten target and the classes of the modules it
   ran in (ops inside a `*Norm` module are NORM, GEMMs inside MoE experts are EXPERTS, ...).
3. `_lower_unit`: ops become `Op`s named and located relative to their unit, so identical layers
   lower to equal op lists; the unit's parameters and boundary activations are attached.
4. Deduplication: units whose lowered blocks are equal share one `Block` ("layer", "layer_1" if
   several distinct layer templates exist, "prologue", "epilogue").
5. `_model_info`: architecture facts (hidden, heads, ffn, ...) read off ops and parameters.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .flops import ATTENTION_TARGETS
from .graph import Block, Graph, ModelInfo, Op, OpKind, Param, TensorMeta, Unit

PROLOGUE = "<prologue>"
EPILOGUE = "<epilogue>"
LOSS_MODULE = "<loss>"  # module of the ops meshplan adds after the model returns (e.g. `.sum()`)

AttrValue = int | float | bool | str


@dataclass(frozen=True, slots=True)
class Source:
    """An activation an op consumed: who produced it (a forward op position, -1 for a graph
    input), a key naming the tensor (views share their base's key) and the base tensor's meta."""

    producer: int
    key: int
    meta: TensorMeta


@dataclass(slots=True)
class OpRecord:
    """One forward aten op as captured by the tracer.

    Mutable only while tracing: the backward pass adds `bwd_flops` / `bwd_bytes` as autograd
    runs the op's backward node, and folded metadata ops append their node names.
    """

    pos: int  # position among all forward dispatches (metadata ops included)
    target: str  # aten overload, e.g. "aten.mm.default"
    packet: str  # overload packet, e.g. "aten.mm"
    fx_name: str  # FX-style node name, e.g. "mm_3"
    module: str  # innermost module path ("" is the root module, LOSS_MODULE after forward)
    module_stack: tuple[str, ...]  # enclosing module paths, outermost first
    layer: int | None  # index of the layer unit it ran in, None outside the layer container
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    sources: tuple[Source, ...]  # activation inputs (parameters and buffers excluded)
    output_keys: tuple[int, ...]
    params: tuple[str, ...]  # full (canonical) names of the parameters it reads
    attrs: dict[str, AttrValue] = field(default_factory=dict)
    fwd_flops: int = 0
    fwd_bytes: int = 0
    bwd_flops: int = 0
    bwd_bytes: int = 0
    saved_bytes: int = 0
    folded: list[str] = field(default_factory=list)


@dataclass(slots=True)
class TraceRecord:
    """Everything `lower` needs from one traced training step."""

    name: str
    inputs: tuple[TensorMeta, ...]
    params: tuple[Param, ...]  # canonical names (tied parameters once), model order
    ops: list[OpRecord]  # real (non-metadata) forward ops in execution order
    container: str | None  # path of the repeated layer container, None if there is none
    layer_names: tuple[str, ...]  # full module paths of its children, in container order
    module_classes: dict[str, str]  # module path -> class name
    output_key: int | None = None  # key of the loss tensor
    output_meta: TensorMeta | None = None


# -- classification -------------------------------------------------------------------------
_MATMUL = frozenset(
    {
        "aten.mm",
        "aten.addmm",
        "aten.bmm",
        "aten.baddbmm",
        "aten.addbmm",
        "aten.matmul",
        "aten.linear",
        "aten._grouped_mm",
        "aten.convolution",
        "aten._convolution",
        "aten.conv1d",
        "aten.conv2d",
        "aten.conv3d",
        "aten.einsum",
        "aten._scaled_mm",
    }
)
_NORM = frozenset(
    {
        "aten.native_layer_norm",
        "aten.layer_norm",
        "aten.rms_norm",
        "aten._fused_rms_norm",
        "aten.native_group_norm",
        "aten.group_norm",
        "aten.native_batch_norm",
        "aten._native_batch_norm_legit",
        "aten._native_batch_norm_legit_functional",
        "aten.batch_norm",
    }
)
_LOSS = frozenset(
    {
        "aten.nll_loss",
        "aten.nll_loss_forward",
        "aten.nll_loss2d_forward",
        "aten.nll_loss_nd",
        "aten.cross_entropy_loss",
        "aten.mse_loss",
        "aten.l1_loss",
        "aten.smooth_l1_loss",
        "aten.huber_loss",
        "aten.binary_cross_entropy",
        "aten.binary_cross_entropy_with_logits",
        "aten.kl_div",
    }
)
_SOFTMAX = frozenset({"aten._softmax", "aten.softmax", "aten._log_softmax", "aten.log_softmax"})
_REDUCTION = frozenset(
    {
        "aten.sum",
        "aten.mean",
        "aten.amax",
        "aten.amin",
        "aten.max",
        "aten.min",
        "aten.var",
        "aten.var_mean",
        "aten.std",
        "aten.norm",
        "aten.linalg_vector_norm",
        "aten.logsumexp",
        "aten.argmax",
        "aten.argmin",
        "aten.prod",
        "aten.all",
        "aten.any",
        "aten.cumsum",
    }
)
_DATA_MOVEMENT = frozenset(
    {
        "aten._to_copy",
        "aten.copy_",
        "aten.copy",
        "aten.clone",
        "aten.cat",
        "aten.stack",
        "aten.index",
        "aten.index_select",
        "aten.gather",
        "aten.scatter",
        "aten.scatter_add",
        "aten.scatter_add_",
        "aten.scatter_",
        "aten.index_put",
        "aten.index_put_",
        "aten.index_add",
        "aten.index_add_",
        "aten.index_copy",
        "aten.slice_scatter",
        "aten.select_scatter",
        "aten.constant_pad_nd",
        "aten.repeat",
        "aten.repeat_interleave",
        "aten.masked_select",
        "aten.one_hot",
        "aten.nonzero",
        "aten.sort",
        "aten.argsort",
        "aten.histc",
        "aten.bincount",
        "aten.zeros",
        "aten.zeros_like",
        "aten.ones",
        "aten.ones_like",
        "aten.full",
        "aten.full_like",
        "aten.arange",
        "aten.scalar_tensor",
        "aten.new_zeros",
        "aten.new_ones",
        "aten.new_full",
        "aten.fill_",
        "aten.zero_",
        "aten.contiguous",
        "aten.embedding_dense_backward",
        "aten.split_with_sizes_copy",
        "aten.roll",
        "aten.flip",
    }
)
_ROUTER_TARGETS = frozenset({"aten.topk"})
_ROUTER_SCORES = frozenset({"aten._softmax", "aten.softmax", "aten.sigmoid", "aten.topk"})
_POINTWISE_EXTRA = frozenset({"aten.native_dropout", "aten.dropout", "aten.bernoulli"})


def _is_router_module(path: str, cls: str, classes: dict[str, str]) -> bool:
    if "Router" in cls or cls.endswith(("Gate", "Gating")):
        return True
    # A plain Linear named gate/router is a router only beside experts or inside an MoE
    # block: a dense SwiGLU MLP may well call its gate projection `gate`.
    parent, _, last = path.rpartition(".")
    if last not in ("gate", "router", "gating"):
        return False
    prefix = f"{parent}." if parent else ""
    return (
        f"{prefix}experts" in classes
        or f"{prefix}expert" in classes
        or _is_moe_module(classes.get(parent, ""))
    )


def _is_experts_module(path: str, cls: str) -> bool:
    last = path.rsplit(".", 1)[-1]
    return last in ("experts", "expert") or "Expert" in cls


def _is_moe_module(cls: str) -> bool:
    return "Moe" in cls or "MoE" in cls or "SparseMLP" in cls


def classify(rec: OpRecord, classes: dict[str, str], pointwise: bool) -> OpKind:
    """The `OpKind` of one op from its aten target and the modules it ran in.

    Module context decides GEMMs (MATMUL vs EXPERTS vs ROUTER) and the small ops of norms and
    routers; the aten target decides the rest. `pointwise` is the op's `torch.Tag.pointwise`.
    """
    packet = rec.packet
    stack = [(p, classes.get(p, "")) for p in rec.module_stack]
    in_experts = any(_is_experts_module(p, c) for p, c in stack)
    in_router = any(_is_router_module(p, c, classes) for p, c in stack)
    in_moe = any(_is_moe_module(c) for _, c in stack)
    in_norm = any("Norm" in c for _, c in stack)
    in_loss = rec.module == LOSS_MODULE or any("Loss" in c for _, c in stack)

    if packet in ATTENTION_TARGETS:
        return OpKind.ATTENTION
    if packet in ("aten.embedding", "aten._embedding_bag", "aten.embedding_bag"):
        return OpKind.EMBEDDING
    if packet in _LOSS:
        return OpKind.LOSS
    if packet in _MATMUL:
        if in_router:
            return OpKind.ROUTER
        if in_experts:
            return OpKind.EXPERTS
        return OpKind.MATMUL
    if in_router or packet in _ROUTER_TARGETS:
        return OpKind.ROUTER
    if in_moe and not in_experts and packet in _ROUTER_SCORES:
        return OpKind.ROUTER
    if packet in _NORM or in_norm:
        return OpKind.NORM
    if in_loss:
        return OpKind.LOSS
    if packet in ("aten._log_softmax", "aten.log_softmax") and rec.layer is None:
        return OpKind.LOSS  # log-softmax of the logits is the first half of cross-entropy
    if packet in _SOFTMAX:
        return OpKind.SOFTMAX
    if packet in _REDUCTION:
        return OpKind.REDUCTION
    if packet in _DATA_MOVEMENT:
        return OpKind.DATA_MOVEMENT
    if pointwise or packet in _POINTWISE_EXTRA:
        return OpKind.ELEMENTWISE
    return OpKind.OTHER


# -- units ----------------------------------------------------------------------------------
def _assign_units(record: TraceRecord) -> list[str]:
    """Unit name of every op: its layer, else prologue before the first layer op and epilogue
    after the last; ops between layers at an outer level stay with the layer before them."""
    layer_pos = [i for i, r in enumerate(record.ops) if r.layer is not None]
    first = layer_pos[0] if layer_pos else len(record.ops)
    last = layer_pos[-1] if layer_pos else len(record.ops)
    units: list[str] = []
    current = PROLOGUE
    for i, r in enumerate(record.ops):
        if r.layer is not None:
            current = record.layer_names[r.layer]
        elif i < first:
            current = PROLOGUE
        elif i > last:
            current = EPILOGUE
        units.append(current)
    return units


def _relative(path: str, unit: str) -> str:
    """A module or parameter path relative to a layer unit; other units keep full paths."""
    if unit in (PROLOGUE, EPILOGUE):
        return path
    if path == unit:
        return ""
    if path.startswith(unit + "."):
        return path[len(unit) + 1 :]
    return path


def _lower_op(rec: OpRecord, unit: str, name: str, kind: OpKind) -> Op:
    return Op(
        name=name,
        kind=kind,
        target=rec.target,
        module=_relative(rec.module, unit),
        inputs=rec.inputs,
        outputs=rec.outputs,
        fwd_flops=rec.fwd_flops,
        bwd_flops=rec.bwd_flops,
        fwd_bytes=rec.fwd_bytes,
        bwd_bytes=rec.bwd_bytes,
        saved_bytes=rec.saved_bytes,
        params=tuple(_relative(p, unit) for p in rec.params),
        attrs=tuple(sorted(rec.attrs.items())),
        fx_nodes=(rec.fx_name, *rec.folded),
    )


def _op_name(rec: OpRecord, unit: str, taken: dict[str, int]) -> str:
    short = rec.packet.removeprefix("aten.")
    module = _relative(rec.module, unit)
    base = f"{module}/{short}" if module else short
    n = taken.get(base, 0)
    taken[base] = n + 1
    return base if n == 0 else f"{base}_{n}"


def _signature(block: Block) -> tuple:
    """What must be equal for two units to share a template: everything but FX node names,
    which name the traced nodes of one particular instance."""
    ops = tuple(dataclasses.replace(op, fx_nodes=()) for op in block.ops)
    return (block.kind, ops, block.params, block.inputs, block.outputs)


def lower(record: TraceRecord, pointwise: frozenset[str] = frozenset()) -> Graph:
    """Build the IR `Graph` of a traced training step (see the module docstring for the steps).

    `pointwise` names the aten packets that carry `torch.Tag.pointwise` (the tracer knows them,
    this module stays torch-free).
    """
    classes = record.module_classes
    unit_of_op = _assign_units(record)
    pos_unit = {r.pos: u for r, u in zip(record.ops, unit_of_op, strict=True)}
    layer_set = set(record.layer_names)

    # Parameter ownership: a layer owns the parameters under its module path; every other
    # parameter belongs to the first non-layer unit that reads it (prologue if none does). A
    # tied parameter (embedding = head) is thus owned once, by the embedding's unit, and the
    # head op still lists it in `Op.params`.
    owner: dict[str, str] = {}
    for p in record.params:
        for ln in record.layer_names:
            if p.name.startswith(ln + "."):
                owner[p.name] = ln
                break
    for r, u in zip(record.ops, unit_of_op, strict=True):
        if u in layer_set:
            continue
        for pname in r.params:
            owner.setdefault(pname, u)
    for p in record.params:
        owner.setdefault(p.name, PROLOGUE)

    # Units in execution order: prologue, layers (container order), epilogue.
    unit_names: list[str] = []
    present = set(unit_of_op) | set(owner.values())
    if PROLOGUE in present:
        unit_names.append(PROLOGUE)
    unit_names.extend(record.layer_names)
    if EPILOGUE in present:
        unit_names.append(EPILOGUE)

    ops_by_unit: dict[str, list[OpRecord]] = {u: [] for u in unit_names}
    for r, u in zip(record.ops, unit_of_op, strict=True):
        ops_by_unit[u].append(r)

    # Boundary activations: consumed in one unit but produced in another (or graph inputs).
    inputs_by_unit: dict[str, dict[int, TensorMeta]] = {u: {} for u in unit_names}
    outputs_by_unit: dict[str, dict[int, TensorMeta]] = {u: {} for u in unit_names}
    for r, u in zip(record.ops, unit_of_op, strict=True):
        for s in r.sources:
            src_unit = pos_unit.get(s.producer) if s.producer >= 0 else None
            if src_unit == u:
                continue
            inputs_by_unit[u].setdefault(s.key, s.meta)
            if src_unit is not None:
                outputs_by_unit[src_unit].setdefault(s.key, s.meta)
    if record.output_key is not None and record.output_meta is not None and record.ops:
        outputs_by_unit[unit_of_op[-1]].setdefault(record.output_key, record.output_meta)

    params_by_unit: dict[str, list[Param]] = {u: [] for u in unit_names}
    for p in record.params:
        u = owner[p.name]
        params_by_unit[u].append(dataclasses.replace(p, name=_relative(p.name, u)))

    blocks: list[tuple[str, Block]] = []
    by_signature: dict[tuple, str] = {}
    units: list[Unit] = []
    n_layer_templates = 0
    for u in unit_names:
        taken: dict[str, int] = {}
        ops = tuple(
            _lower_op(r, u, _op_name(r, u, taken), classify(r, classes, r.packet in pointwise))
            for r in ops_by_unit[u]
        )
        kind = "prologue" if u == PROLOGUE else "epilogue" if u == EPILOGUE else "layer"
        block = Block(
            key="",
            kind=kind,
            ops=ops,
            params=tuple(params_by_unit[u]),
            inputs=tuple(inputs_by_unit[u].values()),
            outputs=tuple(outputs_by_unit[u].values()),
        )
        sig = _signature(block)
        key = by_signature.get(sig)
        if key is None:
            if kind == "layer":
                key = "layer" if n_layer_templates == 0 else f"layer_{n_layer_templates}"
                n_layer_templates += 1
            else:
                key = kind
            by_signature[sig] = key
            blocks.append((key, dataclasses.replace(block, key=key)))
        units.append(Unit(name=u, block=key))

    graph = Graph(
        name=record.name,
        inputs=record.inputs,
        units=tuple(units),
        blocks=tuple(blocks),
        params=record.params,
    )
    return dataclasses.replace(graph, info=_model_info(graph, record))


# -- model facts ----------------------------------------------------------------------------
def _model_info(graph: Graph, record: TraceRecord) -> ModelInfo:
    """Architecture facts read off the traced ops. Heuristics, in order of trust:

    - attention (first ATTENTION op, layer blocks first): heads, kv_heads, head_dim from its
      attrs; micro_batch and seq_len from the query shape (batch, heads, seq, head_dim).
    - embedding (first EMBEDDING op): vocab and hidden from the table's shape; micro_batch and
      seq_len from 2-D indices when there is no attention.
    - hidden otherwise: last dim of the first layer's first boundary input.
    - ffn, experts, top_k come from the most common layer template. ffn: the smallest
      non-hidden dimension (hidden itself for square weights) of the 2-D / 3-D weights the
      template's GEMMs (and expert weight gathers) read outside the attention module (when
      attention runs in the layer module itself, q / kv / fused-qkv / square widths are
      skipped as possible projections); the smallest so that
      fused gate+up weights (2*ffn) do not win over the down projection (ffn).
    - experts: output width of the router GEMM, else the leading dim of 3-D expert weights,
      else the number of `experts.<i>` submodules; top_k: the `k` of the router's topk.
    - layers: the number of layer units.
    """
    blocks = dict(graph.blocks)
    layer_blocks = [blocks[u.block] for u in graph.layer_units]
    ordered = layer_blocks + [b for _, b in graph.blocks if b.kind != "layer"]
    all_ops = [op for b in ordered for op in b.ops]

    def first(kind: OpKind) -> Op | None:
        return next((op for op in all_ops if op.kind == kind), None)

    heads = kv_heads = head_dim = seq_len = micro_batch = hidden = vocab = 0
    attn = first(OpKind.ATTENTION)
    if attn is not None:
        heads = int(attn.attr("heads", 0))
        kv_heads = int(attn.attr("kv_heads", heads))
        head_dim = int(attn.attr("head_dim", 0))
        q = attn.inputs[0].shape
        if len(q) == 4:
            micro_batch, seq_len = q[0], q[2]
    emb = first(OpKind.EMBEDDING)
    if emb is not None and len(emb.inputs) >= 2:
        table, idx = emb.inputs[0].shape, emb.inputs[1].shape
        if len(table) == 2:
            vocab, hidden = table
        if not seq_len and len(idx) == 2:
            micro_batch, seq_len = idx
    if not hidden and layer_blocks and layer_blocks[0].inputs:
        hidden = layer_blocks[0].inputs[0].shape[-1]
    if not vocab:
        epi = [op for _, b in graph.blocks if b.kind == "epilogue" for op in b.ops]
        widths = [op.outputs[0].shape[-1] for op in epi if op.kind == OpKind.MATMUL and op.outputs]
        vocab = max(widths, default=0)

    experts = top_k = ffn = 0
    # The most common layer template speaks for the model (DeepSeek's one dense first layer
    # must not hide its 27 MoE layers).
    counts: dict[str, int] = {}
    for u in graph.layer_units:
        counts[u.block] = counts.get(u.block, 0) + 1
    main_key = max(counts, key=lambda k: counts[k]) if counts else None
    first_layer = blocks[main_key] if main_key is not None else None
    if first_layer is not None:
        pshape = {p.name: p.shape for p in first_layer.params}
        for op in first_layer.ops:
            if op.kind == OpKind.ROUTER and op.target.startswith("aten.topk"):
                top_k = top_k or int(op.attr("k", 0))
            if op.kind == OpKind.ROUTER and op.params and op.outputs and not experts:
                experts = op.outputs[0].shape[-1]
        if not experts:
            for op in first_layer.ops:
                if op.kind == OpKind.EXPERTS:
                    shapes = [pshape.get(p, ()) for p in op.params]
                    lead = [s[0] for s in shapes if len(s) == 3]
                    if lead:
                        experts = lead[0]
                        break
        if not experts:
            expert_children = {
                op.module.split("experts.", 1)[1].split(".", 1)[0]
                for op in first_layer.ops
                if op.kind == OpKind.EXPERTS and "experts." in op.module
            }
            experts = len(expert_children)
        if hidden:
            # Attention projections are the GEMMs in the attention op's module subtree; when
            # attention runs in the layer module itself, recognise them by width instead.
            attn_mod = next(
                (op.module for op in first_layer.ops if op.kind == OpKind.ATTENTION), ""
            )
            attn_widths = {heads * head_dim, kv_heads * head_dim, (heads + 2 * kv_heads) * head_dim}
            candidates = []
            skip = (OpKind.ROUTER, OpKind.EMBEDDING, OpKind.NORM, OpKind.ATTENTION)
            for op in first_layer.ops:
                # Not only GEMMs: batched MoE experts gather their weights with `index` first.
                if op.kind in skip:
                    continue
                if attn_mod and (op.module == attn_mod or op.module.startswith(attn_mod + ".")):
                    continue
                for p in op.params:
                    shape = pshape.get(p, ())
                    if len(shape) < 2 or hidden not in shape[-2:]:
                        continue
                    a, b = shape[-2:]
                    other = b if a == hidden else a
                    if other == experts and op.kind != OpKind.EXPERTS:
                        continue
                    if not attn_mod and other in attn_widths | {hidden}:
                        continue  # square or qkv-wide weights may be attention projections
                    candidates.append(other)
            ffn = min(candidates, default=0)

    return ModelInfo(
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=vocab,
        seq_len=seq_len,
        micro_batch=micro_batch,
        experts=experts,
        top_k=top_k,
        layers=len(layer_blocks),
    )
