"""The op-latency dataset: its records, and reading and writing it.

`meshplan profile` (`meshplan.measure.profile`) measures ops and appends rows here; the
learned latency model (`learned.py`) and `benchmarks/op_latency.py` read them back. Fitting
a model to these numbers is pricing, so the format lives beside the model; measuring lives
in `meshplan.measure`.

Dataset format (`SCHEMA_VERSION`): gzipped JSON lines. A run appends one `device` record
(schema version, descriptor: name, processor, cores/threads, clock, caches, torch version,
and the host's measured peak GEMM FLOP/s per dtype and memory bandwidth) followed by its
`row` records, each carrying the id of its device record. Since schema 2 a row also holds
`timed`: the FLOPs and bytes of what its replay ran (`measure.profile.ReplayCounts`), which
for traced ops can be less than the IR charges. gzip members concatenate, so appending is
opening the file in append mode; `load_dataset` reads every member (and schema 1 rows,
without `timed`). Runs appended at different times are folded per op into the fastest
(`aggregate_runs`) for training and evaluation.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import statistics
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from meshplan.ir import Op, OpKind
from meshplan.ir.graph import TensorMeta

from .features import effective_flops, essential_bytes, op_dtype

# 1: first release. 2: rows carry `timed` (the replay's own FLOPs and bytes).
SCHEMA_VERSION = 2


# Repository folder of the shipped datasets and trained weights (outside the package).
DATA_DIR = Path(
    os.environ.get(
        "MESHPLAN_OP_LATENCY_DIR", Path(__file__).resolve().parents[1] / "data" / "op_latency"
    )
)


@dataclass(frozen=True, slots=True)
class DeviceDescriptor:
    """What a dataset was measured on, including the peaks measured on it.

    `name` is the canonical GPU type (`meshplan.ir.hardware` name: "H100", ...) or "CPU".
    `cores` is the parallelism actually used (CPU threads, or SMs). `peak_flops` holds the
    best GEMM FLOP/s measured per dtype, `mem_bandwidth` a large-copy (DRAM/HBM) bandwidth
    and `cache_bandwidth` the best copy bandwidth at any size (on-chip caches), all measured.
    """

    name: str
    processor: str
    backend: str  # "cpu" or "cuda"
    cores: int
    clock_hz: float
    l2_bytes: int
    l3_bytes: int
    memory_bytes: int
    torch_version: str
    peak_flops: tuple[tuple[str, float], ...]
    mem_bandwidth: float
    cache_bandwidth: float
    timer: str = "wall"  # "wall" (synchronised wall clock) or "thread_cpu" (see `clock_for`)
    schema: int = SCHEMA_VERSION

    def peak(self, dtype: str) -> float:
        """Measured peak FLOP/s for `dtype` (float32's for dtypes not measured)."""
        table = dict(self.peak_flops)
        return table.get(dtype, table.get("float32", max(table.values())))

    @property
    def id(self) -> str:
        """Stable short hash of the descriptor (rows refer to their device by it)."""
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["peak_flops"] = [list(p) for p in self.peak_flops]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> DeviceDescriptor:
        d = dict(d)
        d["peak_flops"] = tuple((str(k), float(v)) for k, v in d["peak_flops"])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


def op_to_dict(op: Op) -> dict:
    """The dataset row's form of an IR op (`op_from_dict` reads it back)."""
    return {
        "name": op.name,
        "kind": op.kind.value,
        "target": op.target,
        "inputs": [[list(t.shape), t.dtype] for t in op.inputs],
        "outputs": [[list(t.shape), t.dtype] for t in op.outputs],
        "fwd_flops": op.fwd_flops,
        "bwd_flops": op.bwd_flops,
        "fwd_bytes": op.fwd_bytes,
        "bwd_bytes": op.bwd_bytes,
        "attrs": [[k, v] for k, v in op.attrs if isinstance(v, (bool, int, float, str))],
    }


def op_from_dict(d: dict) -> Op:
    """Rebuild the IR op of a dataset row."""
    return Op(
        d["name"],
        OpKind(d["kind"]),
        d["target"],
        "",
        tuple(TensorMeta(tuple(s), dt) for s, dt in d["inputs"]),
        tuple(TensorMeta(tuple(s), dt) for s, dt in d["outputs"]),
        fwd_flops=int(d["fwd_flops"]),
        bwd_flops=int(d["bwd_flops"]),
        fwd_bytes=int(d["fwd_bytes"]),
        bwd_bytes=int(d["bwd_bytes"]),
        attrs=tuple(sorted((str(k), v) for k, v in d["attrs"])),
    )


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured (op, direction) on one device."""

    family: str
    model: str
    op: Op
    backward: bool
    dtype: str
    seconds: float
    spread: float
    device: DeviceDescriptor
    runs: int = 1  # measurements folded into `seconds` (see `aggregate_runs`)
    timed: tuple[int, int, int, int] | None = None  # replay's (fwd/bwd FLOPs, fwd/bwd bytes)

    @property
    def measured_op(self) -> Op:
        """The op with the FLOPs and bytes of what was timed (`ReplayCounts`).

        Rows of schema 1 datasets did not record them: the IR's counts stand in.
        """
        if self.timed is None:
            return self.op
        ff, bf, fb, bb = self.timed
        return dataclasses.replace(self.op, fwd_flops=ff, bwd_flops=bf, fwd_bytes=fb, bwd_bytes=bb)

    @property
    def flops(self) -> int:
        return self.op.bwd_flops if self.backward else self.op.fwd_flops

    @property
    def nbytes(self) -> int:
        return self.op.bwd_bytes if self.backward else self.op.fwd_bytes


@dataclass
class Dataset:
    """Samples of one or more datasets, with their device descriptors by id."""

    samples: list[Sample] = field(default_factory=list)
    devices: dict[str, DeviceDescriptor] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.samples)


def aggregate_runs(samples: list[Sample]) -> list[Sample]:
    """One sample per distinct (device type, family, model, op, direction): the fastest run.

    Each run's time is already a robust median; across runs (profiles appended at different
    times) the fastest is kept, because on a shared host other processes only ever slow an
    op down. `spread` becomes the relative range between runs, `runs` their number.
    """
    groups: dict[tuple, list[Sample]] = {}
    for s in samples:
        key = (
            s.device.name,
            s.family,
            s.model,
            s.op.target,
            s.op.inputs,
            s.op.outputs,
            s.op.attrs,
            s.backward,
        )
        groups.setdefault(key, []).append(s)
    out = []
    for group in groups.values():
        best = min(group, key=lambda s: s.seconds)
        worst = max(s.seconds for s in group)
        spread = (worst - best.seconds) / best.seconds
        out.append(dataclasses.replace(best, spread=spread, runs=len(group)))
    return out


def append_dataset(path: Path, device: DeviceDescriptor, rows: list[dict]) -> None:
    """Append one device record and its rows to `path` (a new gzip member)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "at", encoding="utf-8") as f:
        f.write(
            json.dumps(
                {
                    "type": "device",
                    "schema": SCHEMA_VERSION,
                    "id": device.id,
                    "device": device.to_dict(),
                    "time": time.time(),
                }
            )
            + "\n"
        )
        for r in rows:
            f.write(
                json.dumps({"type": "row", "v": SCHEMA_VERSION, "device": device.id, **r}) + "\n"
            )


def _timed(d: dict | None) -> tuple[int, int, int, int] | None:
    if d is None:
        return None
    return (int(d["fwd_flops"]), int(d["bwd_flops"]), int(d["fwd_bytes"]), int(d["bwd_bytes"]))


def bound_devices(samples: list[Sample]) -> list[Sample]:
    """One descriptor per device type whose roofline bounds every one of `samples`.

    Runs appended at different times each measured their own peaks; this folds them into
    one descriptor per device name (what `DeviceFeatures` and the physics roofline read):
    the highest peak FLOP/s per dtype and the highest cache bandwidth of any run, each
    raised to the best any sample reached (FLOP/s, and essential bytes per second: on the
    profiled CPU an `add` in L1/L2 and a GEMV stream 90-103 GB/s where `copy_` reached 72). This is
    the empirical roofline (Lo et al. 2014, "Roofline Model Toolkit"); large-copy bandwidth
    is the median of the runs. Samples keep everything else.
    """
    by_name: dict[str, list[Sample]] = {}
    for s in samples:
        by_name.setdefault(s.device.name, []).append(s)
    bounded: dict[str, DeviceDescriptor] = {}
    for name, group in by_name.items():
        descs = list({id(s.device): s.device for s in group}.values())
        peaks: dict[str, float] = {}
        for d in descs:
            for dt, v in d.peak_flops:
                peaks[dt] = max(peaks.get(dt, 0.0), v)
        cache_bw = max(d.cache_bandwidth for d in descs)
        for s in group:
            op = s.measured_op
            flops = effective_flops(op, s.backward)
            dt = op_dtype(op, s.dtype)
            if flops:
                key = dt if dt in peaks else "float32"
                peaks[key] = max(peaks.get(key, 0.0), flops / s.seconds)
            cache_bw = max(cache_bw, essential_bytes(op, s.backward) / s.seconds)
        bounded[name] = dataclasses.replace(
            descs[-1],  # the latest run's facts (caches, clock, versions)
            peak_flops=tuple(sorted(peaks.items())),
            cache_bandwidth=cache_bw,
            mem_bandwidth=statistics.median(d.mem_bandwidth for d in descs),
        )
    return [dataclasses.replace(s, device=bounded[s.device.name]) for s in samples]


def load_dataset(paths: Iterable[Path] | Path | None = None) -> Dataset:
    """Read datasets (default: every `*.jsonl.gz` under `DATA_DIR`); rejects newer schemas."""
    if paths is None:
        paths = sorted(DATA_DIR.glob("*.jsonl.gz"))
    elif isinstance(paths, (str, Path)):
        paths = [Path(paths)]
    ds = Dataset()
    for p in paths:
        with gzip.open(p, "rt", encoding="utf-8") as f:
            for line in f:
                rec = json.loads(line)
                if rec["type"] == "device":
                    if rec["schema"] > SCHEMA_VERSION:
                        raise ValueError(
                            f"{p}: dataset schema {rec['schema']} is newer than {SCHEMA_VERSION}"
                        )
                    ds.devices[rec["id"]] = DeviceDescriptor.from_dict(rec["device"])
                elif rec["type"] == "row":
                    dev = ds.devices[rec["device"]]
                    ds.samples.append(
                        Sample(
                            rec["family"],
                            rec["model"],
                            op_from_dict(rec["op"]),
                            rec["backward"],
                            rec["dtype"],
                            float(rec["seconds"]),
                            float(rec.get("spread", 0.0)),
                            dev,
                            timed=_timed(rec.get("timed")),
                        )
                    )
    return ds


def default_path(device: DeviceDescriptor) -> Path:
    """Where a device's dataset lives: `DATA_DIR/<name>.jsonl.gz` (e.g. `cpu.jsonl.gz`)."""
    return DATA_DIR / f"{device.name.lower().replace(' ', '-')}.jsonl.gz"
