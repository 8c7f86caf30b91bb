"""AGoQ-style quantization: saved activations at per-layer bit widths, 8-bit gradient sync.

Design inputs, from AGoQ (Lin et al., "AGoQ: Activation and Gradient Quantization for
Memory-Efficient Distributed Training of LLMs", arXiv 2605.00539, 2026): (1) layer-aware
activation quantization, a bit width per layer chosen by layer type and pipeline stage, about
4 bits on average, more bits for sensitive tensors (softmax/norm inputs), fewer on early 1F1B
stages because they hold the most micro-batches in flight; (2) 8-bit gradients with a
precision-preserving all-reduce (block-scaled int8, reduced in higher precision). AGoQ
reports up to 52% less memory and unchanged convergence.

Pieces:

- `quantize` / `dequantize`: symmetric block-scaled integers, `block` (default 64) values per
  scale, the scale stored in bf16 (fp32's range: gradients of 1e-9 keep their scale; the
  integers are computed from the stored scale, so its rounding costs no accuracy). 8 bits:
  int8 in [-127, 127]; 4 bits: [-7, 7] packed two per byte. Cost per value: bits + 16/64.
- `agoq_bits(kind, stage, num_stages)` and `agoq_plan(model, ...)`: the per-layer widths.
- `ActivationQuantizer(model, bits)`: a context manager installing
  `torch.autograd.graph.saved_tensors_hooks` whose pack hook quantizes each saved tensor at
  the width of the innermost module (by path) that saved it. Parameters, buffers, integer
  tensors, small tensors and per-row statistics stay exact (see `ActivationQuantizer`).
  `SavedTensorStats` measures the bytes held for backward with and without it.
- `quantized_all_reduce` / `quantized_reduce_scatter`: int8 block-scaled gradient sync with
  fp32 accumulation; `quantized_allreduce_hook` (DDP comm hook) and
  `QuantizedReduceScatter` (FSDP2 `set_custom_reduce_scatter`) wrap them. On gloo (see
  docs/torch_notes.md), hooks run their collectives synchronously and return a completed
  Future.

The precision-preserving all-reduce: every rank quantizes its gradient per destination
shard; an all-to-all delivers rank j's shard from every rank; rank j dequantizes them and
sums in fp32 in rank order (the only rounding is each sender's one quantization); the
reduced shard is quantized once more and all-gathered, and every rank dequantizes the same
bytes, so all ranks end with identical gradients. `simulate_quantized_all_reduce` computes
the same bits in one process (tests and single-process training runs use it).
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from .compressed import _ddp_hook
from .mesh import RankContext
from .steps import Chunks, Options

__all__ = [
    "DEFAULT_BLOCK",
    "ActivationQuantizer",
    "QuantHookState",
    "Quantized",
    "QuantizedReduceScatter",
    "SavedTensorStats",
    "agoq_bits",
    "agoq_plan",
    "dequantize",
    "layer_kind",
    "measure_saved_bytes",
    "quantize",
    "quantized_all_reduce",
    "quantized_allreduce_hook",
    "quantized_reduce_scatter",
    "simulate_quantized_all_reduce",
]

DEFAULT_BLOCK = 64
"""Values per scale. 64 keeps an outlier's damage local (it only coarsens its own 64
neighbours) at 16/64 = 0.25 bits of scale per value."""

_SUPPORTED_BITS = (4, 8)


# -- block quantization ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Quantized:
    """A block-scaled integer copy of a tensor. `data`: int8 (8 bits) or uint8 holding two
    4-bit values per byte; `scales`: bf16, one per block."""

    data: torch.Tensor
    scales: torch.Tensor
    bits: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    block: int

    @property
    def nbytes(self) -> int:
        """Bytes held: integers plus scales."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * 2

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def _block_scale(x_bv: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-block scale absmax / qmax, rounded to bf16; all-zero blocks get scale 0."""
    lo, hi = torch.aminmax(x_bv, dim=1, keepdim=True)  # one pass, no |x| temporary
    return (torch.maximum(hi, -lo) / _qmax(bits)).to(torch.bfloat16)


def quantize(x: torch.Tensor, bits: int = 8, block: int = DEFAULT_BLOCK) -> Quantized:
    """Symmetric block-scaled quantization of a floating tensor to 4 or 8 bits.

    Rounds to nearest (ties to even) using the stored bf16 scale; infinities and NaN make
    their block NaN (a diverged run, not something to preserve)."""
    if bits not in _SUPPORTED_BITS:
        raise ValueError(f"quantize: bits must be one of {_SUPPORTED_BITS}, got {bits}")
    if block % 2:
        raise ValueError(f"quantize: block must be even, got {block}")
    n = x.numel()
    nb = max(1, (n + block - 1) // block)
    flat = x.detach().reshape(-1).float()
    if nb * block != n:
        flat = torch.nn.functional.pad(flat, (0, nb * block - n))
    x_bv = flat.view(nb, block)
    scales = _block_scale(x_bv, bits)
    s32 = scales.float()
    q = x_bv * torch.where(s32 == 0, 1.0, s32).reciprocal()
    q.round_().clamp_(-_qmax(bits), _qmax(bits))
    if bits == 8:
        data = q.to(torch.int8).view(-1)
    else:  # offset to 1..15 and pack pairs: low nibble first
        u = q.add_(8).to(torch.uint8).view(-1, 2)
        data = u[:, 0] | (u[:, 1] << 4)
    return Quantized(data, scales.view(-1), bits, tuple(x.shape), x.dtype, block)


def dequantize(q: Quantized) -> torch.Tensor:
    """The tensor `q` approximates, in its original dtype and shape (contiguous)."""
    s = q.scales.float().view(-1, 1)
    if q.bits == 8:
        x = q.data.view(-1, q.block) * s
    else:
        ints = torch.empty(q.data.numel(), 2, dtype=torch.uint8, device=q.data.device)
        torch.bitwise_and(q.data, 0xF, out=ints[:, 0])
        torch.bitwise_right_shift(q.data, 4, out=ints[:, 1])
        x = torch.addcmul(s * -8, ints.view(-1, q.block), s)  # (ints - 8) * s in one op
    return x.view(-1)[: q.numel].to(q.dtype).view(q.shape)


# -- per-layer bit widths -------------------------------------------------------------------

_KIND_PATTERNS = (
    # (kind, class-name regex): our zoo, torch norms and Hugging Face Llama/Mixtral names.
    ("norm", re.compile(r"Norm", re.I)),
    ("attention", re.compile(r"Attention|SelfAttn", re.I)),
    ("mlp", re.compile(r"MLP|MoE|Expert|FeedForward|SparseMoeBlock", re.I)),
)


def layer_kind(path: str, module: nn.Module) -> str | None:
    """The AGoQ layer kind of a module: "attention", "mlp", "norm", "embedding", "head",
    or None for modules that inherit their parent's width (Linear inside a block, ...)."""
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, nn.Linear):
        name = path.rsplit(".", 1)[-1]
        return "head" if name in ("lm_head", "output", "head") else None
    cls = type(module).__name__
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(cls):
            return kind
    return None


def agoq_bits(kind: str, stage: int = 0, num_stages: int = 1) -> int | None:
    """Saved-activation bit width of a layer of `kind` on pipeline `stage` of `num_stages`
    (None: keep full precision).

    From AGoQ: ~4 bits on average; sensitive tensors keep more; early 1F1B
    stages, which hold the most micro-batches, gain most from fewer bits. Concretely:

    - "norm" (norm inputs) and "head" (the logits feeding softmax/cross-entropy): 8 bits.
    - "mlp": 4 bits on every stage (the bulk of the activations, robust to quantization).
    - "attention" (q, k, v, the attention output and projection inputs): 4 bits on stages
      holding more than half the first stage's micro-batches in flight (stage s of p holds
      p - s under 1F1B), 8 bits on the later stages, where the extra bits cost least memory.
    - "embedding": None (it saves only token indices).
    - anything else: 8 bits.
    """
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"agoq_bits: stage {stage} out of range for {num_stages} stages")
    if kind in ("norm", "head"):
        return 8
    if kind == "mlp":
        return 4
    if kind == "attention":
        in_flight = num_stages - stage
        return 4 if 2 * in_flight > num_stages else 8
    if kind == "embedding":
        return None
    return 8


def agoq_plan(model: nn.Module, *, stage: int = 0, num_stages: int = 1) -> dict[str, int | None]:
    """Module path -> bits for every module with a layer kind (see `layer_kind`), plus the
    root "" as "head": tensors the model saves outside its blocks (the final logits'
    softmax) count as sensitive."""
    plan: dict[str, int | None] = {"": agoq_bits("head", stage, num_stages)}
    for path, module in model.named_modules():
        kind = layer_kind(path, module) if path else None
        if kind is not None:
            plan[path] = agoq_bits(kind, stage, num_stages)
    return plan


# -- saved-tensor hooks ---------------------------------------------------------------------


@dataclass
class SavedTensorStats:
    """Bytes held for backward by the forward passes run under an `ActivationQuantizer`.

    `held_bytes` counts each quantized copy once and each exact storage once (views of one
    storage share it), parameters and buffers excluded (held anyway). Run the same forward
    with `bits=None` for the unquantized baseline: its `held_bytes` is the original size
    and its `bf16_bytes` the same values at 2 bytes each (a bf16-training baseline)."""

    held_bytes: int = 0
    bf16_bytes: int = 0
    quantized: int = 0
    kept: int = 0
    by_bits: dict[int, int] = field(default_factory=dict)
    _storages: dict = field(default_factory=dict, repr=False)  # ptr -> weakref
    _packed: set = field(default_factory=set, repr=False)

    def _storage(self, t: torch.Tensor) -> None:
        # Keyed by address plus a weak reference to the tensor (kept tensors stay alive in
        # the graph, so a dead reference means the address was reused by a new storage).
        key = t.untyped_storage().data_ptr()
        ref = self._storages.get(key)
        if ref is not None and ref() is not None:
            return
        self._storages[key] = weakref.ref(t)
        nbytes = t.untyped_storage().nbytes()
        self.held_bytes += nbytes
        self.bf16_bytes += nbytes // t.element_size() * 2 if t.is_floating_point() else nbytes
        self.kept += 1

    def _quantized(self, q: Quantized) -> None:
        if id(q) in self._packed:
            return
        self._packed.add(id(q))
        self.held_bytes += q.nbytes
        self.bf16_bytes += q.nbytes
        self.quantized += 1
        self.by_bits[q.bits] = self.by_bits.get(q.bits, 0) + q.nbytes


def measure_saved_bytes(
    model: nn.Module, bits: Mapping[str, int | None] | int | None, *inputs, **kwargs
) -> SavedTensorStats:
    """Run `model(*inputs)` once under `ActivationQuantizer(model, bits, **kwargs)` and
    return the bytes it saved for backward (the graph is then dropped)."""
    stats = SavedTensorStats()
    with ActivationQuantizer(model, bits, stats=stats, **kwargs):
        out = model(*inputs)
    del out
    return stats


class ActivationQuantizer:
    """Context manager: inside it, tensors that `model`'s forward saves for backward are
    stored block-quantized at the width of the innermost module that saved them.

    `bits` maps module paths (as in `named_modules`, "" for the root) to 4, 8 or None (keep
    exact); modules not listed inherit from their parent; an int applies to the whole
    model. Use `agoq_plan(model, stage=, num_stages=)` for AGoQ's widths.

    Kept exact, whatever the width:
    - parameters and buffers (held anyway; quantizing them would only corrupt gradients),
    - integer/bool tensors, and tensors under `min_numel` values,
    - tensors smaller than 1/`stat_ratio` of the saving module's input: per-row statistics
      such as the softmax log-sum-exp of attention (1/head_dim of q), a norm's rstd or a
      router's probabilities, which are tiny and the most sensitive.

    A tensor saved by several ops (one input feeding q, k and v projections) is quantized
    once. Pass `stats` to measure the bytes held; `ActivationQuantizer(model, None,
    stats=s)` measures the unquantized baseline with the same accounting.
    """

    def __init__(
        self,
        model: nn.Module,
        bits: Mapping[str, int | None] | int | None,
        *,
        block: int = DEFAULT_BLOCK,
        min_numel: int = 1024,
        stat_ratio: int = 8,
        stats: SavedTensorStats | None = None,
    ) -> None:
        if isinstance(bits, int) or bits is None:
            bits = {"": bits}
        for path, b in bits.items():
            if b is not None and b not in _SUPPORTED_BITS:
                raise ValueError(f"ActivationQuantizer: {path!r}: bits must be 4, 8 or None")
        modules = dict(model.named_modules())
        unknown = [p for p in bits if p not in modules]
        if unknown:
            raise ValueError(f"ActivationQuantizer: no module at {unknown}")
        self.model, self.bits, self.block = model, dict(bits), block
        self.min_numel, self.stat_ratio, self.stats = min_numel, stat_ratio, stats
        self._modules = modules
        self._stack: list[tuple[int | None, int]] = []
        self._held: set[int] = set()
        self._handles: list = []
        self._hooks_ctx = None
        self._cache: dict = {}

    # Forward hooks on every module keep a stack of (bits, input numel) of the modules being
    # run: listed modules push their width, the others inherit their parent's, and the
    # innermost module's input size is the yardstick of the per-row-statistics rule.
    def _push(self, path: str):
        def pre(module, args):
            if path in self.bits:
                bits = self.bits[path]
            else:
                bits = self._stack[-1][0] if self._stack else self.bits.get("")
            ref = next((_local(a).numel() for a in args if isinstance(a, torch.Tensor)), 0)
            self._stack.append((bits, ref))

        return pre

    def _pop(self, module, args, output):
        if self._stack:
            self._stack.pop()

    def _pack(self, saved: torch.Tensor):
        # A DTensor (tensor parallelism) is quantized as its local shard and rebuilt with its
        # spec; every rule below reads the local tensor.
        t = _local(saved)
        exact = (
            not t.is_floating_point()
            or t.numel() < self.min_numel
            or _is_parameter(saved)
            or t.untyped_storage().data_ptr() in self._held
        )
        bits, ref = self._stack[-1] if self._stack else (self.bits.get(""), 0)
        if not exact and (bits is None or t.numel() * self.stat_ratio < ref):
            exact = True
        if exact:
            if self.stats is not None and t.untyped_storage().data_ptr() not in self._held:
                self.stats._storage(t)
            return saved
        key = (
            t.untyped_storage().data_ptr(),
            t.storage_offset(),
            tuple(t.shape),
            t.stride(),
            t.dtype,
            t._version,
            bits,
        )
        hit = self._cache.get(key)
        if hit is not None and hit[0]() is not None:
            q = hit[1]
        else:
            q = quantize(t, bits, self.block)
            self._cache[key] = (weakref.ref(t), q)
        if self.stats is not None:
            self.stats._quantized(q)
        if saved is not t:  # a DTensor: keep its spec to rebuild it
            return (q, saved._spec)
        return q

    @staticmethod
    def _unpack(obj):
        if isinstance(obj, tuple):  # (Quantized local shard, DTensorSpec)
            from torch.distributed.tensor import DTensor

            return DTensor(dequantize(obj[0]), obj[1], requires_grad=False)
        return dequantize(obj) if isinstance(obj, Quantized) else obj

    def __enter__(self) -> ActivationQuantizer:
        self._held = {
            _local(t).untyped_storage().data_ptr()
            for t in (*self.model.parameters(), *self.model.buffers())
        }
        for path, m in self._modules.items():
            self._handles.append(m.register_forward_pre_hook(self._push(path)))
            self._handles.append(m.register_forward_hook(self._pop, always_call=True))
        self._hooks_ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks_ctx.__exit__(*exc)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stack.clear()
        self._cache.clear()  # packed objects live on in the autograd graph


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding `t`'s data on this rank: a DTensor's local shard, with a
    functional collective's pending result (`AsyncCollectiveTensor`, a wrapper without
    storage) waited for."""
    t = getattr(t, "_local_tensor", t)
    wait = getattr(t, "trigger_wait", None)
    return wait() if wait is not None else t


def _is_parameter(t: torch.Tensor) -> bool:
    """A parameter or a view of one (`weight.t()` saved by a linear): held anyway. FSDP2's
    unsharded parameters are new Parameter objects gathered for forward, so the set of
    storages `__enter__` records cannot know them."""
    return isinstance(t, nn.Parameter) or isinstance(getattr(t, "_base", None), nn.Parameter)


def quantize_saved_activations(
    module: nn.Module, bits: Mapping[str, int | None] | int
) -> ActivationQuantizer:
    """Run every forward of `module` under an `ActivationQuantizer` with `bits` (module path
    -> width, e.g. `plan_activation_bits`), by wrapping its `forward` (wrappers applied
    later, DDP or FSDP2, call it as before; parameter names do not change). Returns the
    quantizer (`.stats` may be set to measure)."""
    quantizer = ActivationQuantizer(module, bits)
    inner = module.forward

    def forward(*args, **kwargs):
        with quantizer:
            return inner(*args, **kwargs)

    module.forward = forward
    return quantizer


# -- 8-bit gradient synchronisation ---------------------------------------------------------


def _pad_to(flat: torch.Tensor, multiple: int) -> torch.Tensor:
    extra = -flat.numel() % multiple
    return torch.nn.functional.pad(flat, (0, extra)) if extra else flat


def _to_bytes(q: Quantized) -> torch.Tensor:
    return torch.cat([q.data.view(torch.uint8), q.scales.view(torch.uint8)])


def _from_bytes(buf: torch.Tensor, numel: int, bits: int, block: int) -> Quantized:
    ndata = numel * bits // 8
    data = buf[:ndata].view(torch.int8) if bits == 8 else buf[:ndata]
    scales = buf[ndata:].clone().view(torch.bfloat16)  # clone: bf16 view needs alignment
    return Quantized(data, scales, bits, (numel,), torch.float32, block)


def _reduce_dequantized(qs: Sequence[Quantized], op: str) -> torch.Tensor:
    """fp32 sum in rank order of dequantized shards (the only rounding was quantization)."""
    acc = dequantize(qs[0]).float().clone()
    for q in qs[1:]:
        acc.add_(dequantize(q))
    if op == "avg":
        acc.div_(len(qs))
    return acc


def _check_op(op: str) -> None:
    if op not in ("sum", "avg"):
        raise ValueError(f"quantized reduction: op must be 'sum' or 'avg', got {op!r}")


def simulate_quantized_all_reduce(
    tensors: Sequence[torch.Tensor], *, bits: int = 8, block: int = DEFAULT_BLOCK, op: str = "avg"
) -> torch.Tensor:
    """What `quantized_all_reduce` returns on every rank when rank r holds `tensors[r]`,
    computed in one process (same bits)."""
    _check_op(op)
    ws = len(tensors)
    flats = [_pad_to(t.detach().reshape(-1).float(), ws * block) for t in tensors]
    shards = []
    for j in range(ws):
        qs = [quantize(f.view(ws, -1)[j], bits, block) for f in flats]
        shards.append(dequantize(quantize(_reduce_dequantized(qs, op), bits, block)))
    n = tensors[0].numel()
    return torch.cat(shards)[:n].to(tensors[0].dtype).view(tensors[0].shape)


def quantized_reduce_scatter(
    tensor: torch.Tensor,
    group=None,
    *,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    op: str = "avg",
) -> torch.Tensor:
    """Rank j gets the fp32 reduction of every rank's shard j (`tensor` flattened, padded
    to ws*block and cut in ws equal shards), as fp32; each shard crossed the wire as
    block-scaled integers (bits + 16/block bits per value)."""
    _check_op(op)
    ws = dist.get_world_size(group)
    flat = _pad_to(tensor.detach().reshape(-1).float(), ws * block)
    shard = flat.numel() // ws
    sends = [_to_bytes(quantize(s, bits, block)) for s in flat.view(ws, shard)]
    per = sends[0].numel()
    recv = torch.empty(ws * per, dtype=torch.uint8, device=tensor.device)
    dist.all_to_all_single(recv, torch.cat(sends), group=group)
    qs = [_from_bytes(b, shard, bits, block) for b in recv.view(ws, per)]
    return _reduce_dequantized(qs, op)


def quantized_all_reduce(
    tensor: torch.Tensor,
    group=None,
    *,
    bits: int = 8,
    block: int = DEFAULT_BLOCK,
    op: str = "avg",
) -> torch.Tensor:
    """Precision-preserving low-bit all-reduce (AGoQ): quantized reduce-scatter with fp32
    accumulation, the reduced shard quantized once more and all-gathered. Returns a new
    tensor of `tensor`'s dtype and shape, identical on every rank and equal to
    `simulate_quantized_all_reduce`. Traffic ~ 2 (ws-1)/ws (bits + 16/block) bits a value
    against 2 (ws-1)/ws 32 for an fp32 ring all-reduce."""
    ws = dist.get_world_size(group)
    reduced = quantized_reduce_scatter(tensor, group, bits=bits, block=block, op=op)
    mine = _to_bytes(quantize(reduced, bits, block))
    gathered = [torch.empty_like(mine) for _ in range(ws)]  # equal sizes: list form is fine
    dist.all_gather(gathered, mine, group=group)
    shard = reduced.numel()
    out = torch.cat([dequantize(_from_bytes(b, shard, bits, block)) for b in gathered])
    return out[: tensor.numel()].to(tensor.dtype).view(tensor.shape)


@dataclass(frozen=True, slots=True)
class QuantHookState:
    """State of `quantized_allreduce_hook`: the process group and the format."""

    group: dist.ProcessGroup | None = None
    bits: int = 8
    block: int = DEFAULT_BLOCK


@_ddp_hook
def quantized_allreduce_hook(
    state: QuantHookState | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket with `quantized_all_reduce`.

    Register with `ddp.register_comm_hook(QuantHookState(), quantized_allreduce_hook)`.
    The collectives run synchronously and the Future is returned completed (gloo, see
    docs/torch_notes.md: async hook futures are where the built-in hooks break)."""
    state = state or QuantHookState()
    buf = bucket.buffer()
    buf.copy_(quantized_all_reduce(buf, state.group, bits=state.bits, block=state.block, op="avg"))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(buf)
    return fut


try:  # FSDP2's extension point (torch >= 2.9)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter as _ReduceScatter
except ImportError:  # pragma: no cover
    _ReduceScatter = object


class QuantizedReduceScatter(_ReduceScatter):
    """FSDP2 gradient reduce-scatter with int8 block-scaled traffic and fp32 accumulation:
    `fsdp_module.set_custom_reduce_scatter(QuantizedReduceScatter())`.

    FSDP2 passes a flat input of ws * shard values and wants the reduced shard in
    `output_tensor`; with fp32/bf16 gradients it asks for AVG, otherwise SUM with its own
    pre/post division."""

    def __init__(self, bits: int = 8, block: int = DEFAULT_BLOCK) -> None:
        self.bits, self.block = bits, block

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op == dist.ReduceOp.AVG:
            name = "avg"
        elif op == dist.ReduceOp.SUM:
            name = "sum"
        else:
            raise NotImplementedError(f"QuantizedReduceScatter: reduce op {op} not supported")
        ws = dist.get_world_size(group)
        shard = input_tensor.numel() // ws
        # Quantize each rank's shard on its own (pad per shard), so shard j stays shard j.
        parts = input_tensor.view(ws, shard)
        padded = torch.stack([_pad_to(p.float(), self.block) for p in parts])
        out = quantized_reduce_scatter(padded, group, bits=self.bits, block=self.block, op=name)
        output_tensor.copy_(out[:shard].view_as(output_tensor))
        return None


# -- reading a plan's decisions ---------------------------------------------------------------


def plan_activation_bits(plan, model: nn.Module, stage: int = 0) -> dict[str, int | None] | None:
    """Module path -> bits for `model` on pipeline stage `stage` of `plan` (the widths the
    planner recorded per layer kind, `plan.quantization.activation_bits`), or None when the
    plan keeps activations exact. Modules are classified by `layer_kind`."""
    per_stage = dict(plan.quantization.activation_bits).get(stage)
    if not per_stage:
        return None
    kinds = dict(per_stage)
    bits: dict[str, int | None] = {"": kinds.get("head", 8)}
    for path, module in model.named_modules():
        kind = layer_kind(path, module) if path else None
        if kind is not None:
            bits[path] = kinds.get(kind, kinds.get("other", 8))
    return bits


def apply_activation_quantization(chunks: Chunks, ctx: RankContext, options: Options) -> None:
    """Run each chunk's forward under an `ActivationQuantizer` with the plan's widths for this
    rank's stage (`plan_activation_bits`; nothing when the plan keeps activations exact).
    Inside checkpointed units recomputation saves nothing to quantize."""
    for chunk in chunks:
        bits = plan_activation_bits(ctx.plan, chunk.module, ctx.stage_index)
        if bits:
            quantize_saved_activations(chunk.module, bits)
    return None


__all__ += [
    "apply_activation_quantization",
    "plan_activation_bits",
    "quantize_saved_activations",
]
