"""GPT-Neo-2.7B's shape (32 layers, hidden 2560, 20 heads, ffn 4h, vocabulary 50257, tied
embeddings, learned positions) in the zoo's GPT style, on the meta device: the model of
Sailor's scenarios (benchmarks/vs_sailor.py).

    meshplan plan -m examples/models/gpt_neo.py:gpt_neo_27b \\
        -c examples/clusters/sailor_256a100_256v100.yaml --global-batch 2048
"""

import meshplan


def gpt_neo_27b(seq_len: int = 2048, micro_batch: int = 1, dtype: str = "bfloat16"):
    """(model, example inputs) of GPT-Neo-2.7B's shape at `seq_len` tokens, in `dtype`
    (benchmarks/vs_sailor.py builds it in float32 under Sailor's runtime)."""
    return meshplan.models.transformer(
        layers=32,
        hidden=2560,
        heads=20,
        ffn=4 * 2560,
        vocab=50257,
        seq_len=seq_len,
        micro_batch=micro_batch,
        style="gpt",
        tie_embeddings=True,
        dtype=dtype,
    )
