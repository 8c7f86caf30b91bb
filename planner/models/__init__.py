"""meshplan.models: the built-in model zoo.

`get(name, seq_len=, micro_batch=)` and `transformer(...)` return `(model, example_inputs)`
with the model on the meta device (no memory, any size) and example inputs `(tokens,
targets)` as meta tensors, ready for `meshplan.trace` / `meshplan.plan`. Pass
`device="cpu"` for a real model small enough to run.

Preset configs are the published architectures (sources next to each entry).
"""

from __future__ import annotations

import dataclasses

import torch
from torch.overrides import TorchFunctionMode

from .transformer import Transformer, TransformerConfig

# Published architectures. Sources:
# GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (vocab 50257,
#   context 2048, ffn 4h, tied embeddings).
# Llama 2: Touvron et al. 2023, "Llama 2", Table 1 + the released params.json (vocab 32000,
#   ffn 11008 / 13824 / 28672, 70B uses GQA with 8 KV heads, context 4096).
# Llama 3 / 3.1: Meta 2024, "The Llama 3 Herd of Models", Table 3 (vocab 128256, 8 KV heads,
#   ffn 14336 / 28672 / 53248, context 8192 for pre-training).
# Mixtral: Jiang et al. 2024, "Mixtral of Experts", Table 1 (8 experts, top-2, 8 KV heads);
#   8x22B from the released config.json (56 layers, hidden 6144, 48 heads, ffn 16384,
#   vocab 32768).
# DeepSeek-MoE 16B: Dai et al. 2024, "DeepSeekMoE", Sec. 5 / released config.json (28 layers,
#   hidden 2048, 16 heads, first layer dense with ffn 10944, 64 routed experts of ffn 1408,
#   top-6, 2 shared experts, vocab 102400).
_GPT3 = dict(style="gpt", vocab=50257, seq_len=2048, tie_embeddings=True)
_LLAMA2 = dict(style="llama", vocab=32000, seq_len=4096, rope_theta=10000.0)
_LLAMA3 = dict(style="llama", vocab=128256, seq_len=8192, kv_heads=8, rope_theta=500000.0)

PRESETS: dict[str, tuple[TransformerConfig, str]] = {
    "gpt3-1.3b": (TransformerConfig(24, 2048, 16, ffn=8192, **_GPT3), "GPT-3 XL, 1.3B"),
    "gpt3-2.7b": (TransformerConfig(32, 2560, 32, ffn=10240, **_GPT3), "GPT-3 2.7B"),
    "gpt3-6.7b": (TransformerConfig(32, 4096, 32, ffn=16384, **_GPT3), "GPT-3 6.7B"),
    "gpt3-13b": (
        TransformerConfig(40, 5120, 40, ffn=20480, **_GPT3),
        "GPT-3 13B (d_model 5120: Table 2.1 prints 5140, which 40 heads of 128 contradict)",
    ),
    "gpt3-175b": (TransformerConfig(96, 12288, 96, ffn=49152, **_GPT3), "GPT-3 175B"),
    "llama2-7b": (TransformerConfig(32, 4096, 32, ffn=11008, **_LLAMA2), "Llama 2 7B"),
    "llama2-13b": (TransformerConfig(40, 5120, 40, ffn=13824, **_LLAMA2), "Llama 2 13B"),
    "llama2-70b": (
        TransformerConfig(80, 8192, 64, ffn=28672, kv_heads=8, **_LLAMA2),
        "Llama 2 70B (GQA)",
    ),
    "llama3-8b": (TransformerConfig(32, 4096, 32, ffn=14336, **_LLAMA3), "Llama 3.1 8B"),
    "llama3-70b": (TransformerConfig(80, 8192, 64, ffn=28672, **_LLAMA3), "Llama 3.1 70B"),
    "llama3-405b": (TransformerConfig(126, 16384, 128, ffn=53248, **_LLAMA3), "Llama 3.1 405B"),
    "mixtral-8x7b": (
        TransformerConfig(
            32,
            4096,
            32,
            vocab=32000,
            ffn=14336,
            kv_heads=8,
            seq_len=4096,
            experts=8,
            top_k=2,
            rope_theta=1e6,
        ),
        "Mixtral 8x7B (MoE, 8 experts, top-2)",
    ),
    "mixtral-8x22b": (
        TransformerConfig(
            56,
            6144,
            48,
            vocab=32768,
            ffn=16384,
            kv_heads=8,
            seq_len=4096,
            experts=8,
            top_k=2,
            rope_theta=1e6,
        ),
        "Mixtral 8x22B (MoE, 8 experts, top-2)",
    ),
    "deepseek-moe-16b": (
        TransformerConfig(
            28,
            2048,
            16,
            vocab=102400,
            ffn=1408,
            seq_len=4096,
            experts=64,
            top_k=6,
            shared_experts=2,
            dense_layers=1,
            dense_ffn=10944,
            rope_theta=10000.0,
        ),
        "DeepSeekMoE 16B (fine-grained MoE: 64 experts top-6 + 2 shared, first layer dense)",
    ),
    "tiny": (
        TransformerConfig(4, 256, 8, vocab=1024, ffn=688, kv_heads=4, seq_len=256),
        "tiny Llama-style model for tests and CPU runs (~5M params)",
    ),
    "tiny-moe": (
        TransformerConfig(
            4, 256, 8, vocab=1024, ffn=256, kv_heads=4, seq_len=256, experts=4, top_k=2
        ),
        "tiny MoE model for tests and CPU runs",
    ),
}

DEFAULT_MODEL = "llama3-8b"

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class UnknownModelError(ValueError):
    """An unknown preset name; the message lists the known ones."""


def list_models() -> list[tuple[str, str]]:
    """(name, description) of every preset."""
    return [(name, desc) for name, (_, desc) in PRESETS.items()]


def config(name: str) -> TransformerConfig:
    """The TransformerConfig of preset `name`."""
    key = name.lower()
    if key not in PRESETS:
        raise UnknownModelError(
            f"unknown model {name!r}; known models: {', '.join(PRESETS)} "
            "(or pass path/to/file.py:factory)"
        )
    return PRESETS[key][0]


def build(
    cfg: TransformerConfig,
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "meta",
) -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """Instantiate `cfg` on `device` with inputs of (micro_batch, seq_len) tokens."""
    if seq_len is not None:
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        cfg = dataclasses.replace(cfg, seq_len=seq_len)
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    torch_dtype = _DTYPES[dtype] if isinstance(dtype, str) else dtype
    with torch.device(device), SkipInitOnMeta():
        model = Transformer(cfg).to(torch_dtype)
        if cfg.style == "llama":  # rotary tables stay fp32 for accuracy
            model.rope_cos = model.rope_cos.float()
            model.rope_sin = model.rope_sin.float()
        tokens = torch.zeros(micro_batch, cfg.seq_len, dtype=torch.long)
        targets = torch.zeros(micro_batch, cfg.seq_len, dtype=torch.long)
    if str(device) != "meta":
        generator = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, cfg.vocab, tokens.shape, generator=generator).to(device)
        targets = torch.randint(0, cfg.vocab, targets.shape, generator=generator).to(device)
    return model, (tokens, targets)


# Random initialisers, as modules' `reset_parameters` call them.
_INITIALISERS = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.nn.init.normal_,
        torch.nn.init.uniform_,
        torch.nn.init.trunc_normal_,
        torch.nn.init.kaiming_normal_,
        torch.nn.init.kaiming_uniform_,
        torch.nn.init.xavier_normal_,
        torch.nn.init.xavier_uniform_,
    }
)


class SkipInitOnMeta(TorchFunctionMode):
    """Random initialisers skipped on meta tensors, which hold no values to draw. The tensor
    is returned as it is (shape, dtype, requires_grad unchanged), as the initialiser would.
    Why: torch runs `normal_` on a meta tensor through its Python reference, whose wrapper
    imports torch._dynamo (the compiler, ~1 s on the 2-core machine) the first time; nothing
    else in `meshplan plan` needs it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _INITIALISERS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes keywords
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def get(
    name: str,
    *,
    seq_len: int | None = None,
    micro_batch: int = 1,
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "meta",
) -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """Preset `name` as `(model, (tokens, targets))`, on the meta device unless told."""
    return build(config(name), seq_len=seq_len, micro_batch=micro_batch, dtype=dtype, device=device)


def transformer(
    *,
    layers: int,
    hidden: int,
    heads: int,
    ffn: int,
    vocab: int,
    kv_heads: int | None = None,
    seq_len: int = 2048,
    micro_batch: int = 1,
    experts: int = 0,
    top_k: int = 0,
    style: str = "llama",
    dtype: str | torch.dtype = "bfloat16",
    device: str | torch.device = "meta",
    **extra: object,
) -> tuple[Transformer, tuple[torch.Tensor, torch.Tensor]]:
    """Any decoder-only transformer config, built like the presets."""
    cfg = TransformerConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        ffn=ffn,
        vocab=vocab,
        kv_heads=kv_heads,
        seq_len=seq_len,
        experts=experts,
        top_k=top_k,
        style=style,
        **extra,  # type: ignore[arg-type]
    )
    return build(cfg, micro_batch=micro_batch, dtype=dtype, device=device)


__all__ = [
    "DEFAULT_MODEL",
    "PRESETS",
    "Transformer",
    "TransformerConfig",
    "UnknownModelError",
    "build",
    "config",
    "get",
    "list_models",
    "transformer",
]
