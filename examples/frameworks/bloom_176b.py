"""BLOOM-176B's shape, for `--model examples/frameworks/bloom_176b.py:build`.

BigScience's tr11-176B-ml run (github.com/bigscience-workshop/bigscience,
train/tr11-176B-ml/README.md and tr11-176B-ml.slurm): 70 layers, hidden 14336, 112 attention
heads, sequence 2048, vocabulary padded to 250880 (`--pad-vocab-size-to`), GeLU MLP of 4h,
LayerNorm, input and output embeddings tied, bf16. Read as the zoo's GPT style: the run's
ALiBi biases (no position table; the zoo's learned positions add 29M parameters, 0.02%) and
its LayerNorm after the embedding (`--embed-layernorm`, one norm) are not modelled.

Attention is traced as the zoo traces it (PyTorch SDPA, priced as a fused kernel); the run
used Megatron-DeepSpeed's fused masked softmax over materialised scores (2022, before
FlashAttention there): docs/fidelity.md gives the prediction both ways.
"""

from __future__ import annotations

import meshplan

SEQ_LEN = 2048


def build(seq_len: int = SEQ_LEN, micro_batch: int = 2):
    """`(model, (tokens, targets))` on the meta device, in bf16."""
    return meshplan.models.transformer(
        layers=70,
        hidden=14336,
        heads=112,
        ffn=4 * 14336,
        vocab=250880,
        seq_len=seq_len,
        micro_batch=micro_batch,
        style="gpt",
        tie_embeddings=True,
    )
