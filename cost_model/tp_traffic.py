"""Tensor-parallel traffic of a stage: each block's TP collectives per micro-batch and the
per-step gradient all-reduces of TP-replicated parameters (`Pricer`'s tensor-parallel part).

`TensorParallelTraffic` is mixed into `pricer.Pricer`; it reads the pricer's `costs` and
`comm`, and calls its `comm_choice`, `moe_load_factor` (ep_traffic.py) and `reduce_bytes`
(dp_traffic.py). The overlap of TP traffic with decomposed GEMMs (`Engine.tp_overlap`) is
applied in `Pricer.block_time`.
"""

from __future__ import annotations

from meshplan.ir import GpuSpec

from .collectives import Collective, Path, collective_time
from .graph_costs import BlockFacts, Composition


class TensorParallelTraffic:
    """The tensor-parallel methods of `pricer.Pricer` (see the module docstring)."""

    def tp_collectives(
        self, facts: BlockFacts, *, tp: int, cp: int, ep: int, sp: bool, scale: float
    ) -> tuple[tuple[str, Collective, float], ...]:
        """(phase, kind, bytes) of every TP collective of one instance of a block and one
        micro-batch: `facts.tp_collectives` at the micro-batch's size over cp, with or without
        SP. Under EP x TP (ep > 1, tp > 1; Megatron-Core requires SP there) the MoE experts'
        region moves the routed rows instead of the block output: each rank all-gathers over
        tp the rows its tp peers received from the ep all-to-all and reduce-scatters their
        partial outputs back, in forward and again (swapped) in backward. The rows a rank
        receives are its sequence shard's top_k x tokens / (cp x tp), at the busiest rank's
        load (`moe_load_factor`, as `_ep_traffic`); gathered over tp that is
        top_k x tokens / cp x hidden, i.e. `a2a_bytes` x scale / cp x the load factor."""
        if tp <= 1:
            return ()
        out = []
        for c in facts.tp_collectives:
            if c.experts and ep > 1 and facts.a2a_bytes:
                load = self.moe_load_factor(facts, tp=tp, cp=cp, ep=ep, sp=True, scale=scale)
                size = facts.a2a_bytes * scale / cp * load
                kinds = c.with_sp
            else:
                size = c.size_bytes * scale / cp
                kinds = c.with_sp if sp else c.without_sp
            out += [(c.phase, kind, size) for kind in kinds]
        return tuple(out)

    def _tp_traffic(
        self, facts, tp, cp, sp, scale, intra: Path, gpu: GpuSpec | None = None, ep: int = 1
    ) -> tuple[float, float]:
        out = {"fwd": 0.0, "bwd": 0.0}
        for phase, kind, size in self.tp_collectives(
            facts, tp=tp, cp=cp, ep=ep, sp=sp, scale=scale
        ):
            if self.comm is None or gpu is None:
                out[phase] += collective_time(kind, size, tp, intra)
            else:
                out[phase] += self.comm_choice(
                    kind, size, tp, intra, gpu, "activations", "tp"
                ).time_s
        return out["fwd"], out["bwd"]

    def sp_grad_sync(
        self, comp: Composition, *, tp: int, sp: bool, reductions: int = 1
    ) -> tuple[tuple[Collective, float, int], ...]:
        """The gradient all-reduces over tp of replicated parameters whose gradients are
        partial sums over tp, at each of the step's `reductions` gradient reductions (1; m
        under ZeRO-3, which reduce-scatters every micro-batch's gradients), as (kind, bytes,
        ranks): one all-reduce per parameter of
        - under sequence parallelism, each TP-replicated parameter
          (`BlockFacts.replicated_params`: norm weights, whose gradients are partial sums of
          each rank's tokens);
        - with or without SP, each MoE router parameter (`BlockFacts.router_params`: under
          expert TP the routing weights scale the experts' partial outputs, under EP x TP each
          tp rank routes its own sequence shard).
        torch's FSDP2 and `replicate` reduce each such `Partial` DTensor gradient before their
        own reduction, and meshplan's runtime does the same when there is no data parallelism
        (`runtime.tensor_parallel.reduce_partial_gradients`); Megatron-LM coalesces them into
        one all-reduce per step (`_allreduce_layernorm_grads`, the same volume)."""
        if tp <= 1:
            return ()
        out = []
        for key, count in comp:
            facts = self.costs.facts[key]
            numels = (facts.replicated_params if sp else ()) + facts.router_params
            for numel in numels:
                out += [(Collective.ALL_REDUCE, numel * self.reduce_bytes, tp)] * (
                    count * reductions
                )
        return tuple(out)
