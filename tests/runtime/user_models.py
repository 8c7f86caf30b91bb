"""Models nobody on the project wrote: the user side of the model x configuration matrix.

Each model is written the way its community writes it (nanoGPT, timm, torch's own
`nn.MultiheadAttention`, Meta's Llama reference, a small T5/BART, an ALBERT-style block reused
at every depth, a plain conv net, a user's MoE) or built by HuggingFace `transformers` from a
tiny config. None of them follows meshplan's zoo conventions on purpose: the matrix
(`test_model_matrix.py`, `benchmarks/model_matrix.py`) checks that every configuration either
trains them exactly like one process or is refused when it is planned.

A `UserModel` is the whole contract a cell needs:
- `build(device)`: the model, seeded, on `"cpu"` (to train) or `"meta"` (to trace);
- `batch(rows, step)`: (inputs, targets) of one global batch, deterministic per step;
- `example(model)`: (args, kwargs) for `meshplan.trace` on meta; the model's output for them
  is its scalar loss (or an HF output with `.loss`).
The runtime calls `model(inputs)` and `loss_fn(output, targets)` (`loss_fn` below).

Sizes are tiny fp32 CPU configs (2 layers, hidden 32, 4 heads, sequence 8, vocabulary 64).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ = 8
VOCAB = 64
HIDDEN = 32
HEADS = 4
LAYERS = 2
IMAGE, PATCH, CHANNELS, CLASSES = 16, 4, 3, 10


def loss_fn(out, targets: torch.Tensor) -> torch.Tensor:
    """Cross entropy of the logits (an HF output's `.logits`, or a tensor) against the targets:
    next-token ids (B, T) for language models, class ids (B,) for classifiers."""
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _loss_or_logits(logits: torch.Tensor, targets: torch.Tensor | None):
    return logits if targets is None else loss_fn(logits, targets)


# -- 1. nanoGPT (Karpathy): fused c_attn split on dim 2, learned wpe, tied lm_head --------------


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class NanoMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class NanoBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = NanoCausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = NanoMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(
        self, vocab_size=VOCAB, block_size=16, n_layer=LAYERS, n_head=HEADS, n_embd=HIDDEN
    ):
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab_size, n_embd),
                wpe=nn.Embedding(block_size, n_embd),
                h=nn.ModuleList([NanoBlock(n_embd, n_head) for _ in range(n_layer)]),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying, as nanoGPT

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return _loss_or_logits(self.lm_head(self.transformer.ln_f(x)), targets)


# -- 2. timm-style ViT: conv patches, cls token, pos_embed Parameter, fused qkv permuted ---------


class VitAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class VitMlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VitBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(dim, eps=1e-6), VitAttention(dim, num_heads)
        self.norm2, self.mlp = nn.LayerNorm(dim, eps=1e-6), VitMlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, img: int, patch: int, chans: int, dim: int) -> None:
        super().__init__()
        self.num_patches = (img // patch) ** 2
        self.proj = nn.Conv2d(chans, dim, kernel_size=patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)  # (B, N, C)


class VisionTransformer(nn.Module):
    def __init__(self, img=IMAGE, patch=PATCH, chans=CHANNELS, classes=CLASSES, dim=HIDDEN,
                 depth=LAYERS, heads=HEADS):  # fmt: skip
        super().__init__()
        self.patch_embed = PatchEmbed(img, patch, chans, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, self.patch_embed.num_patches + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[VitBlock(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.patch_embed(x)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return _loss_or_logits(self.head(x[:, 0]), targets)


# -- 3. GPT on torch's nn.MultiheadAttention (batch_first, boolean causal mask) -----------------


class MhaBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class MhaGPT(nn.Module):
    def __init__(self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS, max_len=16):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.pos_emb = nn.Parameter(torch.randn(1, max_len, dim) * 0.02)
        self.blocks = nn.ModuleList([MhaBlock(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.tok_emb(tokens) + self.pos_emb[:, : tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


# -- 4. Llama reference style: wq/wk/wv/wo, w1/w2/w3, RMSNorm, RoPE buffers sliced [:T] ----------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on interleaved pairs (Meta's reference layout), x: (B, T, H, D)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = _rotate(xq, cos, sin), _rotate(xk, cos, sin)
        rep = self.n_heads // self.n_kv_heads
        xk, xv = xk.repeat_interleave(rep, dim=2), xv.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(
            xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, ffn: int) -> None:
        super().__init__()
        self.attention = LlamaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = FeedForward(dim, ffn)
        self.attention_norm, self.ffn_norm = RMSNorm(dim), RMSNorm(dim)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaRef(nn.Module):
    def __init__(self, vocab=VOCAB, dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, n_kv_heads=2,
                 ffn=64, max_seq_len=32):  # fmt: skip
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            TransformerBlock(dim, n_heads, n_kv_heads, ffn) for _ in range(n_layers)
        )
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        head_dim = dim // n_heads
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
        self.register_buffer("freqs_cos", angles.cos(), persistent=False)
        self.register_buffer("freqs_sin", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        seqlen = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        cos, sin = self.freqs_cos[:seqlen], self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return _loss_or_logits(self.output(self.norm(h)), targets)


# -- 4b. the same decoder written two other common ways ----------------------------------------


class FusedQKVAttention(nn.Module):
    """One `qkv` Linear chunked into q, k, v on the last dim (lit-gpt / many user models)."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = _rotate(q.view(b, t, -1, self.head_dim), cos, sin)
        k = _rotate(k.view(b, t, -1, self.head_dim), cos, sin)
        v = v.view(b, t, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.proj(out.transpose(1, 2).reshape(b, t, -1))


class ProjAttention(nn.Module):
    """q_proj/k_proj/v_proj/o_proj (the names the runtime's CP looks for), rotary tables passed
    in already sliced to the length the model saw."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = _rotate(self.q_proj(x).view(b, t, -1, self.head_dim), cos, sin)
        k = _rotate(self.k_proj(x).view(b, t, -1, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, -1, self.head_dim)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class RopeBlock(nn.Module):
    def __init__(self, attn: nn.Module, dim: int) -> None:
        super().__init__()
        self.norm_1, self.attn = RMSNorm(dim), attn
        self.norm_2, self.mlp = RMSNorm(dim), FeedForward(dim, 2 * dim)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm_1(x), cos, sin)
        return x + self.mlp(self.norm_2(x))


class RopeLM(nn.Module):
    """A RoPE decoder whose cos/sin buffers are sliced by the length of the input `[:T]`;
    `fused`: one qkv Linear, else q_proj/k_proj/v_proj."""

    def __init__(
        self, fused: bool, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS, max_len=32
    ):
        super().__init__()
        attn = (
            (lambda: FusedQKVAttention(dim, heads))
            if fused
            else (lambda: ProjAttention(dim, heads))
        )
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(RopeBlock(attn(), dim) for _ in range(layers))
        self.norm_f, self.head = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)
        half = dim // heads // 2
        angles = torch.outer(
            torch.arange(max_len).float(), 1.0 / (10000.0 ** (torch.arange(half) / half))
        )
        self.register_buffer("cos_cached", angles.cos(), persistent=False)
        self.register_buffer("sin_cached", angles.sin(), persistent=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        t = tokens.shape[1]
        cos, sin = self.cos_cached[:t], self.sin_cached[:t]
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x, cos, sin)
        return _loss_or_logits(self.head(self.norm_f(x)), targets)


# -- 4c. ALiBi (Press et al. 2022; BLOOM, MPT): a per-head linear bias made at forward --------


def alibi_slopes(n_heads: int) -> torch.Tensor:
    """The geometric slopes 2^(-8 i / n), i = 1..n (Press et al., ICLR 2022, section 3)."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / n_heads) for i in range(n_heads)])


class AlibiAttention(nn.Module):
    """Separate projections; the bias is made from `self.n_heads` at every forward and handed
    to SDPA as a float mask, as BLOOM-style user code does."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        pos = torch.arange(t, device=x.device)
        distance = (pos[None, :] - pos[:, None]).float()  # key - query
        bias = alibi_slopes(self.n_heads).to(x.device)[:, None, None] * distance
        bias = bias.masked_fill(distance > 0, float("-inf"))  # causal
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class PreNormBlock(nn.Module):
    """LayerNorm -> attention (a class of this section) -> residual, LayerNorm -> SwiGLU."""

    def __init__(self, dim: int, heads: int, attention: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), attention(dim, heads)
        self.ln_2, self.mlp = nn.LayerNorm(dim), FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class PreNormLM(nn.Module):
    """Token embedding (no positions), `PreNormBlock`s of the subclass's `attention`, a head."""

    attention: type[nn.Module]

    def __init__(self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(PreNormBlock(dim, heads, self.attention) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(tokens)
        for block in self.blocks:
            x = block(x)
        return _loss_or_logits(self.head(self.ln_f(x)), targets)


class AlibiLM(PreNormLM):
    attention = AlibiAttention


# -- 4c'. attention written out (q @ k^T, causal mask, softmax, @ v), no SDPA ----------------


class EagerAttention(nn.Module):
    """Separate biased projections and the attention product written out in Python, as many
    research codebases (and HF's `eager` implementation) do: the trace sees two matmuls of
    activations and a softmax, no attention op."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in "qkvo")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (
            p(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        return self.o_proj((probs @ v).transpose(1, 2).reshape(b, t, -1))


class EagerLM(PreNormLM):
    attention = EagerAttention


# -- 4d. multi-query attention with raw parameters and einsum (PaLM / Falcon-7B style) --------


class EinsumMQA(nn.Module):
    """One K/V head shared by every query head (Shazeer 2019); projections are raw Parameters
    applied with `torch.einsum`, not nn.Linear."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Parameter(torch.randn(dim, n_heads, self.head_dim) * dim**-0.5)
        self.wkv = nn.Parameter(torch.randn(dim, 2, self.head_dim) * dim**-0.5)
        self.wo = nn.Parameter(torch.randn(n_heads, self.head_dim, dim) * dim**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = torch.einsum("btd,dhe->bhte", x, self.wq)
        k, v = torch.einsum("btd,dce->cbte", x, self.wkv).unsqueeze(2).unbind(0)
        out = F.scaled_dot_product_attention(q, k.expand_as(q), v.expand_as(q), is_causal=True)
        return torch.einsum("bhte,hed->btd", out, self.wo)


class MQABlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm_1, self.attn = RMSNorm(dim), EinsumMQA(dim, heads)
        self.norm_2, self.mlp = RMSNorm(dim), FeedForward(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class MQALM(nn.Module):
    def __init__(self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS, max_len=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(MQABlock(dim, heads) for _ in range(layers))
        self.norm, self.out = RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return _loss_or_logits(self.out(self.norm(x)), targets)


# -- 5. encoder-decoder (T5/BART-like): separate q/k/v, cross-attention -------------------------


class MultiHeadAttention(nn.Module):
    def __init__(self, dim: int, heads: int, causal: bool) -> None:
        super().__init__()
        self.heads, self.causal = heads, causal
        self.q_proj, self.k_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.v_proj, self.out_proj = nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None) -> torch.Tensor:
        kv = x if memory is None else memory
        b, t, d = x.shape
        s = kv.shape[1]
        q = self.q_proj(x).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(kv).view(b, s, self.heads, -1).transpose(1, 2)
        v = self.v_proj(kv).view(b, s, self.heads, -1).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, d))


class EncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn, self.norm1 = MultiHeadAttention(dim, heads, causal=False), nn.LayerNorm(dim)
        self.fc1, self.fc2, self.norm2 = (
            nn.Linear(dim, 2 * dim),
            nn.Linear(2 * dim, dim),
            nn.LayerNorm(dim),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x))
        return self.norm2(x + self.fc2(F.relu(self.fc1(x))))


class DecoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.self_attn, self.norm1 = MultiHeadAttention(dim, heads, causal=True), nn.LayerNorm(dim)
        self.cross_attn, self.norm2 = (
            MultiHeadAttention(dim, heads, causal=False),
            nn.LayerNorm(dim),
        )
        self.fc1, self.fc2, self.norm3 = (
            nn.Linear(dim, 2 * dim),
            nn.Linear(2 * dim, dim),
            nn.LayerNorm(dim),
        )

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.self_attn(x))
        x = self.norm2(x + self.cross_attn(x, memory))
        return self.norm3(x + self.fc2(F.relu(self.fc1(x))))


class EncoderDecoder(nn.Module):
    """Inputs are (src, tgt) token ids packed as one (B, S + T) tensor (the runner passes one
    input tensor): the first `src_len` columns are the source."""

    def __init__(
        self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS, src_len=SEQ, max_len=16
    ):
        super().__init__()
        self.src_len = src_len
        self.shared = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.encoder = nn.ModuleList(EncoderLayer(dim, heads) for _ in range(layers))
        self.decoder = nn.ModuleList(DecoderLayer(dim, heads) for _ in range(layers))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.shared(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))

    def forward(self, src_tgt: torch.Tensor, targets: torch.Tensor | None = None):
        src, tgt = src_tgt[:, : self.src_len], src_tgt[:, self.src_len :]
        memory = self._embed(src)
        for layer in self.encoder:
            memory = layer(memory)
        x = self._embed(tgt)
        for layer in self.decoder:
            x = layer(x, memory)
        return _loss_or_logits(self.lm_head(x), targets)


# -- 6a. one block reused at every depth (ALBERT / Universal Transformer) -----------------------


class SharedBlockLM(nn.Module):
    def __init__(self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, depth=3, max_len=16):
        super().__init__()
        self.depth = depth
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * 0.02)
        self.block = NanoBlock(dim, heads)  # one set of weights applied `depth` times
        self.out_norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for _ in range(self.depth):
            x = self.block(x)
        return _loss_or_logits(self.out(self.out_norm(x)), targets)


# -- 6b. a small conv net, no repeated block ----------------------------------------------------


class ConvNet(nn.Module):
    def __init__(self, chans=CHANNELS, classes=CLASSES):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(chans, 16, 3, padding=1),
            nn.GELU(),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.GELU(),
            nn.Conv2d(32, 48, 3, stride=2, padding=1),
            nn.GELU(),
        )
        self.norm = nn.GroupNorm(4, 48)
        self.classifier = nn.Linear(48, classes)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.norm(self.features(x)).mean(dim=(2, 3))
        return _loss_or_logits(self.classifier(x), targets)


# -- 6c. a user's MoE: experts in a ModuleList, dispatch by masks and torch.where -------------


class ExpertMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc_in, self.fc_out = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class MaskMoE(nn.Module):
    """Top-2 of 4 experts; each expert runs on every token and is weighted by a
    `torch.where` of its selection mask (dense, no data-dependent shapes)."""

    def __init__(self, dim: int, hidden: int, n_experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, n_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(dim, hidden) for _ in range(n_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        top_w, top_i = probs.topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            chosen = top_i == e  # (B, T, k) boolean mask
            weight = torch.where(chosen, top_w, torch.zeros_like(top_w)).sum(-1, keepdim=True)
            out = out + weight * expert(x)
        return out


class SparseMoE(MaskMoE):
    """Mixtral's original loop: each expert runs only on the tokens routed to it, found with
    `torch.where` on a one-hot of the choices (data-dependent shapes) and scattered back with
    `index_add_`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        x_th = x.reshape(-1, h)
        top_w, top_i = self.gate(x_th).softmax(-1).topk(self.top_k, dim=-1)
        top_w = top_w / top_w.sum(-1, keepdim=True)
        mask_ekt = F.one_hot(top_i, len(self.experts)).permute(2, 1, 0)
        out = torch.zeros_like(x_th)
        for e, expert in enumerate(self.experts):
            slot, token = torch.where(mask_ekt[e])
            out.index_add_(0, token, expert(x_th[token]) * top_w[token, slot, None])
        return out.reshape(b, t, h)


class MoEBlock(nn.Module):
    def __init__(self, dim: int, heads: int, sparse: bool = False) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(dim), NanoCausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.moe = (SparseMoE if sparse else MaskMoE)(dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


class UserMoELM(nn.Module):
    def __init__(
        self, vocab=VOCAB, dim=HIDDEN, heads=HEADS, layers=LAYERS, max_len=16, sparse=False
    ):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.h = nn.ModuleList(MoEBlock(dim, heads, sparse) for _ in range(layers))
        self.ln_f, self.lm_head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return _loss_or_logits(self.lm_head(self.ln_f(x)), targets)


# -- HuggingFace models from tiny configs ------------------------------------------------------


def _hf_config(kind: str):
    import transformers

    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        use_cache=False,
    )
    if kind == "llama":
        return transformers.LlamaConfig(**common)
    if kind == "phi3":
        return transformers.Phi3Config(**common, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if kind == "qwen2_moe":
        return transformers.Qwen2MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if kind == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if kind == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=HIDDEN,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            vocab_size=VOCAB,
            max_position_embeddings=64,
            use_cache=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
        )
    if kind == "gpt2":
        return transformers.GPT2Config(
            n_layer=LAYERS,
            n_embd=HIDDEN,
            n_head=HEADS,
            vocab_size=VOCAB,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            use_cache=False,
        )
    if kind == "bart":
        return transformers.BartConfig(
            vocab_size=VOCAB,
            d_model=HIDDEN,
            encoder_layers=LAYERS,
            decoder_layers=LAYERS,
            encoder_attention_heads=HEADS,
            decoder_attention_heads=HEADS,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            use_cache=False,
        )
    raise ValueError(f"unknown HF kind {kind!r}")


_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "bart": "BartForConditionalGeneration",
}


def hf_model(kind: str, device: str) -> nn.Module:
    """An HF model from a tiny config with SDPA attention (Qwen2-MoE, Mixtral: batched experts,
    whose
    default loop is data-dependent and cannot be traced)."""
    import transformers

    cls = getattr(transformers, _HF_CLASSES[kind])
    moe = kind in ("qwen2_moe", "mixtral")
    kw = {"experts_implementation": "batched_mm"} if moe else {}
    with torch.device(device):
        return cls._from_config(_hf_config(kind), attn_implementation="sdpa", **kw)


# -- the registry ------------------------------------------------------------------------------


def token_batch(rows: int, step: int, src_len: int = 0):
    """Random token ids (rows, src_len + SEQ) and next-token targets (rows, SEQ)."""
    g = torch.Generator().manual_seed(3000 + step)
    x = torch.randint(0, VOCAB, (rows, src_len + SEQ), generator=g)
    return x, torch.randint(0, VOCAB, (rows, SEQ), generator=g)


def image_batch(rows: int, step: int):
    g = torch.Generator().manual_seed(4000 + step)
    x = torch.randn(rows, CHANNELS, IMAGE, IMAGE, generator=g)
    return x, torch.randint(0, CLASSES, (rows,), generator=g)


@dataclasses.dataclass(frozen=True)
class UserModel:
    """One model of the matrix (see the module docstring)."""

    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    hf: bool = False
    moe: bool = False

    def build(self, device: str = "cpu") -> nn.Module:
        torch.manual_seed(0)
        if self.hf:
            return self.make(device)
        with torch.device(device):
            return self.make()

    def example(self, model: nn.Module) -> tuple[tuple, dict]:
        """Trace inputs on meta (one row): the targets go in, so the output is the loss."""
        x, y = self.batch(1, 0)
        x, y = x.to("meta"), y.to("meta")
        if self.hf:
            return (x,), {"labels": x, "use_cache": False}
        return (x, y), {}


def _hf(kind: str, moe: bool = False) -> UserModel:
    return UserModel(
        f"hf-{kind}", lambda device: hf_model(kind, device), token_batch, hf=True, moe=moe
    )


MODELS: dict[str, UserModel] = {
    m.name: m
    for m in (
        UserModel("nanogpt", NanoGPT, token_batch),
        UserModel("vit", VisionTransformer, image_batch),
        UserModel("mha-gpt", MhaGPT, token_batch),
        UserModel("llama-ref", LlamaRef, token_batch),
        UserModel("fused-qkv", lambda: RopeLM(fused=True), token_batch),
        UserModel("rope-qproj", lambda: RopeLM(fused=False), token_batch),
        UserModel("alibi", AlibiLM, token_batch),
        UserModel("eager-attn", EagerLM, token_batch),
        UserModel("einsum-mqa", MQALM, token_batch),
        UserModel("enc-dec", EncoderDecoder, lambda r, s: token_batch(r, s, src_len=SEQ)),
        UserModel("shared-block", SharedBlockLM, token_batch),
        UserModel("convnet", ConvNet, image_batch),
        UserModel("user-moe", UserMoELM, token_batch, moe=True),
        UserModel("sparse-moe", lambda: UserMoELM(sparse=True), token_batch, moe=True),
        _hf("llama"),
        _hf("gpt2"),
        _hf("gpt_neox"),
        _hf("phi3"),
        _hf("qwen2_moe", moe=True),
        _hf("mixtral", moe=True),
        _hf("bart"),
    )
}
