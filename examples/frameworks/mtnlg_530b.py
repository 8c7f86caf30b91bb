"""Megatron-Turing NLG 530B's shape, for `--model examples/frameworks/mtnlg_530b.py:build`.

Smith et al. 2022, "Using DeepSpeed and Megatron to Train Megatron-Turing NLG 530B"
(arXiv 2201.11990): 105 layers, hidden 20480, 128 attention heads, sequence 2048, a
GPT-2-style decoder (learned positions, LayerNorm, GELU MLP of 4h, biases) over the GPT-2 BPE
vocabulary padded to 51200, input and output embeddings tied (Megatron's default): the zoo's
GPT style, 529.6B parameters by `TransformerConfig.num_params`.

Attention is traced as the zoo traces it (PyTorch SDPA, priced as a fused kernel); the run
itself predates FlashAttention in Megatron and materialised the scores (docs/frameworks.md
says what that changes in the prediction).
"""

from __future__ import annotations

import meshplan

SEQ_LEN = 2048


def build(seq_len: int = SEQ_LEN, micro_batch: int = 1):
    """`(model, (tokens, targets))` on the meta device, in bf16."""
    return meshplan.models.transformer(
        layers=105,
        hidden=20480,
        heads=128,
        ffn=4 * 20480,
        vocab=51200,
        seq_len=seq_len,
        micro_batch=micro_batch,
        style="gpt",
        tie_embeddings=True,
    )
