"""meshplan's operator IR: a typed, immutable description of one training step of a model.

The tracer (`meshplan.ir.trace`) lowers a PyTorch model to this IR once; every later stage
(passes, cost model, planner) reads it and never touches torch again.

Structure, from small to large:

- `TensorMeta`: shape and dtype of one tensor (no data).
- `Op`: one operator of the forward pass (a matmul, an attention, a norm, ...) with the cost of
  its forward and of its share of the backward pass (FLOPs and bytes moved), the activation
  bytes it saves for backward, and the parameters it reads.
- `Block`: the op list of one *template*: a transformer layer, or the non-repeated prologue
  (embedding) or epilogue (final norm, head, loss).
- `Unit`: one step of the model in execution order (`layers.17`), pointing at its template. A
  126-layer model has 128 units but three templates, so analysing it costs about as much as
  analysing one layer. Pipeline stages are contiguous ranges of units.
- `Graph`: units + templates + parameters + inputs, with totals.

Everything is a frozen, slotted dataclass with tuple fields; change values with
`dataclasses.replace`. Costs are exact integers (FLOPs and bytes), never floats.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field

# Bytes per element of the dtypes meshplan understands (names as `str(torch.dtype)` minus the
# "torch." prefix).
DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


class OpKind(enum.StrEnum):
    """What an operator is, as far as cost modelling and sharding care."""

    MATMUL = "matmul"  # mm / addmm / bmm / linear: dense GEMMs (params or activations)
    ATTENTION = "attention"  # fused scaled-dot-product attention
    NORM = "norm"  # layer norm, RMS norm (fused or the elementwise ops inside a norm module)
    SOFTMAX = "softmax"
    ELEMENTWISE = "elementwise"  # activations, adds, muls, rotary embedding, dropout, casts
    EMBEDDING = "embedding"  # table lookup
    ROUTER = "router"  # MoE gating: top-k and the ops that score tokens for experts
    EXPERTS = "experts"  # MoE expert computation (the GEMMs inside an expert module)
    LOSS = "loss"  # cross-entropy and friends
    REDUCTION = "reduction"  # sum / mean / max over dims
    DATA_MOVEMENT = "data_movement"  # copies, cat, gather/scatter, index (bytes, no FLOPs)
    OTHER = "other"


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """Shape and dtype of a tensor; never its data."""

    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"TensorMeta: unknown dtype {self.dtype!r}")
        if any(d < 0 for d in self.shape):
            raise ValueError(f"TensorMeta: negative dimension in shape {self.shape}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


@dataclass(frozen=True, slots=True)
class Param:
    """One parameter tensor of the model, by its fully qualified name (`layers.3.mlp.w1.weight`)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"Param {self.name}: unknown dtype {self.dtype!r}")

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class Op:
    """One forward operator and the backward work that autograd does for it.

    `name` is unique within its Block. `module` is the owning module's path *relative to the
    unit* (e.g. `self_attn.q_proj` inside `layers.3`), so identical layers have identical ops.
    `target` is the aten overload the op was lowered from (`aten.mm.default`), `fx_nodes` the
    tracer's node names it came from, so a plan can be mapped back onto the model.
    `saved_bytes` counts activations autograd keeps for backward (parameters excluded).
    `params` lists parameter names relative to the unit. `attrs` holds op-specific facts as
    sorted (key, value) pairs, e.g. `(("causal", True), ("heads", 32), ("kv_heads", 8))`.
    """

    name: str
    kind: OpKind
    target: str
    module: str
    inputs: tuple[TensorMeta, ...]
    outputs: tuple[TensorMeta, ...]
    fwd_flops: int = 0
    bwd_flops: int = 0
    fwd_bytes: int = 0
    bwd_bytes: int = 0
    saved_bytes: int = 0
    params: tuple[str, ...] = ()
    attrs: tuple[tuple[str, object], ...] = ()
    fx_nodes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for f in ("fwd_flops", "bwd_flops", "fwd_bytes", "bwd_bytes", "saved_bytes"):
            if getattr(self, f) < 0:
                raise ValueError(f"Op {self.name}: {f} is negative")
        if list(self.attrs) != sorted(self.attrs, key=lambda kv: kv[0]):
            raise ValueError(f"Op {self.name}: attrs must be sorted by key")

    def attr(self, key: str, default: object = None) -> object:
        for k, v in self.attrs:
            if k == key:
                return v
        return default


@dataclass(frozen=True, slots=True)
class Block:
    """The ops of one template (a transformer layer, the prologue or the epilogue).

    `params` are the template's parameters with names relative to the unit; `inputs` and
    `outputs` are the activations entering and leaving one instance (the pipeline-stage boundary
    tensors). `kind` is "layer" for repeated blocks, "prologue" / "epilogue" otherwise.
    """

    key: str
    kind: str
    ops: tuple[Op, ...]
    params: tuple[Param, ...]
    inputs: tuple[TensorMeta, ...] = ()
    outputs: tuple[TensorMeta, ...] = ()

    def __post_init__(self) -> None:
        names = [op.name for op in self.ops]
        if len(names) != len(set(names)):
            raise ValueError(f"Block {self.key}: duplicate op names")
        if self.kind not in ("layer", "prologue", "epilogue"):
            raise ValueError(f"Block {self.key}: kind must be layer/prologue/epilogue")

    @property
    def fwd_flops(self) -> int:
        return sum(op.fwd_flops for op in self.ops)

    @property
    def bwd_flops(self) -> int:
        return sum(op.bwd_flops for op in self.ops)

    @property
    def fwd_bytes(self) -> int:
        return sum(op.fwd_bytes for op in self.ops)

    @property
    def bwd_bytes(self) -> int:
        return sum(op.bwd_bytes for op in self.ops)

    @property
    def saved_bytes(self) -> int:
        return sum(op.saved_bytes for op in self.ops)

    @property
    def num_params(self) -> int:
        return sum(p.numel for p in self.params)

    @property
    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def ops_of(self, *kinds: OpKind) -> tuple[Op, ...]:
        return tuple(op for op in self.ops if op.kind in kinds)


@dataclass(frozen=True, slots=True)
class Unit:
    """One step of the model in execution order: a module path and the template it instantiates."""

    name: str  # module path of the instance, e.g. "model.layers.17", or "<prologue>"
    block: str  # key into Graph.blocks


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """Architecture facts the planner needs for divisibility, read off the traced ops.

    Zero means "not found" (e.g. `experts` of a dense model). `no_sequence_sharding`: why the
    model cannot run on a share of each sequence (sequence parallelism shards the hidden
    state over tp, context parallelism the tokens over cp), "" when it can; set by the tracer
    (`trace.sequence_sharding_blocker`: HuggingFace models whose positions the runtime cannot
    give), read by the planner, which then keeps both off. `blockers`: (dimension, reason)
    pairs, sorted, for every parallel dimension the runtime cannot run on this model
    (`ir.facts`, set by the tracer); the planner never plans them. `assumptions`: what the
    tracer had to assume about the data to give the step a shape, one sentence each (an MoE's
    data-dependent expert dispatch priced at its balanced load, `trace`); plans print them
    among their notes.
    """

    hidden: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    ffn: int = 0
    vocab: int = 0
    seq_len: int = 0
    micro_batch: int = 0
    experts: int = 0
    top_k: int = 0
    layers: int = 0
    no_sequence_sharding: str = ""
    blockers: tuple[tuple[str, str], ...] = ()
    # Module paths of nn.Embedding tables of learned positions looked up with 0..n-1 (the
    # runtime looks them up with a rank's positions under context parallelism).
    position_tables: tuple[str, ...] = ()
    assumptions: tuple[str, ...] = ()

    def blocker(self, dim: str) -> str:
        """Why the runtime cannot run parallel dimension `dim` ("tp", "sp", "cp", "pp",
        "ep", or "zb": the ZB-V schedule) on this model, or "" (`ir.facts`; sequence
        sharding's own reason counts for "sp" and "cp")."""
        for d, why in self.blockers:
            if d == dim:
                return why
        if dim in ("sp", "cp") and self.no_sequence_sharding:
            return self.no_sequence_sharding
        return ""


@dataclass(frozen=True, slots=True)
class Graph:
    """One training step (forward + backward) of a model at one micro-batch shape.

    `units` are in execution order; `blocks` maps template keys to their op lists. Costs are
    for one micro-batch of `info.micro_batch` sequences of `info.seq_len` tokens.
    """

    name: str
    inputs: tuple[TensorMeta, ...]
    units: tuple[Unit, ...]
    blocks: tuple[tuple[str, Block], ...]
    params: tuple[Param, ...]
    info: ModelInfo = field(default_factory=ModelInfo)

    def __post_init__(self) -> None:
        keys = [k for k, _ in self.blocks]
        if len(keys) != len(set(keys)):
            raise ValueError(f"Graph {self.name}: duplicate block keys")
        known = set(keys)
        for u in self.units:
            if u.block not in known:
                raise ValueError(f"Graph {self.name}: unit {u.name} names unknown block {u.block}")

    # -- lookup -----------------------------------------------------------------------------
    def block(self, key: str) -> Block:
        for k, b in self.blocks:
            if k == key:
                return b
        raise KeyError(key)

    def unit_blocks(self) -> Iterator[tuple[Unit, Block]]:
        lookup = dict(self.blocks)
        for u in self.units:
            yield u, lookup[u.block]

    @property
    def layer_units(self) -> tuple[Unit, ...]:
        lookup = dict(self.blocks)
        return tuple(u for u in self.units if lookup[u.block].kind == "layer")

    # -- totals -----------------------------------------------------------------------------
    def num_params(self) -> int:
        """Exact number of parameter elements (shared/tied parameters counted once)."""
        return sum(p.numel for p in self.params)

    def param_bytes(self) -> int:
        return sum(p.nbytes for p in self.params)

    def total_flops(self, training: bool = True) -> int:
        """FLOPs of one micro-batch: forward only, or forward + backward when `training`."""
        total = 0
        for _, b in self.unit_blocks():
            total += b.fwd_flops + (b.bwd_flops if training else 0)
        return total

    def saved_activation_bytes(self) -> int:
        return sum(b.saved_bytes for _, b in self.unit_blocks())

    def tokens(self) -> int:
        return self.info.micro_batch * self.info.seq_len

    def fingerprint(self) -> str:
        """A stable hash of the graph's structure and costs (plans record it)."""
        h = hashlib.sha256()
        h.update(json.dumps(to_dict(self), sort_keys=True).encode())
        return h.hexdigest()[:16]

    def summary(self) -> str:
        n_layers = len(self.layer_units)
        return (
            f"{self.name}: {self.num_params() / 1e9:.3f}B params, {len(self.units)} units "
            f"({n_layers} layers) over {len(self.blocks)} templates, "
            f"{self.total_flops() / 1e12:.2f} TFLOP per micro-batch step"
        )


def to_dict(obj: object) -> object:
    """Plain JSON-able form of any IR value (used for fingerprints and debugging dumps)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (tuple, list)):
        return [to_dict(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): to_dict(v) for k, v in obj.items()}
    return obj
