"""`meshplan calibrate`: measure the machines meshplan plans for and write a cluster profile.

What is measured (docs/fidelity.md, "Calibration on your machines"):

- **Collective curves per link tier.** For every tier present among the ranks: the *intra-node*
  tier with all ranks of the first node, and, when the ranks span several hosts, the
  *inter-node* tier with one rank per node. On each tier every collective of
  `COLLECTIVES` runs at message sizes from `min_size` to `max_size` (doubling): `warmup`
  untimed then `iters` timed calls, nccl-tests style (NVIDIA/nccl-tests doc/PERFORMANCE.md:
  the size is the all-reduced buffer, the gathered output, the scattered input, the
  all-to-all buffer, the bytes sent; send/recv is timed as a ping-pong between the first two
  ranks, halved). A size's time is the slowest rank's mean, so one straggler shows.
- **GEMM efficiency.** On the first rank's device, `(m x k) @ (k x n)` for a few shapes and
  dtypes, achieved FLOP/s (2mnk / time) against the GPU type's datasheet dense peak
  (`meshplan.ir.hardware`).

The result is a `ClusterProfile` (`meshplan.ir.cluster`), written as JSON or YAML with a
version and checked against `meshplan.ir.cluster_io.PROFILE_SCHEMA` when read. `meshplan plan`
and `meshplan estimate` take it with `--profile FILE`, a cluster file with `profile: FILE`,
or in Python `cluster.with_profile(load_profile(FILE))`; the cost model then prices the
measured tiers with the measured curves and each measured GPU type with its measured GEMM
efficiency (`Cluster.with_profile`, `meshplan.cost_model.collectives`).

Backends: gloo over CPU processes (the only choice without GPUs; tier "loopback"), NCCL over
CUDA devices. `calibrate` starts `nproc` ranks on this host itself (forked, as
`meshplan.runtime.launch.run_local`; NCCL runs in a subgroup over CUDA devices, one per
rank). Across hosts, start it under torchrun on every node:

    torchrun --nnodes 2 --nproc-per-node 8 ... -m meshplan.measure.calibrate \\
        --inter-link ib-ndr --nics-per-node 8 --out profile.json
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from meshplan.ir.cluster import (
    CPU_GEMM_SHAPES,
    GPU_GEMM_SHAPES,
    PROFILE_COLLECTIVES,
    ClusterProfile,
    CodecMeasurement,
    CollectiveCurve,
    GemmMeasurement,
    TierProfile,
)

from .codec_speed import measure_codec_speed

COLLECTIVES = PROFILE_COLLECTIVES
KiB, MiB = 2**10, 2**20


class CalibrateError(ValueError):
    """A calibration that cannot run as asked (one-line message for the CLI)."""


@dataclass(frozen=True)
class CalibrateConfig:
    """What to measure. Sizes in bytes; `gemm_shapes` as (m, n, k)."""

    min_size: int = 4 * KiB
    max_size: int = 64 * MiB
    collectives: tuple[str, ...] = COLLECTIVES
    warmup: int = 2
    iters: int = 5
    backend: str = "auto"  # "gloo", "nccl" or "auto" (nccl when CUDA is available)
    gpu: str | None = None  # GPU type name (spec table); None: detect
    intra_link: str | None = None  # tier name inside a node; None: the GPU type's default
    inter_link: str | None = None  # tier name between nodes (needed with several hosts)
    nics_per_node: int = 1
    gemm: bool = True
    gemm_shapes: tuple[tuple[int, int, int], ...] | None = None
    gemm_dtypes: tuple[str, ...] | None = None
    gemm_iters: int = 3
    codec: bool = True  # time the lossless codec (its speed decides where it pays)
    codec_numel: int = 1 << 22  # values of the large tensor that sets the codec throughput

    def sizes(self) -> list[int]:
        """min_size, 2 min_size, ... up to max_size (inclusive)."""
        out, s = [], self.min_size
        while s <= self.max_size:
            out.append(s)
            s *= 2
        return out

    def check(self) -> None:
        """Raise CalibrateError for settings that cannot work."""
        if self.min_size < 4 or self.max_size < self.min_size:
            raise CalibrateError(
                f"sizes: need 4 <= min_size <= max_size, got {self.min_size}..{self.max_size}"
            )
        bad = [c for c in self.collectives if c not in COLLECTIVES]
        if bad or not self.collectives:
            raise CalibrateError(
                f"unknown collective {bad[0] if bad else '(none)'!r}; choose from "
                f"{', '.join(COLLECTIVES)}"
            )
        if self.warmup < 0 or self.iters < 1 or self.gemm_iters < 1:
            raise CalibrateError("iters must be >= 1 and warmup >= 0")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise CalibrateError(f"backend must be auto, gloo or nccl, got {self.backend!r}")
        if self.nics_per_node < 1:
            raise CalibrateError(f"nics_per_node must be >= 1, got {self.nics_per_node}")
        from meshplan.ir.graph import DTYPE_BYTES

        for d in self.gemm_dtypes or ():
            if d not in DTYPE_BYTES:
                raise CalibrateError(
                    f"unknown dtype {d!r} for --gemm-dtypes; use torch names such as "
                    "bfloat16, float16, float32"
                )


@dataclass
class _Setup:
    """Resolved per-run facts (rank side)."""

    backend: str
    device: str  # "cpu" or "cuda"
    gpu: str
    intra_link: str
    inter_link: str | None
    hosts: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------
# Names and devices
# ---------------------------------------------------------------------------------------------


def detect_gpu(device: str) -> str | None:
    """The spec-table name of this rank's device: "CPU" on CPU; on CUDA the device name with
    the vendor prefix dropped ("NVIDIA H100 80GB HBM3" -> H100), or None if not in the table."""
    from meshplan.ir.hardware import canonical_gpu_name

    if device == "cpu":
        return "CPU"
    import torch

    name = torch.cuda.get_device_name()
    words = name.replace("NVIDIA", "").replace("Tesla", "").split()
    for n in range(len(words), 0, -1):  # longest prefix that is a known alias
        got = canonical_gpu_name(" ".join(words[:n]))
        if got is not None:
            return got
    return None


def _resolve_names(cfg: CalibrateConfig, device: str) -> tuple[str, str]:
    """(GPU type, intra-node tier) for this run, or CalibrateError saying which flag to give."""
    from meshplan.ir.hardware import UnknownGpuError, default_intra_link, gpu_spec

    gpu = cfg.gpu or detect_gpu(device)
    if gpu is None:
        raise CalibrateError("cannot tell the GPU type of this device; give --gpu (e.g. H100)")
    try:
        gpu = gpu_spec(gpu).name
    except UnknownGpuError as e:
        raise CalibrateError(str(e)) from None
    # Any tier name is allowed (a cluster file may define its own tiers); it must match the
    # cluster's tier for the profile to apply (`Cluster.with_profile` says so otherwise).
    intra = cfg.intra_link or default_intra_link(gpu)
    for name in (intra, cfg.inter_link):
        if name is not None and not name.strip():
            raise CalibrateError("link tier names must not be empty")
    return gpu, intra


# ---------------------------------------------------------------------------------------------
# Rank side: timing
# ---------------------------------------------------------------------------------------------


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _run_collective(kind: str, size: int, group, device: str, warmup: int, iters: int) -> float:
    """Mean seconds of one `kind` of `size` bytes (float32) over `group`, on this rank."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    elems = max(n, size // 4)
    elems -= elems % n
    opts = {"dtype": torch.float32, "device": device}
    if kind == "all_reduce":
        buf = torch.ones(elems, **opts)

        def op() -> None:
            dist.all_reduce(buf, group=group)
    elif kind == "all_gather":
        out = torch.empty(elems, **opts)
        inp = torch.ones(elems // n, **opts)

        # torch >= 2.10 names it all_gather_single (all_gather_into_tensor is deprecated).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

        def op() -> None:
            gather(out, inp, group=group)
    elif kind == "reduce_scatter":
        inp = torch.ones(elems, **opts)
        out = torch.empty(elems // n, **opts)

        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

        def op() -> None:
            scatter(out, inp, group=group)
    elif kind == "all_to_all":
        inp = torch.ones(elems, **opts)
        out = torch.empty(elems, **opts)

        def op() -> None:
            dist.all_to_all_single(out, inp, group=group)
    elif kind == "p2p":
        buf = torch.ones(elems, **opts)
        peers = dist.get_process_group_ranks(group)[:2]

        def op() -> None:  # ping-pong between the first two ranks; the others wait
            if me == 0:
                dist.send(buf, peers[1], group=group)
                dist.recv(buf, peers[1], group=group)
            elif me == 1:
                dist.recv(buf, peers[0], group=group)
                dist.send(buf, peers[0], group=group)
    else:  # pragma: no cover - CalibrateConfig.check refuses it
        raise CalibrateError(f"unknown collective {kind!r}")
    for _ in range(warmup):
        op()
    _sync(device)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    for _ in range(iters):
        op()
    _sync(device)
    elapsed = (time.perf_counter() - t0) / iters
    return elapsed / 2 if kind == "p2p" else elapsed


def _slowest(seconds: float, group, device: str) -> float:
    """The largest of every rank's `seconds` (one all-reduce MAX over `group`)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _measure_tier(
    cfg: CalibrateConfig, group, device: str, ranks: int, label: str, echo: Callable[[str], None]
) -> list[CollectiveCurve]:
    """Every configured collective at every size over `group` (called by its members)."""
    curves = []
    for kind in cfg.collectives:
        points = []
        t_start = time.perf_counter()
        for size in cfg.sizes():
            elems = max(ranks, size // 4)
            nbytes = 4 * (elems - elems % ranks)
            mean = _run_collective(kind, nbytes, group, device, cfg.warmup, cfg.iters)
            points.append((nbytes, _slowest(mean, group, device)))
        curves.append(CollectiveCurve(kind, ranks, tuple(points)))
        busbw = max(s * _busbw_factor(kind, ranks) / t for s, t in points)
        echo(
            f"  {label}: {kind:<14} {len(points)} sizes {_human(points[0][0])}.."
            f"{_human(points[-1][0])}, best busbw {busbw / 1e9:.2f} GB/s "
            f"({time.perf_counter() - t_start:.1f} s)"
        )
    return curves


def _busbw_factor(kind: str, n: int) -> float:
    from meshplan.ir.cluster import busbw_factor

    return busbw_factor(kind, n)


def _human(nbytes: float) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes:g} B"


def measure_gemm(
    gpu: str,
    device: str,
    shapes: Sequence[tuple[int, int, int]],
    dtypes: Sequence[str],
    iters: int,
    echo: Callable[[str], None] = lambda _: None,
) -> list[GemmMeasurement]:
    """Time `(m x k) @ (k x n)` for every shape and dtype on `device` (best of `iters` after one
    warm-up) against `gpu`'s dense peak for that dtype."""
    import torch
    from meshplan.ir.hardware import gpu_spec

    spec = gpu_spec(gpu)
    out = []
    for dtype_name in dtypes:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise CalibrateError(f"unknown dtype {dtype_name!r} (use torch names: bfloat16, ...)")
        try:
            peak = spec.peak(dtype_name)
        except KeyError as e:
            raise CalibrateError(str(e).strip("'\"")) from None
        for m, n, k in shapes:
            a = torch.randn(m, k, device=device).to(dtype)
            b = torch.randn(k, n, device=device).to(dtype)
            torch.matmul(a, b)
            _sync(device)
            best = math.inf
            for _ in range(iters):
                t0 = time.perf_counter()
                torch.matmul(a, b)
                _sync(device)
                best = min(best, time.perf_counter() - t0)
            g = GemmMeasurement(spec.name, dtype_name, m, n, k, best, peak)
            out.append(g)
            echo(
                f"  gemm {dtype_name} {m}x{n}x{k}: {g.achieved_flops / 1e12:.3f} TFLOP/s, "
                f"{g.efficiency:.1%} of the {peak / 1e12:g} TFLOP/s peak"
            )
    return out


def rank_main(cfg: CalibrateConfig, echo: Callable[[str], None] | None = None) -> ClusterProfile:
    """Run the calibration on this rank (the default process group must be initialised);
    every rank returns the same profile."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    say = (echo or (lambda s: print(s, file=sys.stderr, flush=True))) if rank == 0 else None

    def log(msg: str) -> None:
        if say is not None:
            say(msg)

    backend = cfg.backend
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = "cuda" if backend == "nccl" else "cpu"
    if device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local % torch.cuda.device_count())
    gpu, intra = _resolve_names(cfg, device)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    nodes = list(dict.fromkeys(hosts))
    first = [r for r in range(world) if hosts[r] == nodes[0]]
    leaders = [hosts.index(h) for h in nodes]
    per_node = len(first)
    if len(nodes) > 1 and not cfg.inter_link:
        raise CalibrateError(
            f"the ranks span {len(nodes)} hosts: name the network between them with "
            "--inter-link (a link tier, e.g. ib-ndr, roce-400g)"
        )
    # Every rank creates every subgroup (torch.distributed requires it), in the same order.
    intra_group = dist.new_group(first, backend=backend) if len(first) > 1 else None
    inter_group = dist.new_group(leaders, backend=backend) if len(leaders) > 1 else None
    log(
        f"calibrate: {world} rank(s) on {len(nodes)} host(s), {backend} on {device}, "
        f"GPU type {gpu}; sizes {_human(cfg.min_size)}..{_human(cfg.max_size)}"
    )
    tiers = []
    if intra_group is not None:
        curves = None
        if rank in first:
            curves = _measure_tier(cfg, intra_group, device, len(first), intra, log)
        got: list = [None]
        if rank == 0:
            got = [curves]
        dist.broadcast_object_list(got, src=0)
        tiers.append(TierProfile(intra, True, per_node, cfg.nics_per_node, per_node, tuple(got[0])))
    if inter_group is not None:
        assert cfg.inter_link
        curves = None
        if rank in leaders:
            curves = _measure_tier(cfg, inter_group, device, len(leaders), cfg.inter_link, log)
        got = [curves]
        dist.broadcast_object_list(got, src=0)
        tiers.append(
            TierProfile(cfg.inter_link, False, per_node, cfg.nics_per_node, 1, tuple(got[0]))
        )
    if not tiers:
        log("calibrate: one rank only: no link tier to measure (give --nproc 2 or more)")
    gemm: list[GemmMeasurement] = []
    if cfg.gemm:
        if rank == 0:
            shapes = cfg.gemm_shapes or (GPU_GEMM_SHAPES if device == "cuda" else CPU_GEMM_SHAPES)
            dtypes = cfg.gemm_dtypes or (("bfloat16",) if device == "cuda" else ("float32",))
            gemm = measure_gemm(gpu, device, shapes, dtypes, cfg.gemm_iters, log)
        box: list = [gemm]
        dist.broadcast_object_list(box, src=0)
        gemm = box[0]
    codec: list[CodecMeasurement] = []
    if cfg.codec:
        if rank == 0:
            log(f"calibrate: lossless codec, bf16, {cfg.codec_numel:,} values")
            sp = measure_codec_speed(device, "bfloat16", numel=cfg.codec_numel)
            codec = [
                CodecMeasurement(
                    gpu,
                    "bfloat16",
                    sp.compress_bps,
                    sp.decompress_bps,
                    sp.compress_overhead_s,
                    sp.decompress_overhead_s,
                )
            ]
        box = [codec]
        dist.broadcast_object_list(box, src=0)
        codec = box[0]
    source = (
        f"meshplan calibrate on {nodes[0]}{' +' + str(len(nodes) - 1) if len(nodes) > 1 else ''}"
        f", {world} ranks, {backend}/{device}, torch {torch.__version__}, "
        f"python {platform.python_version()}, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
    )
    return ClusterProfile(tiers=tuple(tiers), gemm=tuple(gemm), codec=tuple(codec), source=source)


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------


def _local_rank_fn(cfg: CalibrateConfig, threads: int) -> ClusterProfile:
    import torch

    torch.set_num_threads(threads)
    return rank_main(cfg)


def calibrate(
    nproc: int,
    cfg: CalibrateConfig | None = None,
    *,
    timeout_s: float = 600.0,
    threads_per_rank: int = 1,
) -> ClusterProfile:
    """Start `nproc` ranks on this host, measure, and return the profile (rank 0's).

    Raises CalibrateError for bad settings and `meshplan.runtime.errors.RankFailure` naming
    the rank that failed."""
    from meshplan.runtime.launch import run_local

    cfg = cfg or CalibrateConfig()
    cfg.check()
    if nproc < 1:
        raise CalibrateError(f"--nproc must be >= 1, got {nproc}")
    import torch

    if cfg.backend == "gloo" or (cfg.backend == "auto" and not torch.cuda.is_available()):
        _resolve_names(cfg, "cpu")  # a bad --gpu fails here, before any rank starts
    if cfg.backend == "nccl":
        if not torch.cuda.is_available():
            raise CalibrateError("backend nccl needs CUDA devices; none is visible (use gloo)")
        if nproc > torch.cuda.device_count():
            raise CalibrateError(
                f"--nproc {nproc} exceeds the {torch.cuda.device_count()} visible CUDA devices"
            )
    results = run_local(
        _local_rank_fn,
        nproc,
        cfg,
        threads_per_rank,
        timeout_s=timeout_s,
        collective_timeout_s=timeout_s,
        threads_per_rank=threads_per_rank,
    )
    return results[0]


def summary(profile: ClusterProfile) -> list[str]:
    """Readable lines: per tier the large-message bus bandwidth and the smallest time of each
    collective; per GPU type the median GEMM efficiency."""
    from meshplan.ir.cluster import busbw_factor

    lines = []
    for t in profile.tiers:
        where = "inside a node" if t.intra_node else "between nodes"
        lines.append(f"tier {t.tier} ({where}):")
        for c in t.curves:
            bw = max(s * busbw_factor(c.collective, c.ranks) / sec for s, sec in c.points)
            lines.append(
                f"  {c.collective:<14} {c.ranks} ranks  busbw {bw / 1e9:8.2f} GB/s  "
                f"smallest {c.points[0][1] * 1e6:8.1f} us at {_human(c.points[0][0])}"
            )
    for gpu in sorted({g.gpu for g in profile.gemm}):
        for dtype in sorted({g.dtype for g in profile.gemm if g.gpu == gpu}):
            effs = [g.efficiency for g in profile.gemm if g.gpu == gpu and g.dtype == dtype]
            lines.append(
                f"GEMM {gpu} {dtype}: median {statistics.median(effs):.1%} of peak over "
                f"{len(effs)} shape(s)"
            )
    return lines


def parse_size(text: str) -> int:
    """Bytes from "4KiB", "64MiB", "1GiB", "4096" (binary units; K/M/G read as KiB/MiB/GiB)."""
    t = text.strip().replace(" ", "")
    units = {"": 1, "b": 1, "k": KiB, "kb": KiB, "kib": KiB, "m": MiB, "mb": MiB, "mib": MiB}
    units |= {"g": 2**30, "gb": 2**30, "gib": 2**30}
    num = t.rstrip("bBkKmMgGiI")
    unit = t[len(num) :].lower()
    try:
        value = float(num)
    except ValueError:
        value = math.nan
    if unit not in units or not value > 0:
        raise CalibrateError(f"bad size {text!r}; write e.g. 4KiB, 64MiB or a number of bytes")
    return int(value * units[unit])


def parse_shapes(text: str) -> tuple[tuple[int, int, int], ...]:
    """ "1024x1024x1024,512x2048x512" -> ((m, n, k), ...)."""
    out = []
    for part in text.split(","):
        dims = part.lower().split("x")
        try:
            m, n, k = (int(d) for d in dims)
        except ValueError:
            raise CalibrateError(f"bad GEMM shape {part!r}; write MxNxK, e.g. 4096x4096x4096")
        if min(m, n, k) < 1:
            raise CalibrateError(f"bad GEMM shape {part!r}: sizes must be positive")
        out.append((m, n, k))
    return tuple(out)


def main(argv: list[str] | None = None) -> int:
    """Entry point under torchrun (`python -m meshplan.measure.calibrate`): every rank of
    the job measures; rank 0 writes `--out`."""
    import torch.distributed as dist
    from meshplan.ir.cluster_io import dump_profile

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--min-size", default="4KiB")
    ap.add_argument("--max-size", default="64MiB")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--gpu")
    ap.add_argument("--intra-link")
    ap.add_argument("--inter-link")
    ap.add_argument("--nics-per-node", type=int, default=1)
    ap.add_argument("--no-gemm", action="store_true")
    args = ap.parse_args(argv)
    try:
        cfg = CalibrateConfig(
            min_size=parse_size(args.min_size),
            max_size=parse_size(args.max_size),
            iters=args.iters,
            gpu=args.gpu,
            intra_link=args.intra_link,
            inter_link=args.inter_link,
            nics_per_node=args.nics_per_node,
            gemm=not args.no_gemm,
        )
        cfg.check()
        import torch

        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        profile = rank_main(cfg)
        if dist.get_rank() == 0:
            dump_profile(profile, args.out)
            print("\n".join(summary(profile)), file=sys.stderr)
        dist.destroy_process_group()
    except CalibrateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
