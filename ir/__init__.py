"""meshplan.ir: the typed operator IR, the cluster vocabulary and the plan contract.

This floor imports nothing else of meshplan.
"""

from . import cluster_io  # noqa: F401  (installs Cluster.load and Cluster.preset)
from .cluster import Cluster, DeviceGroup, GroupLink, RankInfo
from .devices import GpuSpec, LinkKind, LinkTier
from .graph import DTYPE_BYTES, Block, Graph, ModelInfo, Op, OpKind, Param, TensorMeta, Unit
from .parallel import (
    MeshAxis,
    Parallel,
    Prediction,
    RankMemory,
    Recompute,
    Schedule,
    StageConfig,
    StagePlacement,
    group_tp_problem,
)
from .rules import microbatch_problem
from .trace import TraceError, trace

__all__ = [
    "DTYPE_BYTES",
    "Block",
    "Cluster",
    "DeviceGroup",
    "GpuSpec",
    "Graph",
    "GroupLink",
    "LinkKind",
    "LinkTier",
    "MeshAxis",
    "ModelInfo",
    "Op",
    "OpKind",
    "Param",
    "Parallel",
    "Prediction",
    "RankInfo",
    "RankMemory",
    "Recompute",
    "Schedule",
    "StageConfig",
    "StagePlacement",
    "TensorMeta",
    "Unit",
    "TraceError",
    "trace",
    "group_tp_problem",
    "microbatch_problem",
]
