"""Held-out evaluation of the learned operator latency model against the analytic roofline.

Reads the profiled datasets (`data/op_latency/*.jsonl.gz`, written by `meshplan profile`),
trains `cost_model.learned` on the ops of some model families and reports the mean absolute
percentage error (MAPE) of per-op times on the ops of the *other* families:

- train: GPT-2 and Llama shapes plus the synthetic sweep (`--train gpt2,llama,sweep`);
- test: Mixtral and BERT-like shapes (`--test mixtral,bert`).

Two analytic baselines are priced with `cost_model.compute.op_time` (the planner's formula:
roofline with the default kernel efficiencies plus the kernel floor): `analytic` on a
`GpuSpec` holding the device's *measured* peaks (GEMM FLOP/s per dtype, copy bandwidth), and
`analytic_datasheet` on the `GpuSpec` table entry (for the CPU: its placeholder numbers).
`analytic_mape_heldout` is the first, the fairer one. A third, `analytic_calibrated`, fits
the roofline's constants (three compute efficiencies, one memory efficiency, a forward and
a backward per-call floor) on the training rows: what calibrating the analytic model on the
same profile would give, to show what the learned model adds beyond that. With datasets of
two or more devices, cross-device error is reported too (train on every row of one device,
predict another's).

    python benchmarks/op_latency.py                # table
    python benchmarks/op_latency.py --json         # JSON on stdout
    python benchmarks/op_latency.py --save-model   # also train on all rows, write model.npz
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from collections import defaultdict

import numpy as np
from meshplan.cost_model import compute
from meshplan.cost_model.dataset import (
    DeviceDescriptor,
    Sample,
    aggregate_runs,
    bound_devices,
    load_dataset,
)
from meshplan.cost_model.learned import DEFAULT_MODEL, mape, train
from meshplan.ir import GpuSpec
from meshplan.ir.hardware import canonical_gpu_name, gpu_spec


def measured_spec(desc: DeviceDescriptor) -> GpuSpec:
    """A GpuSpec carrying a profiled device's measured peaks (for the analytic baseline)."""
    return GpuSpec(
        name=desc.name,
        peak_flops=tuple(desc.peak_flops),
        memory_bytes=max(desc.memory_bytes, 1),
        hbm_bandwidth=desc.mem_bandwidth,
        sms=desc.cores,
        nvlink_bandwidth=0.0,
        source=f"measured by meshplan profile on {desc.processor}",
    )


def analytic_times(samples: list[Sample], *, datasheet: bool = False) -> np.ndarray:
    """compute.op_time of every sample's timed computation, on measured or datasheet peaks."""
    out = []
    for s in samples:
        spec = measured_spec(s.device)
        if datasheet and canonical_gpu_name(s.device.name):
            spec = gpu_spec(s.device.name)
        out.append(compute.op_time(s.measured_op, spec, s.dtype, backward=s.backward))
    return np.asarray(out)


def _calibration_inputs(samples: list[Sample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(compute seconds at peak, memory seconds at best bandwidth, group index) per sample.

    Groups: 0 GEMM-like (matmul, experts), 1 attention, 2 everything else.
    """
    from meshplan.cost_model.features import (
        DeviceFeatures,
        effective_flops,
        essential_bytes,
        op_dtype,
    )

    tc, tm, grp = [], [], []
    for s in samples:
        dev = DeviceFeatures.from_descriptor(s.device)
        op = s.measured_op
        tc.append(effective_flops(op, s.backward) / dev.peak(op_dtype(op, s.dtype)))
        tm.append(essential_bytes(op, s.backward) / dev.roof_bandwidth)
        kind = s.op.kind.value
        grp.append(0 if kind in ("matmul", "experts") else 1 if kind == "attention" else 2)
    return np.asarray(tc), np.asarray(tm), np.asarray(grp)


def calibrated_analytic(train_set: list[Sample], test_set: list[Sample]) -> np.ndarray:
    """A stronger analytic baseline: the roofline with constants fitted on the training rows.

    t = max(t_compute / e_compute[group], t_memory / e_memory) + floor[direction], with the
    learned model's physics inputs (measured peaks, best bandwidth, essential bytes) and
    five constants (compute efficiency of GEMMs / attention / the rest, one memory
    efficiency) plus a forward and a backward per-call floor, fitted on log time.
    """
    import torch

    tc, tm, grp = _calibration_inputs(train_set)
    bwd = np.asarray([s.backward for s in train_set], dtype=np.float64)
    y = np.log([s.seconds for s in train_set])
    th = {
        k: torch.tensor(v, dtype=torch.float64) for k, v in dict(tc=tc, tm=tm, bwd=bwd, y=y).items()
    }
    g = torch.tensor(grp)
    logit_e = torch.zeros(4, dtype=torch.float64, requires_grad=True)  # 3 compute + memory
    log_floor = torch.full((2,), math.log(5e-6), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.Adam([logit_e, log_floor], lr=0.05)

    def predict(tc_, tm_, g_, bwd_):
        e = torch.sigmoid(logit_e)
        t = torch.maximum(tc_ / e[g_], tm_ / e[3])
        return t + torch.exp(log_floor[0] + (log_floor[1] - log_floor[0]) * bwd_)

    for _ in range(600):
        opt.zero_grad()
        loss = ((torch.log(predict(th["tc"], th["tm"], g, th["bwd"])) - th["y"]) ** 2).mean()
        loss.backward()
        opt.step()
    tc2, tm2, grp2 = _calibration_inputs(test_set)
    bwd2 = torch.tensor([s.backward for s in test_set], dtype=torch.float64)
    with torch.no_grad():
        out = predict(torch.tensor(tc2), torch.tensor(tm2), torch.tensor(grp2), bwd2)
    return out.numpy()


def _group_mape(samples: list[Sample], pred: np.ndarray, meas: np.ndarray, key) -> dict[str, float]:
    groups: dict[str, list[int]] = defaultdict(list)
    for i, s in enumerate(samples):
        groups[key(s)].append(i)
    return {k: round(mape(pred[idx], meas[idx]), 2) for k, idx in sorted(groups.items())}


def evaluate(
    raw: list[Sample], train_fams: set[str], test_fams: set[str], epochs: int, aggregate: bool
) -> dict:
    """Train on `train_fams`, report MAPEs on `test_fams` (one device's samples).

    With `aggregate`, repeated runs of one op are folded into their fastest
    (`dataset.aggregate_runs`) for training and testing; the single-run error is reported too.
    """
    samples = aggregate_runs(raw) if aggregate else raw
    tr = [s for s in samples if s.family in train_fams]
    te = [s for s in samples if s.family in test_fams]
    te_raw = [s for s in raw if s.family in test_fams]
    if not tr or not te:
        raise SystemExit(f"need rows of both {sorted(train_fams)} and {sorted(test_fams)}")
    t0 = time.perf_counter()
    model = train(tr, epochs=epochs)
    train_s = time.perf_counter() - t0
    # Every predictor sees the device as the training rows bound it (`bound_devices`).
    tr = bound_devices(tr)
    te = [dataclasses.replace(s, device=tr[0].device) for s in te]
    meas = np.asarray([s.seconds for s in te])
    learned = model.predict_samples(te)
    # The planner's view: the same model fed the IR's FLOPs and bytes instead of the replay's.
    learned_ir = model.predict_samples([dataclasses.replace(s, timed=None) for s in te])
    analytic = analytic_times(te)
    datasheet = analytic_times(te, datasheet=True)
    calibrated = calibrated_analytic(tr, te)
    meas_tr = np.asarray([s.seconds for s in tr])
    return {
        "device": samples[0].device.name,
        "processor": samples[0].device.processor,
        "train_families": sorted(train_fams),
        "test_families": sorted(test_fams),
        "train_rows": len(tr),
        "test_rows": len(te),
        "train_seconds": round(train_s, 1),
        "analytic_mape_heldout": round(mape(analytic, meas), 2),
        "analytic_datasheet_mape_heldout": round(mape(datasheet, meas), 2),
        "analytic_calibrated_mape_heldout": round(mape(calibrated, meas), 2),
        "learned_mape_heldout": round(mape(learned, meas), 2),
        "learned_mape_train": round(mape(model.predict_samples(tr), meas_tr), 2),
        "learned_mape_heldout_ir_counts": round(mape(learned_ir, meas), 2),
        "learned_mape_heldout_single_runs": round(
            mape(model.predict_samples(te_raw), np.asarray([s.seconds for s in te_raw])), 2
        ),
        "runs_per_op_heldout": round(float(np.mean([s.runs for s in te])), 2),
        "repeat_disagreement_heldout": round(
            float(np.mean([s.spread for s in te if s.runs > 1] or [0.0]) * 100), 2
        ),
        "learned_median_ape_heldout": round(
            float(np.median(np.abs(learned - meas) / meas) * 100), 2
        ),
        "learned_p90_ape_heldout": round(
            float(np.percentile(np.abs(learned - meas) / meas, 90) * 100), 2
        ),
        "learned_never_below_roofline": bool(
            np.all(learned >= model.physics_samples(te) * (1 - 1e-9))
        ),
        "heldout_by_kind": {
            "analytic": _group_mape(te, analytic, meas, lambda s: s.op.kind.value),
            "learned": _group_mape(te, learned, meas, lambda s: s.op.kind.value),
        },
        "heldout_by_family": {
            "analytic": _group_mape(te, analytic, meas, lambda s: s.family),
            "learned": _group_mape(te, learned, meas, lambda s: s.family),
        },
        "heldout_by_direction": {
            "analytic": _group_mape(te, analytic, meas, lambda s: "bwd" if s.backward else "fwd"),
            "learned": _group_mape(te, learned, meas, lambda s: "bwd" if s.backward else "fwd"),
        },
    }


def validate(raw: list[Sample], train_fams: set[str], epochs: int) -> dict[str, float]:
    """Model selection without the test families: leave one training model family out.

    Trains on every training family but one (the sweep always stays in) and reports the
    learned MAPE on the one left out. Choices of features and model were made on these.
    """
    samples = aggregate_runs(raw)
    out = {}
    for fam in sorted(train_fams - {"sweep"}):
        tr = [s for s in samples if s.family in train_fams - {fam}]
        va = [s for s in samples if s.family == fam]
        model = train(tr, epochs=epochs)
        out[fam] = round(mape(model.predict_samples(va), np.asarray([s.seconds for s in va])), 2)
    out["mean"] = round(float(np.mean(list(out.values()))), 2)
    return out


def cross_device(by_device: dict[str, list[Sample]], epochs: int) -> dict[str, float]:
    """Learned MAPE when training on all rows of one device and predicting another's."""
    out = {}
    names = sorted(by_device)
    for a in names:
        model = train(by_device[a], epochs=epochs)
        for b in names:
            if a == b:
                continue
            te = by_device[b]
            meas = np.asarray([s.seconds for s in te])
            out[f"{a}->{b}"] = round(mape(model.predict_samples(te), meas), 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="*", help="dataset files (default: data/op_latency/*.jsonl.gz)")
    ap.add_argument("--train", default="gpt2,llama,sweep")
    ap.add_argument("--test", default="mixtral,bert")
    ap.add_argument("--epochs", type=int, default=1500)
    ap.add_argument("--json", action="store_true", help="print JSON only")
    ap.add_argument(
        "--validate",
        action="store_true",
        help="only the model-selection check: leave one training family out (no test rows)",
    )
    ap.add_argument(
        "--no-aggregate", action="store_true", help="use every run's row as its own sample"
    )
    ap.add_argument(
        "--save-model",
        action="store_true",
        help=f"train on every row of every device and write {DEFAULT_MODEL}",
    )
    args = ap.parse_args(argv)

    ds = load_dataset(args.data or None)
    by_device: dict[str, list[Sample]] = defaultdict(list)
    for s in ds.samples:
        by_device[s.device.name].append(s)
    train_fams, test_fams = set(args.train.split(",")), set(args.test.split(","))
    if args.validate:
        val = {name: validate(rows, train_fams, args.epochs) for name, rows in by_device.items()}
        print(json.dumps({"validation_mape": val}, indent=2))
        return 0
    results = {
        name: evaluate(rows, train_fams, test_fams, args.epochs, not args.no_aggregate)
        for name, rows in by_device.items()
    }
    primary = results.get("CPU") or next(iter(results.values()))
    report = {
        "analytic_mape_heldout": primary["analytic_mape_heldout"],
        "learned_mape_heldout": primary["learned_mape_heldout"],
        "rows": len(ds.samples),
        "devices": results,
    }
    if len(by_device) > 1:
        agg = {k: aggregate_runs(v) for k, v in by_device.items()}
        report["learned_mape_cross_device"] = cross_device(agg, args.epochs)
    if args.save_model:
        t0 = time.perf_counter()
        rows = aggregate_runs(ds.samples)
        model = train(rows, epochs=args.epochs)
        path = model.save()
        report["saved_model"] = {
            "path": str(path),
            "rows": len(rows),
            "train_seconds": round(time.perf_counter() - t0, 1),
        }
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for name, r in results.items():
        print(
            f"{name} ({r['processor']}): train {r['train_families']} ({r['train_rows']} rows, "
            f"{r['train_seconds']} s), test {r['test_families']} ({r['test_rows']} rows)"
        )
        print(
            f"  held-out MAPE  analytic (measured peaks) {r['analytic_mape_heldout']:.1f}%   "
            f"analytic (datasheet) {r['analytic_datasheet_mape_heldout']:.1f}%   "
            f"analytic (calibrated) {r['analytic_calibrated_mape_heldout']:.1f}%   "
            f"learned {r['learned_mape_heldout']:.1f}%  "
            f"(median {r['learned_median_ape_heldout']:.1f}%, "
            f"p90 {r['learned_p90_ape_heldout']:.1f}%)"
        )
        for kind in r["heldout_by_kind"]["learned"]:
            print(
                f"    {kind:14s} analytic {r['heldout_by_kind']['analytic'][kind]:7.1f}%  "
                f"learned {r['heldout_by_kind']['learned'][kind]:6.1f}%"
            )
    if "learned_mape_cross_device" in report:
        print("cross-device learned MAPE:", report["learned_mape_cross_device"])
    if "saved_model" in report:
        print("wrote", report["saved_model"]["path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
