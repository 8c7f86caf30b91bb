"""How a training step executes beyond its parallel configuration: the engine features that
published training stacks use and that change its time.

meshplan's own runtime runs eager PyTorch in bf16 with DTensor tensor parallelism, which is
`EAGER`, the default everywhere. `meshplan estimate` (and `plan`, for what-if questions) can
price a step as another stack would run it:

- `fused`: memory-bound op chains fused into one kernel each: torch.compile (torchtitan
  compiles every transformer block) or Megatron-LM's hand-fused kernels (layer norm,
  bias-GeLU, scale-mask-softmax, bias-dropout-add). Priced with `passes.fusion` regions.
- `float8`: "tensorwise" Float8 linear layers (torchao's dynamic tensorwise scaling, the
  torchtitan default of 2024): the three GEMMs of every linear layer inside the transformer
  blocks run at the FP8 peak, plus the casts to FP8 (`compute` docstring).
- `float8_all_gather`: FSDP all-gathers the FP8 weights (1 byte a parameter) instead of bf16.
- `tp_overlap`: tensor-parallel collectives overlapped with the GEMMs they feed or follow
  (Megatron-LM `--tp-comm-overlap`, torchtitan's async TP; Wang et al., "Overlap
  Communication with Dependent Computation via Decomposition", ASPLOS'23): exposed at most
  what the GEMMs cannot hide, with the same overlap efficiency as data parallelism.
- `moe_imbalance`: how unevenly the router spreads tokens over expert-parallel ranks (the
  busiest rank's load over the mean), which sets the all-to-all time; a measured value
  replaces the balanced-router bound.
- `attention`: the fused-attention kernel: "flash2" (FlashAttention-2: PyTorch SDPA's flash
  backend, flash-attn 2.x; the default) or "flash1" (flash-attn 1.x, and the Triton port of it
  that MosaicML's MPT runs as `attn_impl: triton`, which its authors state runs slightly
  slower). Each is priced by its published throughput by head dim, mask and sequence length
  (`compute.ATTENTION_TFLOPS`).
- `fused_loss`: the loss is one fused softmax-cross-entropy kernel on the bf16 logits
  (flash-attn's `losses.cross_entropy.CrossEntropyLoss`, the default `loss_fn` of MosaicML's
  MPT): it saves the logits and a per-token logsumexp and writes the logits' gradient, where
  eager PyTorch copies the logits to fp32 and keeps their log-softmax (`compute.loss_chain`).
- `selective`: which outputs `Recompute.SELECTIVE` keeps, the stack's policy
  (`SelectivePolicy`, priced by `cost_model.recompute`): None is meshplan's runtime's and
  Megatron-LM's keep-every-linear; torchtitan's per-op policy ("torchtitan_op", its
  `selective_ac_option = "op"`) or every second layer checkpointed ("every_other_layer",
  `selective_ac_option = "2"`).
- `forward_precision`: "int8" or "fp8" forward linears (QSync, Zhao et al., "QSync:
  Quantization-Minimized Synchronous Distributed Training Across Hybrid Devices", IPDPS'24):
  the forward GEMM of every linear layer inside the transformer blocks runs on INT8 tensor
  cores (activations quantized per token, weights per output channel, int32 accumulation) or
  FP8 ones (tensorwise scaling), plus the quantizing passes; the backward GEMMs stay in the
  training dtype (straight-through gradients, `runtime.hybrid_precision`).
- `hybrid`: per-group precision: ((device group, "int8" | "fp8"), ...): the replicas of those
  groups run their transformer-block linears with that `forward_precision`, the other groups
  as the rest of the engine says (`Pricer.engine_of`). The plan records it
  (`Plan.hybrid_precision`) and the runtime applies it to those ranks only.
- `hybrid_linears`: which of those linears, by their path inside the repeated unit
  (`linear_role`: "attn.q_proj", "mlp.down_proj"); () = every one. Chosen from a measured
  per-linear sensitivity (`planner.api.chosen_linears`, `measure.sensitivity`), QSync's
  answer to which operators to lower.
- `reduce_fp32`: gradients are reduced across data-parallel (and the SP norm gradients across
  tensor-parallel) ranks in fp32, 4 bytes a parameter, although the model computes in
  bf16/fp16. torchtitan's default (`training.mixed_precision_reduce = "float32"`, FSDP2's
  `MixedPrecisionPolicy(reduce_dtype=float32)`), Megatron-LM under `--bf16` (it sets
  `accumulate_allreduce_grads_in_fp32` unless `--grad-reduce-in-bf16`, megatron/training/
  arguments.py: "accumulate and all-reduce gradients in fp32 for bfloat16 data type") and
  Composer's FSDP mixed precision DEFAULT (`precision: amp_bf16`). meshplan's runtime
  reduces the bf16 gradients it computes, as do FSDP's PURE policy and fp16 Megatron.
- `dp_overlap`: False when the data-parallel gradient reduction (and ZeRO-1/2's all-gather
  of the updated weights) runs after the last backward, exposed, rather than under the
  backward and the next forward: DeepSpeed's pipeline engine (its `TrainSchedule` ends every
  step with `ReduceTiedGrads, ReduceGrads, OptimizerStep` after the last `BackwardPass`,
  deepspeed/runtime/pipe/schedule.py), DeepSpeed ZeRO-0-2 without `overlap_comm` (its
  default below ZeRO-3) and Megatron-LM without `--overlap-grad-reduce`. ZeRO-3's per-unit
  gathers and reduce-scatters keep their overlap.
- `host_node_s`: the host's seconds per traced aten node of an eager forward + backward
  (`cost_model.host`): where the kernels are short the GPU waits for the host, most of all
  under torch's selective-checkpoint mode. The default was measured on a GPU machine's host;
  0 prices a host that never holds the GPU up (CUDA graphs).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass

from meshplan.ir.devices import HYBRID_MODES


class SelectivePolicy(enum.StrEnum):
    """How `Recompute.SELECTIVE` is carried out (`cost_model.recompute`'s docstring)."""

    KEEP_LINEAR = "keep_linear"
    TORCHTITAN_OP = "torchtitan_op"
    EVERY_OTHER_LAYER = "every_other_layer"


FLOAT8_RECIPES = ("tensorwise",)
# Per-group precision modes (`Engine.hybrid`): `ir.devices.HYBRID_MODES`.

# Fused-attention kernels with published throughput (`compute.ATTENTION_TFLOPS`).
ATTENTION_KERNELS = ("flash2", "flash1")


class EngineError(ValueError):
    """An engine feature meshplan cannot price."""


@dataclass(frozen=True, slots=True)
class Engine:
    """Engine features of a training step (module docstring). The default is meshplan's
    runtime: eager kernels, bf16 GEMMs, TP traffic not overlapped."""

    fused: bool = False
    float8: str | None = None
    float8_all_gather: bool = False
    tp_overlap: bool = False
    # MoE routing: the busiest expert-parallel rank's tokens over the mean, as measured on the
    # user's model; None: a balanced router's statistical bound (`graph_costs.moe_imbalance`).
    moe_imbalance: float | None = None
    attention: str = "flash2"
    fused_loss: bool = False
    reduce_fp32: bool = False
    dp_overlap: bool = True
    selective: str | None = None
    forward_precision: str | None = None
    hybrid: tuple[tuple[str, str], ...] = ()
    hybrid_linears: tuple[str, ...] = ()
    # Host seconds per traced aten node of an eager forward + backward (`cost_model.host`);
    # 0: the host never holds the GPU up (CUDA graphs, or a host fast enough); None: the
    # default (`host.default_node_s`).
    host_node_s: float | None = None

    def __post_init__(self) -> None:
        if self.host_node_s is not None and not 0.0 <= self.host_node_s < 1.0:
            raise EngineError(
                f"host_node_s is the host's seconds per traced op, at least 0 and under 1; "
                f"got {self.host_node_s!r}"
            )
        if self.selective is not None and self.selective not in set(SelectivePolicy):
            raise EngineError(
                f"selective policy {self.selective!r} is not modelled; use one of "
                f"{', '.join(SelectivePolicy)}"
            )
        if self.attention not in ATTENTION_KERNELS:
            raise EngineError(
                f"attention kernel {self.attention!r} is not modelled; use one of "
                f"{', '.join(ATTENTION_KERNELS)}"
            )
        if self.moe_imbalance is not None and not self.moe_imbalance >= 1.0:
            raise EngineError(
                f"moe_imbalance is the busiest rank's load over the mean, at least 1; got "
                f"{self.moe_imbalance!r}"
            )
        if self.float8 is not None and self.float8 not in FLOAT8_RECIPES:
            raise EngineError(
                f"float8 recipe {self.float8!r} is not modelled; use one of "
                f"{', '.join(FLOAT8_RECIPES)} (rowwise scaling's kernels are not priced)"
            )
        if self.float8_all_gather and self.float8 is None:
            raise EngineError("float8_all_gather needs float8='tensorwise'")
        if self.forward_precision not in (None, *HYBRID_MODES):
            raise EngineError(
                f"forward precision {self.forward_precision!r} is not modelled; use one of "
                f"{', '.join(HYBRID_MODES)}"
            )
        for group, mode in self.hybrid:
            if mode not in HYBRID_MODES:
                raise EngineError(
                    f"hybrid precision {mode!r} for group {group!r} is not modelled; use one of "
                    f"{', '.join(HYBRID_MODES)}"
                )
        if len({g for g, _ in self.hybrid}) != len(self.hybrid):
            raise EngineError("hybrid precision names a device group twice")
        if not all(isinstance(r, str) and r for r in self.hybrid_linears):
            raise EngineError(
                f"hybrid_linears must be linear paths inside a layer, got {self.hybrid_linears!r}"
            )

    @property
    def is_eager(self) -> bool:
        """meshplan's own runtime, whatever its host's speed (`host_node_s`)."""
        return dataclasses.replace(self, host_node_s=None) == EAGER

    def describe(self) -> str:
        """`eager` or the features joined with '+', e.g. `fused+float8(tensorwise)+tp-overlap`."""
        parts = []
        if self.fused:
            parts.append("fused")
        if self.float8:
            parts.append(f"float8({self.float8})")
        if self.float8_all_gather:
            parts.append("float8-all-gather")
        if self.tp_overlap:
            parts.append("tp-overlap")
        if self.moe_imbalance is not None:
            parts.append(f"moe-imbalance {self.moe_imbalance:g}")
        if self.attention != "flash2":
            parts.append(f"attention {self.attention}")
        if self.fused_loss:
            parts.append("fused-loss")
        if self.reduce_fp32:
            parts.append("fp32-reduce")
        if not self.dp_overlap:
            parts.append("dp-after-backward")
        if self.selective is not None:
            parts.append(f"selective {self.selective}")
        if self.forward_precision:
            parts.append(f"{self.forward_precision}-forward-linears")
        if self.hybrid_linears:
            parts.append("linears " + ",".join(self.hybrid_linears))
        if self.hybrid:
            parts.append("hybrid " + ",".join(f"{g}={m}" for g, m in self.hybrid))
        if self.host_node_s is not None:
            parts.append(f"host {self.host_node_s * 1e6:g} us/op")
        return "+".join(parts) or "eager"


EAGER = Engine()

__all__ = [
    "ATTENTION_KERNELS",
    "EAGER",
    "FLOAT8_RECIPES",
    "HYBRID_MODES",
    "Engine",
    "EngineError",
    "SelectivePolicy",
]
