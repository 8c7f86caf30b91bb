"""Learned operator latency: an efficiency in (0, 1] on top of the physics roofline.

    t(op) = physics_time(op, device) / efficiency(op, device),   efficiency = sigmoid(z)

`physics_time` (features.py) is the roofline without efficiency factors or kernel floor, so
a prediction is never faster than physics, and `z` comes from a small MLP over
`features.op_features` (op kind, shapes, dtype, FLOPs, bytes, intensity, waves, device
features). This is, at operator level, the lesson of CDMPP (Hu et al., "CDMPP: A Device-Model
Agnostic Framework for Latency Prediction of Tensor Programs", EuroSys'24): regress from op +
device features, bound by the roofline as NeuSight does, evaluate holding out whole model
families (benchmarks/op_latency.py).

Model: an ensemble of `ENSEMBLE` MLPs (features -> HIDDEN -> HIDDEN -> 2, SiLU), trained
full-batch with AdamW on the Huber loss of the log-time error (scale-free, close to
minimising relative error, robust to rows a shared host slowed down), averaged in
log-efficiency. Training rows are described by what their replay ran
(`Sample.measured_op`) on one descriptor per device type whose roofline bounds every row
(`dataset.bound_devices`). Training runs in torch on CPU (tens
of seconds for a few thousand rows); prediction is numpy only. The weights and the device
descriptors the model was trained on are saved to one `.npz` (`DEFAULT_MODEL`, ~200 KB).

Interface (the same one the analytic model offers, so either can price an op):

- `load_for_device(name) -> LatencyModel | None`: the shipped model when it was trained on
  device type `name` (a `GpuSpec.name`, "CPU" included), else None (use the analytic model).
- `LatencyModel.predict_op_time(op, gpu, dtype, backward=, scale=) -> seconds`, a drop-in
  for `compute.op_time` (kernel overhead included: measured times include it).
- `LatencyModel.efficiency(op, gpu, backward=)`, `covers(gpu)`, `predict_samples(samples)`.
- `train(samples, ...) -> LatencyModel`, `LatencyModel.save(path)`, `LatencyModel.load(path)`.

Assumptions: an op's time depends on its own shapes only (no fusion with neighbours, cold
vs warm caches as in a micro-benchmark loop: operands of small ops stay in cache); on a CPU
the model is specific to the thread count profiled (recorded in the descriptor).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from functools import cache
from pathlib import Path

import numpy as np
from meshplan.ir import GpuSpec, Op
from meshplan.ir.graph import TensorMeta

from .dataset import DATA_DIR, DeviceDescriptor, Sample, bound_devices
from .features import DeviceFeatures, feature_names, op_dtype, op_features, physics_time

DEFAULT_MODEL = DATA_DIR / "model.npz"
MODEL_VERSION = 1
HIDDEN = 64
# Members of the ensemble: 8 rather than 4 halved the spread of the leave-one-family-out
# validation MAPE between seeds (benchmarks/op_latency.py --validate; docs/op_latency.md).
ENSEMBLE = 8
# Huber loss on the log-time error (Huber 1964, "Robust estimation of a location
# parameter"): quadratic within HUBER_DELTA (0.3 in log, ~35%), linear beyond, so the few
# rows a busy shared host slowed down in every run do not pull the fit. 0.3 was chosen
# among 0.1 / 0.3 / 1.0 and squared error on the validation split (mean LOFO MAPE 12.2 /
# 10.9 / 13.5 / 18.4%), never on the held-out families.
HUBER_DELTA = 0.3


# Columns of `op_features` the model reads back: log2 physics time, backward flag.
_LG_PHYS = feature_names().index("lg_t_physics")
_BACKWARD = feature_names().index("backward")
# Unit of the overhead head: microseconds.
_OVERHEAD_UNIT_S = 1e-6


def _combine_log_eff(log_phys, backward, z_eff, z_ovh, floor, xp):
    """log efficiency of t = physics / sigmoid(z_eff) + overhead (numpy or torch).

    Two heads: the kernel's sustained fraction of the roofline, and a fixed per-call
    overhead (dispatch, launch, autograd bookkeeping) of
    exp(floor[0] + floor[1] * backward + softplus(z_ovh)) us. `floor` is learned once per
    model: the least overhead any call pays, forward and backward, so an op kind never seen
    cannot be predicted cheaper than the cheapest call. The efficiency physics / t stays in
    (0, 1].
    """
    unit = math.log(_OVERHEAD_UNIT_S)
    if xp is np:
        log_ovh = floor[0] + floor[1] * backward + np.logaddexp(0.0, z_ovh) + unit
        log_t = np.logaddexp(log_phys - _log_sigmoid(z_eff), log_ovh)
    else:
        log_ovh = floor[0] + floor[1] * backward + xp.nn.functional.softplus(z_ovh) + unit
        log_t = xp.logaddexp(log_phys - xp.nn.functional.logsigmoid(z_eff), log_ovh)
    return log_phys - log_t


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-np.clip(x, -60, 60)))


def _log_sigmoid(z: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -z)


def scale_op(op: Op, scale: float) -> Op:
    """`op` processing `scale` times its data: FLOPs, bytes and the leading dim scaled.

    Used for micro-batch / TP / CP shares (compute.op_time's `scale`). The leading dim of
    every input and output that has the op's leading size is scaled (rounded, at least 1);
    parameters (a different leading size) keep their shape. An approximation for ops whose
    shards cut another dim (e.g. a column-parallel GEMM shards N, not M); its FLOPs and bytes
    are exact.
    """
    if scale == 1.0:
        return op
    lead = op.outputs[0].shape[0] if op.outputs and op.outputs[0].shape else None

    def sc(t: TensorMeta) -> TensorMeta:
        if lead is None or not t.shape or t.shape[0] != lead:
            return t
        return TensorMeta((max(1, round(t.shape[0] * scale)), *t.shape[1:]), t.dtype)

    return dataclasses.replace(
        op,
        inputs=tuple(sc(t) for t in op.inputs),
        outputs=tuple(sc(t) for t in op.outputs),
        fwd_flops=round(op.fwd_flops * scale),
        bwd_flops=round(op.bwd_flops * scale),
        fwd_bytes=round(op.fwd_bytes * scale),
        bwd_bytes=round(op.bwd_bytes * scale),
    )


@dataclasses.dataclass
class LatencyModel:
    """A trained efficiency model and the devices it covers (see the module docstring)."""

    mean: np.ndarray
    std: np.ndarray
    layers: list[list[tuple[np.ndarray, np.ndarray]]]  # per ensemble member: (W, b) per layer
    floors: list[np.ndarray]  # per ensemble member: overhead floor (fwd, bwd extra), log us
    devices: dict[str, DeviceDescriptor]  # by canonical device name
    meta: dict

    # -- devices ------------------------------------------------------------------------------
    def covers(self, gpu: GpuSpec | str) -> bool:
        """True when the model was trained on measurements of this device type."""
        return _device_key(gpu.name if isinstance(gpu, GpuSpec) else gpu) in self.devices

    def device_features(self, gpu: GpuSpec | str) -> DeviceFeatures:
        """Measured features of a covered device, else the datasheet's (`GpuSpec`)."""
        name = gpu.name if isinstance(gpu, GpuSpec) else gpu
        desc = self.devices.get(_device_key(name))
        if desc is not None:
            return DeviceFeatures.from_descriptor(desc)
        if isinstance(gpu, str):
            from meshplan.ir.hardware import gpu_spec

            gpu = gpu_spec(gpu)
        return DeviceFeatures.from_spec(gpu)

    # -- prediction ---------------------------------------------------------------------------
    def _members(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per member: (log efficiency, overhead share of the time), each (members, rows)."""
        xs = (x - self.mean) / self.std
        lg_phys = x[:, _LG_PHYS] * np.log(2.0)
        bwd = x[:, _BACKWARD]
        log_effs, shares = [], []
        for member, floor in zip(self.layers, self.floors, strict=True):
            h = xs
            for i, (w, b) in enumerate(member):
                h = h @ w + b
                if i < len(member) - 1:
                    h = _silu(h)
            log_eff = _combine_log_eff(lg_phys, bwd, h[:, 0], h[:, 1], floor, np)
            log_kernel = lg_phys - _log_sigmoid(h[:, 0])
            log_effs.append(log_eff)
            # t = kernel + overhead and log_eff = log_phys - log t
            shares.append(1.0 - np.exp(np.minimum(log_kernel - (lg_phys - log_eff), 0.0)))
        return np.asarray(log_effs), np.asarray(shares)

    def _log_eff(self, x: np.ndarray) -> np.ndarray:
        xs = (x - self.mean) / self.std
        lg_phys = x[:, _LG_PHYS] * np.log(2.0)
        bwd = x[:, _BACKWARD]
        outs = []
        for member, floor in zip(self.layers, self.floors, strict=True):
            h = xs
            for i, (w, b) in enumerate(member):
                h = h @ w + b
                if i < len(member) - 1:
                    h = _silu(h)
            outs.append(_combine_log_eff(lg_phys, bwd, h[:, 0], h[:, 1], floor, np))
        return np.mean(outs, axis=0)

    def efficiency_batch(self, feats: np.ndarray) -> np.ndarray:
        """Efficiencies (0, 1] of a matrix of `op_features` rows."""
        return np.exp(self._log_eff(np.atleast_2d(feats)))

    def efficiency(
        self,
        op: Op,
        gpu: GpuSpec | DeviceFeatures | str,
        *,
        backward: bool = False,
        dtype: str | None = None,
    ) -> float:
        """Predicted fraction of the physics roofline that `op` reaches on `gpu`."""
        dev = gpu if isinstance(gpu, DeviceFeatures) else self.device_features(gpu)
        return float(self.efficiency_batch(op_features(op, dev, backward, dtype))[0])

    def predict_op_time(
        self,
        op: Op,
        gpu: GpuSpec | DeviceFeatures | str,
        dtype: str | None = None,
        *,
        backward: bool = False,
        scale: float = 1.0,
    ) -> float:
        """Seconds of one op (one direction) on one device, at `scale` times its traced data.

        Same contract as `compute.op_time`: zero for an op with no work in that direction;
        otherwise physics_time / efficiency, which includes the kernel's fixed overhead.
        `dtype` is a fallback: the op's own floating dtype decides.
        """
        flops = op.bwd_flops if backward else op.fwd_flops
        nbytes = op.bwd_bytes if backward else op.fwd_bytes
        if flops == 0 and nbytes == 0:
            return 0.0
        op = scale_op(op, scale)
        dev = gpu if isinstance(gpu, DeviceFeatures) else self.device_features(gpu)
        eff = self.efficiency(op, dev, backward=backward, dtype=dtype)
        return physics_time(op, dev, backward, dtype) / eff

    def predict_op_parts(
        self,
        op: Op,
        gpu: GpuSpec | DeviceFeatures | str,
        dtype: str | None = None,
        *,
        backward: bool = False,
    ) -> tuple[float, float]:
        """`predict_op_time` at the traced size split as (work seconds, overhead seconds).

        The work part scales with the op's share of the data (micro-batch, TP, CP), the
        overhead part does not: the same split as the analytic roofline + `KERNEL_FLOOR_S`,
        so `compute.BlockCompute` can aggregate learned times the way it does analytic ones.
        """
        total = self.predict_op_time(op, gpu, dtype, backward=backward)
        if total == 0.0:
            return 0.0, 0.0
        dev = gpu if isinstance(gpu, DeviceFeatures) else self.device_features(gpu)
        _, shares = self._members(np.atleast_2d(op_features(op, dev, backward, dtype)))
        overhead = total * float(np.mean(shares[:, 0]))
        return total - overhead, overhead

    def predict_parts_many(
        self, items: list[tuple[Op, bool]], gpu: GpuSpec | str, dtype: str | None = None
    ) -> np.ndarray:
        """`predict_op_parts` of many (op, backward) pairs at once: an array (n, 2) of
        (work, overhead) seconds, zero for a direction with no work. One batched pass of the
        ensemble (what `compute.block_compute` calls per block)."""
        out = np.zeros((len(items), 2))
        live = [i for i, (op, bwd) in enumerate(items) if _has_work(op, bwd)]
        if not live:
            return out
        dev = self.device_features(gpu)
        x = np.asarray([op_features(items[i][0], dev, items[i][1], dtype) for i in live])
        phys = np.asarray([physics_time(items[i][0], dev, items[i][1], dtype) for i in live])
        log_effs, shares = self._members(x)
        total = phys / np.exp(np.mean(log_effs, axis=0))
        overhead = total * np.mean(shares, axis=0)
        out[live, 0] = total - overhead
        out[live, 1] = overhead
        return out

    def describe(self) -> str:
        """Where the model comes from, for reports: file, devices, training rows."""
        path = self.meta.get("path", "")
        root = DATA_DIR.parents[1]
        try:
            path = str(Path(path).resolve().relative_to(root.resolve()))
        except ValueError:
            pass
        devices = ", ".join(sorted(self.devices))
        return f"{path}, trained on {devices}, {self.meta.get('rows', '?')} ops"

    def predict_samples(self, samples: list[Sample]) -> np.ndarray:
        """Predicted seconds of dataset samples (vectorised): the timed computation of each
        (`Sample.measured_op`) on the model's descriptor of its device type."""
        x, phys = design_matrix(samples, self.devices)
        return phys / self.efficiency_batch(x)

    def physics_samples(self, samples: list[Sample]) -> np.ndarray:
        """The physics roofline of dataset samples on the model's device descriptors."""
        return design_matrix(samples, self.devices)[1]

    # -- persistence --------------------------------------------------------------------------
    def save(self, path: Path | str = DEFAULT_MODEL) -> Path:
        """Write the model to one `.npz` (float32 weights, JSON metadata)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        arrays = {"mean": self.mean.astype(np.float32), "std": self.std.astype(np.float32)}
        for e, member in enumerate(self.layers):
            for i, (w, b) in enumerate(member):
                arrays[f"w{e}_{i}"] = w.astype(np.float32)
                arrays[f"b{e}_{i}"] = b.astype(np.float32)
            arrays[f"floor{e}"] = self.floors[e].astype(np.float32)
        meta = dict(
            self.meta,
            version=MODEL_VERSION,
            features=list(feature_names()),
            devices={k: d.to_dict() for k, d in self.devices.items()},
            ensemble=len(self.layers),
            depth=len(self.layers[0]),
        )
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez_compressed(path, **arrays)
        return path

    @classmethod
    def load(cls, path: Path | str = DEFAULT_MODEL) -> LatencyModel:
        """Read a model written by `save`; refuses other feature layouts and newer versions."""
        with np.load(path) as z:
            meta = json.loads(bytes(z["meta"]).decode())
            if meta["version"] > MODEL_VERSION:
                raise ValueError(
                    f"{path}: model version {meta['version']} is newer than {MODEL_VERSION}"
                )
            if tuple(meta["features"]) != feature_names():
                raise ValueError(f"{path}: trained on another feature layout; retrain it")
            layers = [
                [
                    (z[f"w{e}_{i}"].astype(np.float64), z[f"b{e}_{i}"].astype(np.float64))
                    for i in range(meta["depth"])
                ]
                for e in range(meta["ensemble"])
            ]
            floors = [z[f"floor{e}"].astype(np.float64) for e in range(meta["ensemble"])]
            mean, std = z["mean"].astype(np.float64), z["std"].astype(np.float64)
        devices = {k: DeviceDescriptor.from_dict(d) for k, d in meta.pop("devices").items()}
        meta["path"] = str(path)
        return cls(mean, std, layers, floors, devices, meta)


def _has_work(op: Op, backward: bool) -> bool:
    if backward:
        return bool(op.bwd_flops or op.bwd_bytes)
    return bool(op.fwd_flops or op.fwd_bytes)


def _device_key(name: str) -> str:
    from meshplan.ir.hardware import canonical_gpu_name

    return canonical_gpu_name(name) or name


def design_matrix(
    samples: list[Sample], devices: dict[str, DeviceDescriptor] | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(features, physics seconds) of dataset samples.

    Each sample is described by the computation that was timed (`Sample.measured_op`) on
    its device: the descriptor in `devices` for its device type when given (a model's
    bounded descriptors), else its own.
    """
    feats, phys = [], []
    cache_dev: dict[int, DeviceFeatures] = {}
    for s in samples:
        desc = (devices or {}).get(_device_key(s.device.name), s.device)
        dev = cache_dev.setdefault(id(desc), DeviceFeatures.from_descriptor(desc))
        op = s.measured_op
        feats.append(op_features(op, dev, s.backward, s.dtype))
        phys.append(physics_time(op, dev, s.backward, s.dtype))
    return np.asarray(feats), np.asarray(phys)


def train(
    samples: list[Sample],
    *,
    epochs: int = 1500,
    hidden: int = HIDDEN,
    ensemble: int = ENSEMBLE,
    lr: float = 5e-3,
    weight_decay: float = 1e-3,
    seed: int = 0,
    threads: int = 1,
    offsets: np.ndarray | None = None,
    bound: bool = True,
    ignore: tuple[str, ...] = (),
) -> LatencyModel:
    """Fit the efficiency MLPs to measured samples (seconds to a minute on one core).

    The target is log(measured seconds); the prediction log(physics) - log(efficiency). A
    measurement faster than the roofline (possible only within the roofline's own error)
    pulls the efficiency towards 1 and no further.

    `offsets` (seconds, one per sample, default none): time a measurement includes that is
    not the op's, e.g. the launch and event pair around one timed call. The loss compares
    prediction + offset with the measurement, so the model learns the op alone and a caller
    adds the offset of its own measurement back. `bound=False` keeps every sample's
    descriptor as given instead of `bound_devices`: for devices known by their datasheet,
    where a held-out device has no rows to raise its roofline by, so the training devices'
    rooflines must not be raised either. `ignore` names `feature_names` columns the nets do
    not read (standardised to 0, like a column constant in training).
    """
    import torch

    if offsets is not None and len(offsets) != len(samples):
        raise ValueError(f"train: {len(offsets)} offsets for {len(samples)} samples")
    prev_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    if bound:
        samples = bound_devices(samples)
    try:
        x, phys = design_matrix(samples)
        y = np.log(np.asarray([s.seconds for s in samples]))
        if offsets is not None:  # log of the extra seconds (1e-30 s where there are none)
            log_offset = torch.tensor(
                np.log(np.maximum(np.asarray(offsets, dtype=np.float64), 1e-30)),
                dtype=torch.float32,
            )
        mean = x.mean(0)
        std = x.std(0)
        # Columns constant in training (a packet never profiled) carry no information the
        # nets could have learned: an infinite scale maps them to 0 at prediction too, so
        # an unseen category falls back on its kind and class instead of extrapolating.
        std[std < 1e-8] = np.inf
        std[[feature_names().index(c) for c in ignore]] = np.inf
        xs = torch.tensor((x - mean) / std, dtype=torch.float32)
        log_phys = torch.tensor(x[:, _LG_PHYS] * np.log(2.0), dtype=torch.float32)
        target = torch.tensor(y, dtype=torch.float32)
        bwd = torch.tensor(x[:, _BACKWARD], dtype=torch.float32)
        members, floors = [], []
        for e in range(ensemble):
            torch.manual_seed(seed + e)
            net = torch.nn.Sequential(
                torch.nn.Linear(x.shape[1], hidden),
                torch.nn.SiLU(),
                torch.nn.Linear(hidden, hidden),
                torch.nn.SiLU(),
                torch.nn.Linear(hidden, 2),
            )
            with torch.no_grad():
                net[-1].bias.copy_(torch.tensor([0.0, -2.0]))  # efficiency 0.5, overhead ~floor
            floor = torch.nn.Parameter(torch.zeros(2))  # 1 us forward and backward to start
            params = [{"params": net.parameters()}, {"params": [floor], "weight_decay": 0.0}]
            opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
            for _ in range(epochs):
                opt.zero_grad()
                z = net(xs)
                log_eff = _combine_log_eff(log_phys, bwd, z[:, 0], z[:, 1], floor, torch)
                # log(pred) - log(measured): prediction = physics / efficiency (+ offset)
                log_pred = log_phys - log_eff
                if offsets is not None:
                    log_pred = torch.logaddexp(log_pred, log_offset)
                err = log_pred - target
                loss = torch.nn.functional.huber_loss(err, torch.zeros_like(err), delta=HUBER_DELTA)
                loss.backward()
                opt.step()
                sched.step()
            members.append(
                [
                    (
                        lin.weight.detach().double().numpy().T.copy(),
                        lin.bias.detach().double().numpy().copy(),
                    )
                    for lin in (net[0], net[2], net[4])
                ]
            )
            floors.append(floor.detach().double().numpy().copy())
    finally:
        torch.set_num_threads(prev_threads)
    devices = {_device_key(s.device.name): s.device for s in samples}
    meta = {
        "rows": len(samples),
        "families": sorted({s.family for s in samples}),
        "train_seconds": round(time.perf_counter() - t0, 2),
        "hidden": hidden,
        "epochs": epochs,
        "offsets": offsets is not None,
        "bound": bound,
        "ignore": list(ignore),
    }
    return LatencyModel(mean, std, members, floors, devices, meta)


@cache
def _load_default(path: str) -> LatencyModel | None:
    p = Path(path)
    if not p.exists():
        return None
    return LatencyModel.load(p)


def load_for_device(name: str, path: Path | str | None = None) -> LatencyModel | None:
    """The trained model when it covers device type `name` (e.g. "CPU", "H100"), else None.

    Loaded once per process from `path` (default `data/op_latency/model.npz`). Setting the
    environment variable `MESHPLAN_LEARNED_LATENCY=0` turns the learned model off (None).
    """
    if os.environ.get("MESHPLAN_LEARNED_LATENCY", "1") in ("0", "off", "false"):
        return None
    model = _load_default(str(path or DEFAULT_MODEL))
    if model is None or not model.covers(name):
        return None
    return model


def mape(pred: np.ndarray, meas: np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    return float(np.mean(np.abs(pred - meas) / meas) * 100.0)


__all__ = [
    "DEFAULT_MODEL",
    "LatencyModel",
    "design_matrix",
    "load_for_device",
    "mape",
    "op_dtype",
    "scale_op",
    "train",
]
