"""A reference decoder-only transformer covering the configs meshplan is asked to plan.

One module, configured by `TransformerConfig`, builds GPT-3 style models (LayerNorm, GELU MLP,
learned positions, biases, tied embeddings) and Llama/Mixtral/DeepSeek style models (RMSNorm,
SwiGLU, RoPE, grouped-query attention, optional mixture of experts).

The MoE layer uses static-shape, capacity-based dispatch (GShard / Switch Transformer): every
expert processes `capacity` token slots, tokens beyond an expert's capacity are dropped, and
gather/scatter move tokens in and out. Static shapes let the model trace on fake tensors (no
data-dependent sizes) and run unchanged under expert parallelism. With `capacity_factor=1`
and balanced routing each token does exactly `top_k` experts' worth of FLOPs.

`forward(tokens, targets)` returns the mean next-token cross-entropy, so one call is one
training micro-batch and `loss.backward()` is the rest of the step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, slots=True)
class TransformerConfig:
    """Architecture of a decoder-only transformer. `ffn` is the MLP inner width (per expert
    for MoE layers); `dense_ffn` the inner width of the first `dense_layers` layers of an MoE
    model (DeepSeek keeps its first layer dense)."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int
    kv_heads: int | None = None
    seq_len: int = 2048
    experts: int = 0
    top_k: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    dense_ffn: int | None = None
    capacity_factor: float = 1.0
    style: str = "llama"  # "llama": RMSNorm/SwiGLU/RoPE; "gpt": LayerNorm/GELU/learned pos
    tie_embeddings: bool = False
    rope_theta: float = 500000.0  # Llama 3 (Meta, "The Llama 3 Herd of Models", 2024)
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "ffn", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer: {name} must be >= 1, got {getattr(self, name)}")
        if self.hidden % self.heads:
            raise ValueError(
                f"transformer: hidden ({self.hidden}) must be divisible by heads ({self.heads})"
            )
        if self.heads % self.num_kv_heads:
            raise ValueError(
                f"transformer: heads ({self.heads}) must be divisible by kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.style not in ("llama", "gpt"):
            raise ValueError(f"transformer: style must be 'llama' or 'gpt', got {self.style!r}")
        if self.experts:
            if not 1 <= self.top_k <= self.experts:
                raise ValueError(
                    f"transformer: top_k must be in [1, experts={self.experts}], got {self.top_k}"
                )
            if self.dense_layers >= self.layers:
                raise ValueError("transformer: dense_layers must be fewer than layers")
        elif self.top_k or self.shared_experts or self.dense_layers:
            raise ValueError("transformer: top_k/shared_experts/dense_layers need experts > 0")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        """Parameter count by formula (an oracle for the tracer's count)."""
        h, d, kv = self.hidden, self.head_dim, self.num_kv_heads
        bias = self.style == "gpt"
        attn = h * h + 2 * h * kv * d + h * h + (h + 2 * kv * d + h if bias else 0)
        norm = 2 * h if self.style == "gpt" else h

        def mlp(inner: int) -> int:
            if self.style == "gpt":
                return 2 * h * inner + inner + h
            return 3 * h * inner

        total = 0
        for i in range(self.layers):
            total += attn + 2 * norm
            if self.experts and i >= self.dense_layers:
                total += h * self.experts  # router
                total += self.experts * mlp(self.ffn) + self.shared_experts * mlp(self.ffn)
            else:
                total += mlp(self.dense_ffn or self.ffn)
        total += self.vocab * h  # embedding
        if self.style == "gpt":
            total += self.seq_len * h  # learned positions
        total += norm  # final norm
        if not self.tie_embeddings:
            total += self.vocab * h
        return total


# -- building blocks ------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 as Llama does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None):
    """cos/sin tables of rotary embeddings (Su et al. 2021), shape (seq, head_dim/2). On the
    meta device only their shapes exist (and torch would run the arithmetic through its
    Python references, whose wrapper imports torch._dynamo: ~1 s)."""
    on = torch.device(device) if device is not None else torch.get_default_device()
    if on.type == "meta":
        shape = (seq_len, head_dim // 2)
        return (torch.empty(shape, device=on, dtype=torch.float32),
                torch.empty(shape, device=on, dtype=torch.float32))  # fmt: skip
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x_bhsd: torch.Tensor, cos_sd: torch.Tensor, sin_sd: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of each head dimension by position-dependent angles."""
    half = x_bhsd.shape[-1] // 2
    x1, x2 = x_bhsd[..., :half], x_bhsd[..., half:]
    cos = cos_sd.to(x_bhsd.dtype)
    sin = sin_sd.to(x_bhsd.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """Multi-head attention with grouped-query K/V heads and a causal mask."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        bias = cfg.style == "gpt"
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=bias)
        self.use_rope = cfg.style == "llama"

    def forward(self, x_bsh: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        b, s, _ = x_bsh.shape
        q = self.q_proj(x_bsh).view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_bsh).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_bsh).view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        if self.use_rope and rope is not None:
            cos, sin = rope[0][:s], rope[1][:s]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020) for Llama style; GELU MLP for GPT style."""

    def __init__(self, hidden: int, inner: int, style: str) -> None:
        super().__init__()
        self.style = style
        bias = style == "gpt"
        self.up_proj = nn.Linear(hidden, inner, bias=bias)
        if style == "llama":
            self.gate_proj = nn.Linear(hidden, inner, bias=False)
        self.down_proj = nn.Linear(inner, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(F.gelu(self.up_proj(x), approximate="tanh"))


class Router(nn.Module):
    """Top-k softmax gating: scores each token for each expert."""

    def __init__(self, hidden: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(hidden, experts, bias=False)

    def forward(self, x_th: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs_te = F.softmax(self.gate(x_th).float(), dim=-1)
        weights_tk, experts_tk = torch.topk(probs_te, self.top_k, dim=-1)
        weights_tk = weights_tk / weights_tk.sum(-1, keepdim=True)
        return weights_tk.to(x_th.dtype), experts_tk


class MoEExperts(nn.Module):
    """`experts` SwiGLU (or GELU) MLPs stored as stacked weights, run as batched GEMMs.

    Stacked weights (expert dim first) are what expert parallelism shards.
    """

    def __init__(self, experts: int, hidden: int, inner: int, style: str) -> None:
        super().__init__()
        self.style = style

        # N(0, 1/fan_in) drawn by nn.init (skipped on the meta device: `models.SkipInitOnMeta`)
        def normal(*shape: int) -> nn.Parameter:
            return nn.Parameter(nn.init.normal_(torch.empty(shape), std=shape[1] ** -0.5))

        self.w_up = normal(experts, hidden, inner)
        if style == "llama":
            self.w_gate = normal(experts, hidden, inner)
        else:
            self.b_up = nn.Parameter(torch.zeros(experts, 1, inner))
            self.b_down = nn.Parameter(torch.zeros(experts, 1, hidden))
        self.w_down = normal(experts, inner, hidden)

    def forward(self, x_ech: torch.Tensor) -> torch.Tensor:
        if self.style == "llama":
            act = F.silu(torch.bmm(x_ech, self.w_gate)) * torch.bmm(x_ech, self.w_up)
            return torch.bmm(act, self.w_down)
        act = F.gelu(torch.bmm(x_ech, self.w_up) + self.b_up, approximate="tanh")
        return torch.bmm(act, self.w_down) + self.b_down


class MoE(nn.Module):
    """Mixture of experts with static-capacity dispatch, plus optional shared experts."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.experts_n, self.top_k, self.capacity_factor = (
            cfg.experts,
            cfg.top_k,
            cfg.capacity_factor,
        )
        self.router = Router(cfg.hidden, cfg.experts, cfg.top_k)
        self.experts = MoEExperts(cfg.experts, cfg.hidden, cfg.ffn, cfg.style)
        self.shared = (
            MLP(cfg.hidden, cfg.ffn * cfg.shared_experts, cfg.style) if cfg.shared_experts else None
        )

    def capacity(self, tokens: int) -> int:
        return max(1, math.ceil(tokens * self.top_k * self.capacity_factor / self.experts_n))

    def forward(self, x_bsh: torch.Tensor) -> torch.Tensor:
        b, s, h = x_bsh.shape
        x_th = x_bsh.reshape(b * s, h)
        t, e, k = b * s, self.experts_n, self.top_k
        cap = self.capacity(t)
        weights_tk, experts_tk = self.router(x_th)
        # Slot of each (token, choice) inside its expert's buffer: a running count per expert.
        onehot_ne = F.one_hot(experts_tk.reshape(-1), e)  # n = t*k choices, token-major
        slot_n = ((onehot_ne.cumsum(0) - 1) * onehot_ne).sum(-1)
        keep_n = slot_n < cap  # choices past capacity are dropped (Switch Transformer)
        # Flat destination index in the (e*cap + 1) buffer; the extra row is a drop bin.
        dest_n = torch.where(keep_n, experts_tk.reshape(-1) * cap + slot_n, e * cap)
        token_n = torch.arange(t, device=x_bsh.device).repeat_interleave(k)
        src_index = torch.full((e * cap + 1,), t, dtype=torch.long, device=x_bsh.device)
        src_index = src_index.scatter(0, dest_n, token_n)[: e * cap]
        x_padded = torch.cat([x_th, x_th.new_zeros(1, h)])  # row t = zeros for empty slots
        x_ech = x_padded.index_select(0, src_index).view(e, cap, h)
        y_ech = self.experts(x_ech)
        y_flat = torch.cat([y_ech.reshape(e * cap, h), y_ech.new_zeros(1, h)])
        y_nh = y_flat.index_select(0, dest_n) * weights_tk.reshape(-1, 1)
        out_th = y_nh.view(t, k, h).sum(1)
        if self.shared is not None:
            out_th = out_th + self.shared(x_th)
        return out_th.view(b, s, h)


class Layer(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg: TransformerConfig, moe: bool) -> None:
        super().__init__()
        norm = (
            (lambda: RMSNorm(cfg.hidden, cfg.norm_eps))
            if cfg.style == "llama"
            else (lambda: nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps))
        )
        self.attn_norm = norm()
        self.attn = Attention(cfg)
        self.mlp_norm = norm()
        self.mlp = MoE(cfg) if moe else MLP(cfg.hidden, cfg.dense_ffn or cfg.ffn, cfg.style)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None):
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model; `forward(tokens, targets)` returns the mean loss."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        if cfg.style == "gpt":
            self.pos_embed = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleList(
            Layer(cfg, moe=bool(cfg.experts) and i >= cfg.dense_layers) for i in range(cfg.layers)
        )
        self.norm = (
            RMSNorm(cfg.hidden, cfg.norm_eps)
            if cfg.style == "llama"
            else nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps)
        )
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.ffn == cfg.hidden:
            # The MLP's inner width is the model width, so the sharding pass's op-order rule
            # (a projection fed by another width closes a region) cannot see that down_proj is
            # row-parallel: the model says so (`ir.trace.with_declared_tp_roles`).
            self.meshplan_tp_roles = {"*down_proj.weight": "row"}
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if cfg.style == "llama":
            cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta, device=None)
            self.register_buffer("rope_cos", cos, persistent=False)
            self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        b, s = tokens.shape
        x = self.embed(tokens)
        if self.cfg.style == "gpt":
            x = x + self.pos_embed(torch.arange(s, device=tokens.device))
        rope = (self.rope_cos, self.rope_sin) if self.cfg.style == "llama" else None
        for layer in self.layers:
            x = layer(x, rope)
        logits = self.lm_head(self.norm(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().view(b * s, -1), targets.reshape(-1))
