"""Synthetic Graphs and Clusters built from hand formulas: the independent oracle for cost tests.

`transformer_graph` writes a GPT-style decoder (Korthikanti et al. 2022's layer: LayerNorm,
QKV linear, attention with an explicit softmax + dropout, output linear, dropout, LayerNorm,
MLP with GeLU, dropout) with:

- FLOPs (FlopCounterMode convention, as the tracer): 2*m*n*k per linear forward and twice that
  backward; attention 4*b*a*s^2*d forward (QK^T and PV), 8*b*a*s^2*d backward; every other op
  0 FLOPs (its cost is bytes);
- bytes: the sizes of the tensors each op reads and writes (backward: twice the forward);
- saved bytes per op, from Korthikanti et al. Table 2 (16-bit activations, 1-byte masks):
  LN inputs 2sbh each, QKV input 2sbh, Q/K 4sbh + V 2sbh (on the attention op), softmax output
  2as^2b + dropout mask as^2b + dropout output 2as^2b (on the softmax op), output-linear input
  2sbh, dropout masks sbh each, MLP input 2sbh, GeLU input 2sbf and output 2sbf. With f = 4h
  and kv_heads = heads a layer saves s*b*h*34 + 5*a*s^2*b bytes.

MoE layers (experts > 0) replace the MLP with a router and top_k-routed expert GEMMs.
"""

from __future__ import annotations

from meshplan.ir import (
    DTYPE_BYTES,
    Block,
    Cluster,
    DeviceGroup,
    GpuSpec,
    Graph,
    GroupLink,
    LinkKind,
    LinkTier,
    ModelInfo,
    Op,
    OpKind,
    Param,
    TensorMeta,
    Unit,
)

GiB = 2**30


def _t(dtype: str, *shape: int) -> TensorMeta:
    return TensorMeta(tuple(shape), dtype)


def _op(
    name,
    kind,
    inputs,
    outputs,
    *,
    flops=0,
    bwd_flops=None,
    saved=0,
    params=(),
    attrs=(),
    extra_bytes=0,
) -> Op:
    fwd_bytes = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs) + extra_bytes
    return Op(
        name=name,
        kind=kind,
        target=f"synthetic.{name}",
        module=name.split(".")[0],
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        fwd_flops=flops,
        bwd_flops=2 * flops if bwd_flops is None else bwd_flops,
        fwd_bytes=fwd_bytes,
        bwd_bytes=2 * fwd_bytes,
        saved_bytes=saved,
        params=tuple(params),
        attrs=tuple(sorted(attrs)),
    )


def _layer(b, s, h, a, kv, d, f, e, dt, experts, top_k) -> tuple[Block, tuple[Param, ...]]:
    x = _t(dt, b, s, h)
    qkv_out = (a + 2 * kv) * d
    params = [
        Param("input_norm.weight", (h,), dt),
        Param("qkv_proj.weight", (qkv_out, h), dt),
        Param("o_proj.weight", (h, a * d), dt),
        Param("post_norm.weight", (h,), dt),
    ]
    ops = [
        _op(
            "input_norm",
            OpKind.NORM,
            [x, _t(dt, h)],
            [x],
            saved=x.nbytes,
            params=["input_norm.weight"],
        ),
        _op(
            "qkv_proj",
            OpKind.MATMUL,
            [x, _t(dt, qkv_out, h)],
            [_t(dt, b, s, qkv_out)],
            flops=2 * b * s * h * qkv_out,
            saved=x.nbytes,
            params=["qkv_proj.weight"],
        ),
    ]
    q, k, v = _t(dt, b, a, s, d), _t(dt, b, kv, s, d), _t(dt, b, kv, s, d)
    scores = _t(dt, b, a, s, s)
    ops.append(
        _op(
            "attention",
            OpKind.ATTENTION,
            [q, k, v],
            [_t(dt, b, a, s, d)],
            flops=4 * b * a * s * s * d,
            saved=q.nbytes + k.nbytes + v.nbytes,
            attrs=[("causal", True), ("heads", a), ("kv_heads", kv)],
            extra_bytes=2 * scores.nbytes,
        )
    )
    # softmax output (e bytes) + dropout mask (1 byte) + dropout output (e bytes) per score
    ops.append(
        _op("softmax", OpKind.SOFTMAX, [scores], [scores], saved=b * a * s * s * (2 * e + 1))
    )
    ops += [
        _op(
            "o_proj",
            OpKind.MATMUL,
            [_t(dt, b, s, a * d), _t(dt, h, a * d)],
            [x],
            flops=2 * b * s * a * d * h,
            saved=b * s * a * d * e,
            params=["o_proj.weight"],
        ),
        _op("attn_residual", OpKind.ELEMENTWISE, [x, x], [x], saved=b * s * h),  # mask
        _op(
            "post_norm",
            OpKind.NORM,
            [x, _t(dt, h)],
            [x],
            saved=x.nbytes,
            params=["post_norm.weight"],
        ),
    ]
    if experts:
        tokens = b * s * top_k
        params += [
            Param("router.weight", (experts, h), dt),
            Param("experts.w1", (experts, f, h), dt),
            Param("experts.w2", (experts, h, f), dt),
        ]
        ops += [
            _op(
                "router",
                OpKind.ROUTER,
                [x, _t(dt, experts, h)],
                [_t(dt, b, s, experts)],
                flops=2 * b * s * h * experts,
                saved=x.nbytes,
                params=["router.weight"],
            ),
            _op(
                "experts_up",
                OpKind.EXPERTS,
                [_t(dt, tokens, h), _t(dt, experts, f, h)],
                [_t(dt, tokens, f)],
                flops=2 * tokens * h * f,
                saved=tokens * h * e,
                params=["experts.w1"],
            ),
            _op(
                "experts_act",
                OpKind.ELEMENTWISE,
                [_t(dt, tokens, f)],
                [_t(dt, tokens, f)],
                saved=tokens * f * e,
            ),
            _op(
                "experts_down",
                OpKind.EXPERTS,
                [_t(dt, tokens, f), _t(dt, experts, h, f)],
                [_t(dt, tokens, h)],
                flops=2 * tokens * f * h,
                saved=tokens * f * e,
                params=["experts.w2"],
            ),
            _op("mlp_residual", OpKind.ELEMENTWISE, [_t(dt, tokens, h), x], [x], saved=b * s * h),
        ]
    else:
        params += [Param("up_proj.weight", (f, h), dt), Param("down_proj.weight", (h, f), dt)]
        y = _t(dt, b, s, f)
        ops += [
            _op(
                "up_proj",
                OpKind.MATMUL,
                [x, _t(dt, f, h)],
                [y],
                flops=2 * b * s * h * f,
                saved=x.nbytes,
                params=["up_proj.weight"],
            ),
            _op("act", OpKind.ELEMENTWISE, [y], [y], saved=y.nbytes),
            _op(
                "down_proj",
                OpKind.MATMUL,
                [y, _t(dt, h, f)],
                [x],
                flops=2 * b * s * f * h,
                saved=y.nbytes,
                params=["down_proj.weight"],
            ),
            _op("mlp_residual", OpKind.ELEMENTWISE, [x, x], [x], saved=b * s * h),  # mask
        ]
    block = Block("layer", "layer", tuple(ops), tuple(params), inputs=(x,), outputs=(x,))
    return block, tuple(params)


def transformer_graph(
    layers: int,
    hidden: int,
    heads: int,
    kv_heads: int,
    ffn: int,
    vocab: int,
    seq_len: int,
    micro_batch: int,
    dtype: str = "bfloat16",
    experts: int = 0,
    top_k: int = 0,
    *,
    embed_and_head: bool = True,
    name: str | None = None,
) -> Graph:
    """A synthetic decoder-only transformer Graph (see the module docstring).

    `embed_and_head=False` leaves out the prologue (embedding) and epilogue (final norm, LM
    head, loss) so that every pipeline stage is identical.
    """
    b, s, h, a, kv, f = micro_batch, seq_len, hidden, heads, kv_heads, ffn
    d = h // a
    e = DTYPE_BYTES[dtype]
    if experts and not top_k:
        top_k = 1
    layer, layer_params = _layer(b, s, h, a, kv, d, f, e, dtype, experts, top_k)
    blocks = [("layer", layer)]
    units = []
    params: list[Param] = []
    x = _t(dtype, b, s, h)
    if embed_and_head:
        tokens = _t("int64", b, s)
        emb_w = Param("embed.weight", (vocab, h), dtype)
        prologue = Block(
            "prologue",
            "prologue",
            (
                _op(
                    "embedding",
                    OpKind.EMBEDDING,
                    [tokens],
                    [x],
                    saved=tokens.nbytes,
                    params=["embed.weight"],
                    extra_bytes=x.nbytes,
                ),
            ),
            (emb_w,),
            inputs=(tokens,),
            outputs=(x,),
        )
        blocks.insert(0, ("prologue", prologue))
        units.append(Unit("<prologue>", "prologue"))
        params.append(emb_w)
    for i in range(layers):
        units.append(Unit(f"layers.{i}", "layer"))
        params += [Param(f"layers.{i}.{p.name}", p.shape, p.dtype) for p in layer_params]
    if embed_and_head:
        logits = _t(dtype, b, s, vocab)
        head_w = Param("lm_head.weight", (vocab, h), dtype)
        norm_w = Param("final_norm.weight", (h,), dtype)
        epilogue = Block(
            "epilogue",
            "epilogue",
            (
                _op(
                    "final_norm",
                    OpKind.NORM,
                    [x, _t(dtype, h)],
                    [x],
                    saved=x.nbytes,
                    params=["final_norm.weight"],
                ),
                _op(
                    "lm_head",
                    OpKind.MATMUL,
                    [x, _t(dtype, vocab, h)],
                    [logits],
                    flops=2 * b * s * h * vocab,
                    saved=x.nbytes,
                    params=["lm_head.weight"],
                ),
                # cross-entropy keeps fp32 log-probabilities of the logits
                _op(
                    "loss",
                    OpKind.LOSS,
                    [logits, _t("int64", b, s)],
                    [_t("float32")],
                    saved=4 * b * s * vocab,
                ),
            ),
            (norm_w, head_w),
            inputs=(x,),
            outputs=(_t("float32"),),
        )
        blocks.append(("epilogue", epilogue))
        units.append(Unit("<epilogue>", "epilogue"))
        params += [norm_w, head_w]
    info = ModelInfo(
        hidden=h,
        heads=a,
        kv_heads=kv,
        head_dim=d,
        ffn=f,
        vocab=vocab if embed_and_head else 0,
        seq_len=s,
        micro_batch=b,
        experts=experts,
        top_k=top_k,
        layers=layers,
    )
    return Graph(
        name=name or f"synthetic-{layers}x{hidden}",
        inputs=(_t("int64", b, s),),
        units=tuple(units),
        blocks=tuple(blocks),
        params=tuple(params),
        info=info,
    )


# -- hardware built directly from the dataclasses (hardware.md numbers) -----------------------

H100 = GpuSpec(
    name="H100",
    peak_flops=(("bfloat16", 989e12), ("float16", 989e12), ("float32", 67e12)),
    memory_bytes=80 * GiB,
    hbm_bandwidth=3350e9,
    sms=132,
    nvlink_bandwidth=450e9,
    source="hardware.md",
)
A100 = GpuSpec(
    name="A100-80GB",
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
    memory_bytes=80 * GiB,
    hbm_bandwidth=2039e9,
    sms=108,
    nvlink_bandwidth=300e9,
    source="hardware.md",
)
A100_40 = GpuSpec(
    name="A100-40GB",
    peak_flops=(("bfloat16", 312e12), ("float16", 312e12), ("float32", 19.5e12)),
    memory_bytes=40 * GiB,
    hbm_bandwidth=1555e9,
    sms=108,
    nvlink_bandwidth=300e9,
    source="hardware.md",
)

NVLINK4 = LinkTier("nvlink4", LinkKind.NVLINK, 450e9, 2e-6, 0.8)
NVLINK3 = LinkTier("nvlink3", LinkKind.NVLINK, 300e9, 2e-6, 0.8)
IB_NDR = LinkTier("ib-ndr", LinkKind.INFINIBAND, 50e9, 5e-6, 0.85)
IB_HDR = LinkTier("ib-hdr", LinkKind.INFINIBAND, 25e9, 5e-6, 0.85)
WAN = LinkTier("wan-100g", LinkKind.WAN, 12.5e9, 1e-3, 0.5)


def h100_cluster(nodes: int, gpus_per_node: int = 8, *, gpu: GpuSpec = H100) -> Cluster:
    """`nodes` DGX-H100-like nodes: NVLink4 inside, 8 x NDR 400 Gb/s NICs per node."""
    return Cluster(
        name=f"h100x{nodes * gpus_per_node}",
        groups=(
            DeviceGroup("h100", gpu, nodes, gpus_per_node, "nvlink4", "ib-ndr", nics_per_node=8),
        ),
        links=(NVLINK4, IB_NDR),
    )


def mixed_cluster(
    h100_nodes: int,
    a100_nodes: int,
    *,
    a100: GpuSpec = A100,
    wan: bool = False,
    gpus_per_node: int = 8,
) -> Cluster:
    """H100 nodes (NDR) then A100 nodes (HDR) at one site, or at two sites joined by a WAN."""
    groups = (
        DeviceGroup(
            "h100", H100, h100_nodes, gpus_per_node, "nvlink4", "ib-ndr", nics_per_node=8, site="a"
        ),
        DeviceGroup(
            "a100",
            a100,
            a100_nodes,
            gpus_per_node,
            "nvlink3",
            "ib-hdr",
            nics_per_node=8,
            site="b" if wan else "a",
        ),
    )
    return Cluster(
        name=f"mixed-{h100_nodes}h100-{a100_nodes}a100",
        groups=groups,
        links=(NVLINK4, NVLINK3, IB_NDR, IB_HDR, WAN),
        group_links=(GroupLink("a", "b", "wan-100g"),) if wan else (),
    )


def three_type_cluster(gpus_per_node: int = 4, nodes: tuple[int, int, int] = (1, 1, 1)) -> Cluster:
    """H100 (NDR), A100-80GB (HDR) and A40 (the GPU table's datasheet figures, HDR) nodes at one
    site: three speeds, so uneven shares over all three groups can pay."""
    from meshplan.ir.hardware import gpu_spec

    h, a, c = nodes
    return Cluster(
        name=f"{h}h100+{a}a100+{c}a40",
        groups=(
            DeviceGroup("h100", H100, h, gpus_per_node, "nvlink4", "ib-ndr", nics_per_node=4),
            DeviceGroup("a100", A100, a, gpus_per_node, "nvlink3", "ib-hdr", nics_per_node=4),
            DeviceGroup(
                "a40", gpu_spec("A40"), c, gpus_per_node, "nvlink3", "ib-hdr", nics_per_node=4
            ),
        ),
        links=(NVLINK4, NVLINK3, IB_NDR, IB_HDR),
    )


def two_node_sizes_cluster() -> Cluster:
    """8 A100-40GB in one NVLink node beside 2 nodes of 2 H100s: a TP of 4 fits only the
    A100 node, the H100 nodes take at most 2 (where per-group TP degrees pay)."""
    return Cluster(
        name="a100x8+h100x2x2",
        groups=(
            DeviceGroup("a100", A100_40, 1, 8, "nvlink3", "ib-hdr", nics_per_node=8),
            DeviceGroup("h100", H100, 2, 2, "nvlink4", "ib-ndr", nics_per_node=2),
        ),
        links=(NVLINK4, NVLINK3, IB_NDR, IB_HDR),
    )
