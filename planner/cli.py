"""The `meshplan` command line.

    meshplan plan                         # default model on the default cluster
    meshplan plan --model llama3-70b --cluster dgx-h100 --gpus 256 --global-batch 512 -o plan.json
    meshplan estimate --model llama3-8b --cluster dgx-h100 --gpus 64 --tp 2 --pp 1 --zero 1
    meshplan validate plan.json
    meshplan verify plan.json --model llama3-8b    # the plan's layout on CPU ranks vs one process
    meshplan calibrate --nproc 4 -o profile.json   # measure links and GEMMs on this host
    meshplan estimate --profile profile.json ...   # price with the measurements
    meshplan models
    meshplan clusters

A user mistake (unknown model, bad cluster field, a configuration that does not divide, a
model that fits nowhere, an unknown option or a value not among a flag's choices, an output
path that is a directory or cannot be written) prints one line starting with `error:` on
stderr and exits with status 2; when the mistake is in the user's own code (a model factory
that raises) the line names its file:line, and `meshplan --debug ...` prints the whole
traceback first. Anything else is a bug and keeps its traceback. docs/errors.md lists the
messages.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import re
import site
import sys
import sysconfig
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, TypeVar

import typer
from meshplan.ir import Recompute, Schedule
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from typer.core import TyperGroup

try:  # typer >= 0.22 carries its own copy of click
    from typer._click.exceptions import NoSuchOption, UsageError
except ImportError:  # pragma: no cover - older typer on click
    from click.exceptions import NoSuchOption, UsageError

from .version import __version__

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

F = TypeVar("F", bound=Callable[..., object])
EXIT_USER_ERROR = 2


def _error_line(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


class _OneLineUsageErrors(TyperGroup):
    """Usage mistakes (an unknown option or command, a value not among a flag's choices, a
    missing argument) as one `error:` line and exit status 2, like every other user mistake,
    instead of click's usage box. An unknown option gets a did-you-mean over the command's
    own options."""

    def make_context(self, info_name, args, parent=None, **extra):
        with _usage_errors():
            return super().make_context(info_name, args, parent=parent, **extra)

    def invoke(self, ctx):
        with _usage_errors():
            return super().invoke(ctx)


@contextmanager
def _usage_errors():
    try:
        yield
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `meshplan` alone: the help, as asked
            raise
        message = e.format_message()
        if isinstance(e, NoSuchOption) and not e.possibilities and e.ctx is not None:
            names = [o for p in e.ctx.command.params for o in getattr(p, "opts", ())]
            close = difflib.get_close_matches(e.option_name, names, n=1, cutoff=0.4)
            message += f" Did you mean {close[0]}?" if close else ""
        if isinstance(e, NoSuchOption) and e.ctx is not None and e.ctx.command.name == "launch":
            message += (
                " (the program and its options go after `--`: meshplan launch plan.json -- "
                "python train.py; torchrun's options come from the plan)"
            )
        elif e.ctx is not None:
            message += f" (see `{e.ctx.command_path} --help`)"
        _error_line(message)
        raise typer.Exit(EXIT_USER_ERROR) from None


app = typer.Typer(
    name="meshplan",
    cls=_OneLineUsageErrors,
    help="Auto-parallelization planner for training on heterogeneous GPU clusters.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

# Set by the global options (`_global_options`) on every invocation.
_debug = False


def _print_version(value: bool) -> None:
    if value:
        out.print(f"meshplan {__version__}")
        raise typer.Exit()


@app.callback()
def _global_options(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print meshplan's version and exit.",
            is_eager=True,
            callback=_print_version,
        ),
    ] = False,
    debug: Annotated[
        bool,
        typer.Option(
            "--debug",
            help="On an error, print the full traceback (also of errors in your model code) "
            "before the one-line summary.",
        ),
    ] = False,
) -> None:
    """Auto-parallelization planner for training on heterogeneous GPU clusters."""
    global _debug
    _debug = debug


def user_errors(fn: F) -> F:
    """Turn user mistakes (ValueError and friends, a file that cannot be read or written)
    into one line and exit status 2. The line names the file:line of the user's own code
    where the error arose, if it did (`_user_frame`); `--debug` prints the traceback first."""

    @functools.wraps(fn)
    def wrapper(*args: object, **kwargs: object) -> object:
        try:
            return fn(*args, **kwargs)
        except (ValueError, OSError, KeyError) as e:
            if _debug:  # the whole chain, the user's error behind a one-line summary too
                e.__suppress_context__ = False
                sys.stderr.write("".join(traceback.format_exception(e)))
            _error_line(_one_line(e))
            raise typer.Exit(EXIT_USER_ERROR) from None

    return wrapper  # type: ignore[return-value]


def _one_line(e: BaseException) -> str:
    """The error's first line, what an OSError was about, and where in the user's code."""
    if isinstance(e, OSError) and e.strerror:
        message = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if isinstance(e, KeyError):
        message = f"unknown name {message}"
    where = _user_frame(e)
    if where and where not in message:
        debug = "" if _debug else "; `meshplan --debug ...` prints the traceback"
        message += f" (at {where}{debug})"
    return message


def _user_frame(e: BaseException) -> str | None:
    """'file:line in function' of the innermost frame of the user's own code (not meshplan,
    the standard library or an installed package) in the traceback of `e` or of the errors
    behind it (`raise ... from`, or raised while handling one), or None."""
    chain, seen = [], set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        chain.append(x)
        x = x.__cause__ or x.__context__
    for exc in reversed(chain):  # the original error first
        if isinstance(exc, SyntaxError) and exc.filename and _is_user_file(exc.filename):
            return f"{exc.filename}:{exc.lineno}"
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
        if frames:
            return f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}"
    return None


@functools.cache
def _library_dirs() -> tuple[str, ...]:
    """Folders whose code is not the user's: meshplan's packages, the standard library and
    the installed packages."""
    import meshplan
    import meshplan.cost_model
    import meshplan.ir
    import meshplan.measure
    import meshplan.passes
    import meshplan.runtime

    mods = (
        meshplan,
        meshplan.ir,
        meshplan.cost_model,
        meshplan.passes,
        meshplan.runtime,
        meshplan.measure,
    )
    dirs = {str(Path(m.__file__).resolve().parent) for m in mods}
    paths = sysconfig.get_paths()
    dirs |= {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    dirs |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(os.path.realpath(d) + os.sep for d in dirs)


def _is_user_file(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return False
    return not os.path.realpath(filename).startswith(_library_dirs())


def _check_output(path: Path | None) -> None:
    """Refuse an output path that cannot be a file before any work is done."""
    if path is not None and Path(path).is_dir():
        raise ValueError(f"--output {path}: is a directory; give a file name")


@contextmanager
def status(message: str):
    """A spinner with a live message while tracing or solving (silent when not a terminal)."""
    if not err.is_terminal:
        yield lambda text: None
        return
    with err.status(message) as s:
        yield lambda text: s.update(f"{message}: {text}")


# -- shared option types -----------------------------------------------------------------------
ModelOpt = Annotated[
    str | None,
    typer.Option(
        "--model", "-m", help="Preset name (see `meshplan models`) or path/to/file.py:factory."
    ),
]
ClusterOpt = Annotated[
    str | None,
    typer.Option(
        "--cluster", "-c", help="Preset or GPU type (see `meshplan clusters`), or a YAML/JSON file."
    ),
]
GpusOpt = Annotated[int | None, typer.Option("--gpus", help="Total GPUs for a preset cluster.")]
SeqOpt = Annotated[int | None, typer.Option("--seq-len", help="Sequence length (tokens).")]
BatchOpt = Annotated[
    int | None, typer.Option("--global-batch", help="Sequences per optimizer step.")
]
IntOpt = Annotated[int | None, typer.Option()]
RecomputeOpt = Annotated[
    str | None, typer.Option(help=f"Recomputation: {', '.join(r.value for r in Recompute)}.")
]
ZeroOpt = Annotated[int | None, typer.Option(help="ZeRO stage 0-3.")]
ProfileOpt = Annotated[
    Path | None,
    typer.Option(
        "--profile", help="Cluster profile from `meshplan calibrate` (measured links and GEMMs)."
    ),
]


def _load(
    model: str | None,
    cluster: str | None,
    gpus: int | None,
    seq_len: int | None,
    micro_batch: int = 1,
    profile: Path | None = None,
):
    from meshplan.models import DEFAULT_MODEL

    from .api import load_model

    name = model or DEFAULT_MODEL
    c = _load_cluster(cluster, gpus, profile)
    m, inputs = load_model(name, seq_len=seq_len, micro_batch=micro_batch)
    return name, m, inputs, c


def _load_cluster(cluster: str | None, gpus: int | None, profile: Path | None = None):
    """The cluster named by --cluster/--gpus (a preset or a file), with --profile applied."""
    from meshplan.ir import Cluster

    c = Cluster.named(cluster or "default", gpus)
    if profile is not None:  # measured by `meshplan calibrate`
        from meshplan.ir.cluster_io import load_profile

        c = c.with_profile(load_profile(profile))
    return c


def _load_framework(spec: str, model: str | None, cluster, gpus, profile):
    """`--from` / `--baseline FRAMEWORK:FILE`: the cluster, the configuration read from the
    file (`meshplan.configs.load`) and its model traced."""
    from . import configs

    c = _load_cluster(cluster, gpus, profile)
    cfg = configs.load(spec, world_size=c.world_size, model=model)
    name = cfg.model.name if cfg.model else "?"
    with status(f"tracing {name}") as update:
        graph = configs.trace_model(cfg, progress=update)
    return cfg, c, graph


def _print_framework(cfg) -> None:
    """What was read from a framework file, and what of it meshplan does not price."""
    out.print(
        f"read {cfg.framework} config {cfg.source}: {cfg.parallel}"
        + (f", stage layers {list(cfg.stage_layers)}" if cfg.stage_layers else "")
        + f", engine {cfg.engine.describe()}",
        markup=False,
        soft_wrap=True,
    )
    if line := cfg.not_priced_line():
        out.print(line, markup=False, soft_wrap=True)


def _trace(name: str, model, inputs):
    from .api import trace

    with status(f"tracing {name}") as update:
        graph = trace(model, *inputs, name=name, progress=update)
    if _AS_SCRIPT:  # the script's process (`main`): the model and its graph live to the end
        import gc

        gc.freeze()
    return graph


def _pins(
    dp,
    tp,
    pp,
    cp,
    ep,
    micro_batch,
    global_batch,
    recompute,
    zero,
    schedule=None,
    virtual=None,
    cp_mode=None,
    cp_shares=None,
    cp_head_shares=None,
    cp_head_degree=None,
):
    """The pinned choices as a `Parallel`, which checks them (call it before tracing); its
    one-line error names the flag (`--micro-batch`, not `Parallel.micro_batch`)."""
    from meshplan.ir import Parallel

    shares = {}
    for flag, text, field in (
        ("--cp-shares", cp_shares, "cp_shares"),
        ("--cp-head-shares", cp_head_shares, "cp_head_shares"),
    ):
        if text is None:
            continue
        try:
            shares[field] = tuple(int(x) for x in text.split(","))
        except ValueError:
            raise ValueError(
                f"{flag} {text!r}: give one integer per cp rank, comma-separated (6144,2048)"
            ) from None
    try:
        return Parallel(
            dp=dp,
            tp=tp,
            pp=pp,
            cp=cp,
            ep=ep,
            micro_batch=micro_batch,
            global_batch=global_batch,
            recompute=recompute,
            zero=zero,
            schedule=schedule,
            virtual_stages=virtual,
            cp_mode=cp_mode,
            cp_head_degree=cp_head_degree,
            **shares,
        )
    except ValueError as e:
        flag = re.sub(r"Parallel\.(\w+)", lambda m: "--" + m[1].replace("_", "-"), str(e))
        raise ValueError(flag) from None


ScheduleOpt = Annotated[
    str | None,
    typer.Option(help=f"Pipeline schedule: {', '.join(s.value for s in Schedule)}."),
]
CpSharesOpt = Annotated[
    str | None,
    typer.Option(
        "--cp-shares",
        help="Asymmetric context parallelism (HexiSeq): tokens of each sequence per cp rank, "
        "comma-separated (even, summing to the sequence length), or auto: the shares that "
        "equalise the ranks of a cp group spanning GPU types; default equal shares.",
    ),
]
CpHeadSharesOpt = Annotated[
    str | None,
    typer.Option(
        "--cp-head-shares",
        help="With --cp-mode heads: query heads (of a tp rank's) per cp rank, comma-separated; "
        "default equal.",
    ),
]
CpModeOpt = Annotated[
    str | None,
    typer.Option(
        "--cp-mode",
        help="How context-parallel attention exchanges the sequence: allgather (K/V "
        "all-gathered), ring, heads (DeepSpeed-Ulysses all-to-all), or usp (heads over "
        "--cp-head-degree ranks, K/V all-gathered over the rest, where cp does not divide the "
        "heads); default: the planner chooses allgather, heads or usp.",
    ),
]
CpHeadDegreeOpt = Annotated[
    int | None,
    typer.Option(
        "--cp-head-degree",
        help="With --cp-mode usp (which it implies): the cp ranks that split the heads "
        "(dividing cp and the heads); default the largest that does.",
    ),
]
VirtualOpt = Annotated[
    int | None,
    typer.Option("--virtual-stages", help="Model chunks per pipeline rank (interleaved 1F1B)."),
]
PrecisionOpt = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="Training precision: fp32, tf32, bf16, fp16 (mixed) or fp8 (float8 linears); "
        "default the model's dtype (fp16 on GPUs without bf16).",
    ),
]

HostOpt = Annotated[
    float | None,
    typer.Option(
        "--host-us",
        help="The host's microseconds per traced op of an eager forward + backward (default "
        "$MESHPLAN_HOST_US or 50, measured on a GPU machine's host; 0: the host never holds "
        "the GPU up).",
    ),
]


def _host_us(value: float | None) -> float | None:
    """--host-us checked (and MESHPLAN_HOST_US, which stands in for it), before tracing."""
    from meshplan.cost_model.host import MAX_HOST_US, default_node_s

    if value is not None and not 0.0 <= value < MAX_HOST_US:
        raise ValueError(
            f"--host-us is microseconds per traced op, from 0 to under {MAX_HOST_US:g}; "
            f"got {value:g}"
        )
    default_node_s()  # a bad MESHPLAN_HOST_US: one line now, not after the trace
    return value


def _hybrid_option(value: str, fraction: float) -> str | dict[str, str]:
    """--hybrid-precision as `plan` takes it: off, auto or {group: mode}; one-line errors."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--max-quantized-fraction must be in [0, 1], got {fraction:g}")
    if value in ("off", "auto"):
        return value
    pins: dict[str, str] = {}
    for item in value.split(","):
        group, sep, mode = item.strip().partition("=")
        if not sep or not group or mode not in ("int8", "fp8"):
            raise ValueError(
                f"--hybrid-precision: {item.strip()!r} is not GROUP=int8 or GROUP=fp8 "
                "(or give off / auto)"
            )
        pins[group] = mode
    return pins


def _check_precision(precision: str | None) -> None:
    """An unknown --precision is refused before the trace (what each GPU supports is checked
    once the cluster is known: `ir.cluster.precision_problem`)."""
    from meshplan.ir.devices import precision_problem

    if precision is not None and (why := precision_problem(precision, [])):
        raise ValueError(f"--{why}")


def _print_plan(plan, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(plan.to_json())
        return
    p, pr = plan.parallel, plan.predicted
    gib = 1024**3
    out.print(
        f"[bold]{plan.model.name}[/] ({plan.model.num_params / 1e9:.2f}B params) on "
        f"[bold]{plan.cluster.name}[/] ({plan.world_size} of {plan.cluster.world_size} GPUs)"
    )
    t = Table(title="parallel configuration", show_header=True)
    for col in (
        "dp",
        "tp",
        "pp",
        "cp",
        "ep",
        "micro-batch",
        "micro-batches",
        "global batch",
        "recompute",
        "ZeRO",
        "schedule",
        "SP",
        "precision",
    ):
        t.add_column(col, justify="right")
    group_tp = plan.stages[0].group_tp
    tp = " / ".join(f"{g} {n}" for g, n in group_tp) if group_tp else p.tp
    t.add_row(
        *map(
            str,
            (
                p.dp,
                tp,
                p.pp,
                p.cp,
                p.ep,
                p.micro_batch,
                p.num_microbatches,
                p.global_batch,
                p.recompute,
                p.zero,
                p.schedule,
                "on" if p.sequence_parallel else "off",
                plan.precision or "-",
            ),
        )
    )
    out.print(t)
    if p.cp > 1:
        how = {"allgather": "K/V all-gathered", "ring": "ring", "heads": "head-parallel, Ulysses"}
        if p.cp_head_degree:
            how["usp"] = (
                f"heads over {p.cp_head_degree} ranks, K/V all-gathered over "
                f"{p.cp // p.cp_head_degree}; USP"
            )
        mode = p.cp_mode or "allgather"
        out.print(f"context-parallel attention: {mode} ({how[mode]})")
        if p.cp_shares:
            out.print(f"  tokens per cp rank (asymmetric, HexiSeq): {list(p.cp_shares)}")
        if p.cp_head_shares:
            out.print(f"  query heads per cp rank: {list(p.cp_head_shares)}")
    if plan.hybrid_precision:
        what = {"int8": "int8 forward GEMMs", "fp8": "fp8 forward GEMMs"}
        which = (
            ", ".join(plan.hybrid_linears) if plan.hybrid_linears else "transformer-block linears"
        )
        out.print(
            f"per-group precision ({which}): "
            + ", ".join(f"{g} {what[m]}" for g, m in plan.hybrid_precision)
        )
    s = Table(title="pipeline stages and memory per rank")
    cols = ["stage", "units", "replicas", "group"]
    shares = bool(plan.stages[0].microbatches)
    cols += ["tp"] if group_tp else []
    cols += ["micro-batches"] if shares else []
    for col in (*cols, "peak GiB", "capacity GiB", "fits"):
        s.add_column(col, justify="right")
    mem = {(m.stage, m.group): m for m in pr.memory}
    for st in plan.stages:
        units = f"{plan.model.units[st.first_unit]} .. {plan.model.units[st.last_unit - 1]}"
        # a cp group spanning groups: its cp ranks in each group ("8 cp ranks" per replica)
        rows = (
            [(g, f"{st.dp} x {c} cp ranks") for g, c in st.cp_groups]
            if st.cp_groups
            else st.replicas
        )
        for g, n in rows:
            m = mem.get((st.index, g))
            extra = [str(st.tp_of(g, p.tp))] if group_tp else []
            extra += [str(st.shares[g])] if shares else []
            s.add_row(
                str(st.index),
                units,
                str(n),
                g,
                *extra,
                f"{m.peak_bytes / gib:.1f}" if m else "?",
                f"{m.capacity_bytes / gib:.1f}" if m else "?",
                ("yes" if m.fits else "[red]NO[/]") if m else "?",
            )
    out.print(s)
    b = Table(title="predicted step time")
    b.add_column("part")
    b.add_column("seconds", justify="right")
    b.add_column("share", justify="right")
    for k, v in pr.breakdown:
        b.add_row(k, f"{v:.4f}", f"{100 * v / (pr.step_time_s or 1):.1f}%")
    b.add_row("[bold]step[/]", f"[bold]{pr.step_time_s:.4f}[/]", "100%")
    out.print(b)
    out.print(
        f"tokens/s {pr.tokens_per_s:,.0f}   MFU {pr.mfu * 100:.1f}%   peak memory "
        f"{pr.peak_memory_bytes / gib:.1f} GiB   fits: {'yes' if pr.fits else 'NO'}"
    )
    for note in pr.notes:
        out.print(f"note: {note}")
    # the compression / quantization decisions, in the words of `Plan.explain()`
    for line in plan.explain().splitlines():
        if line.startswith(("  compression", "  quantization")):
            out.print(escape(line.strip()))
    out.print(
        f"solver: {plan.solver.status}, gap {plan.solver.gap * 100:.2f}%, "
        f"{plan.solver.candidates} configurations priced"
    )


@app.command()
@user_errors
def plan(
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    gpus: GpusOpt = None,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write plan JSON here.")
    ] = None,
    dp: IntOpt = None,
    tp: IntOpt = None,
    pp: IntOpt = None,
    cp: IntOpt = None,
    ep: IntOpt = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch")] = None,
    recompute: RecomputeOpt = None,
    zero: ZeroOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualOpt = None,
    cp_mode: CpModeOpt = None,
    cp_head_degree: CpHeadDegreeOpt = None,
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            help="Solver budget, in seconds of work on a 2-core machine (counted, not timed: "
            "the plan does not depend on load).",
        ),
    ] = 10.0,
    objective: Annotated[
        str,
        typer.Option(
            help="throughput (fastest), cost (least $ per token, needs prices) or min_gpus "
            "(fewest GPUs reaching --target-tokens-per-s)."
        ),
    ] = "throughput",
    target_tokens_per_s: Annotated[
        float | None,
        typer.Option("--target-tokens-per-s", help="Throughput to reach (objective min_gpus)."),
    ] = None,
    price: Annotated[
        list[str] | None,
        typer.Option(
            "--price",
            help="GPU=$ per GPU-hour, e.g. H100=2.5 (repeatable; overrides the cluster's).",
        ),
    ] = None,
    profile: ProfileOpt = None,
    compress: Annotated[
        str,
        typer.Option(
            help="auto: code collectives losslessly (bit-exact) where it is faster; off: never."
        ),
    ] = "auto",
    quantize: Annotated[
        str,
        typer.Option(
            help="off (default), activations (AGoQ 4/8-bit saved activations), gradients "
            "(int8 DP reductions) or auto (both); quantization changes numerics."
        ),
    ] = "off",
    per_group_tp: Annotated[
        bool,
        typer.Option(
            help="On mixed clusters, also try pipelines that run each device group at its own "
            "TP degree, group-pure or changing group and degree between stages (ZeRO-0)."
        ),
    ] = True,
    equal_shares: Annotated[
        bool,
        typer.Option(
            "--equal-shares",
            help="Every replica runs the same number of micro-batches (no uneven DP shares "
            "across GPU types), as Sailor and other planners assume.",
        ),
    ] = False,
    precision: PrecisionOpt = None,
    hybrid_precision: Annotated[
        str,
        typer.Option(
            "--hybrid-precision",
            help="Per-group precision (changes numerics): off (default); auto: also try the "
            "slower groups' transformer linears in fp8 or int8 and keep what is faster within "
            "--max-quantized-fraction; or GROUP=MODE[,GROUP=MODE] with MODE int8 or fp8.",
        ),
    ] = "off",
    max_quantized_fraction: Annotated[
        float,
        typer.Option(
            "--max-quantized-fraction",
            help="With --hybrid-precision: the largest share of a step's FLOPs run in int8/fp8.",
        ),
    ] = 0.25,
    sensitivity: Annotated[
        Path | None,
        typer.Option(
            "--sensitivity",
            help="With --hybrid-precision: a per-linear sensitivity file "
            "(meshplan.measure.sensitivity.save_sensitivity, measured on your model and data); "
            "lower only the linears with the most FLOPs within --max-loss-increase.",
        ),
    ] = None,
    max_loss_increase: Annotated[
        float,
        typer.Option(
            "--max-loss-increase",
            help="With --sensitivity: the largest summed relative loss increase of the lowered "
            "linears.",
        ),
    ] = 0.01,
    host_us: HostOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print plan JSON.")] = False,
    baseline: Annotated[
        str | None,
        typer.Option(
            "--baseline",
            help="Compare with your configuration: torchtitan:job.toml (or a saved 0.3 command "
            "line), megatron:args.txt or deepspeed:ds_config.json.",
        ),
    ] = None,
    export_fmt: Annotated[
        str | None,
        typer.Option(
            "--export",
            help="Write the plan as torchtitan, torchtitan-cli, megatron or deepspeed "
            "configuration to -o FILE (instead of plan JSON).",
        ),
    ] = None,
    closest: Annotated[
        bool,
        typer.Option(
            "--closest",
            help="With --export: write the nearest plan the framework can express (re-priced) "
            "instead of refusing.",
        ),
    ] = False,
) -> None:
    """Find the best plan that fits (default: the default model on the default cluster).

    --dp/--tp/--pp/... pin those choices; the solver fills the rest. --objective picks what
    "best" means: throughput (default), cost per token, or the fewest GPUs for a target.
    """
    from .api import comm_options
    from .api import plan as make_plan
    from .solver import Objective
    from .whatif import parse_price

    # Everything the user typed is checked before the (long) trace, by the rules the
    # planner applies later (`Parallel`, `Objective`, `comm_options`).
    _check_output(output)
    _check_precision(precision)
    Objective(objective, target_tokens_per_s)
    comm_options(compress, quantize)
    hybrid = _hybrid_option(hybrid_precision, max_quantized_fraction)
    sens = None
    if sensitivity is not None:
        if hybrid == "off":
            raise ValueError("--sensitivity needs --hybrid-precision auto or GROUP=MODE")
        from meshplan.measure.sensitivity import load_sensitivity

        sens = load_sensitivity(sensitivity)
    pins = _pins(
        dp, tp, pp, cp, ep, micro_batch, global_batch, recompute, zero, schedule, virtual_stages,
        cp_mode, cp_head_degree=cp_head_degree,
    )  # fmt: skip
    prices = dict(parse_price(x) for x in price or [])
    if export_fmt is not None:
        from .configs import EXPORT_FORMATS

        if export_fmt not in EXPORT_FORMATS:
            raise ValueError(
                f"--export must be one of {', '.join(EXPORT_FORMATS)}, got {export_fmt!r}"
            )
        if output is None:
            raise ValueError(f"--export {export_fmt} writes a file: give -o FILE")
    elif closest:
        raise ValueError("--closest goes with --export")
    cfg = None
    host_us = _host_us(host_us)  # checked before tracing
    if baseline is not None:  # the user's own configuration: its model, batch and engine
        cfg, c, graph = _load_framework(baseline, model, cluster, gpus, profile)
        if pins.global_batch is None:
            pins = dataclasses.replace(pins, global_batch=cfg.parallel.global_batch)
        if host_us is not None:  # the comparison prices both on the host given
            host_engine = dataclasses.replace(cfg.engine, host_node_s=host_us * 1e-6)
            cfg = dataclasses.replace(cfg, engine=host_engine)
    else:
        name, m, inputs, c = _load(model, cluster, gpus, seq_len, profile=profile)
        graph = _trace(name, m, inputs)
    with status("solving") as update:
        result = make_plan(
            graph,
            cluster=c,
            parallel=pins,
            time_limit_s=time_limit,
            progress=update,
            objective=objective,
            target_tokens_per_s=target_tokens_per_s,
            prices=prices or None,
            compress=compress,
            quantize=quantize,
            per_group_tp=per_group_tp,
            precision=precision,
            equal_shares=equal_shares,
            hybrid_precision=hybrid,
            max_quantized_fraction=max_quantized_fraction,
            sensitivity=sens,
            max_loss_increase=max_loss_increase,
            host_us=host_us,
        )
    _print_plan(result, as_json)
    if objective == "cost" and not as_json:
        goal = Objective(objective, target_tokens_per_s, tuple(sorted(prices.items())))
        out.print(_cost_line(result, goal.price_per_gpu_s(c)), markup=False)
    if cfg is not None:
        _print_comparison(cfg, c, graph, result)
    if export_fmt is not None:
        from meshplan.cost_model.engine import Engine

        from .configs import EAGER, export, reprice

        engine = cfg.engine if cfg is not None else EAGER
        if cfg is None and host_us is not None:  # as the plan was priced
            engine = Engine(host_node_s=host_us * 1e-6)
        target = reprice(result, graph, engine)  # the header's prediction as the table's
        written = export(target, export_fmt, closest=closest, graph=graph, engine=engine)
        written.write(output)  # type: ignore[arg-type]
        if written.changes:
            pr = written.plan.predicted
            (err if as_json else out).print(
                f"closest {export_fmt} plan ({'; '.join(written.changes)} changed): "
                f"{written.plan.parallel}, step {pr.step_time_s:.3f} s, "
                f"{pr.tokens_per_s:,.0f} tokens/s, MFU {pr.mfu * 100:.1f}%",
                markup=False,
                soft_wrap=True,
            )
        (err if as_json else out).print(f"wrote {output} ({export_fmt})")
    elif output:
        result.to_json(output)
        (err if as_json else out).print(f"wrote {output}")


def _cost_line(plan, per_gpu_s: dict[str, float]) -> str:
    """The plan's price: $ per hour of the GPUs it uses and $ per million tokens."""
    used: dict[str, int] = {}
    for r in plan.ranks:
        if r.coords is not None:
            used[r.group] = used.get(r.group, 0) + 1
    per_hour = sum(n * per_gpu_s[g] * 3600 for g, n in used.items())
    rate = plan.predicted.tokens_per_s
    per_mtok = per_hour / (rate * 3600) * 1e6 if rate > 0 else float("inf")
    gpus = ", ".join(f"{n} {g}" for g, n in sorted(used.items()))
    return f"cost: ${per_hour:,.2f} per hour ({gpus}), ${per_mtok:,.4f} per million tokens"


def _print_comparison(cfg, cluster, graph, ours) -> None:
    """`plan --baseline`: the user's configuration and the plan side by side."""
    from .configs import compare, reprice
    from .configs import estimate as estimate_config

    base = estimate_config(cfg, cluster, graph)
    cmp = compare(base, reprice(ours, graph, cfg.engine), cfg.engine)
    _print_framework(cfg)
    t = Table(title=f"{cfg.framework} baseline vs meshplan (as {cfg.engine.describe()} runs them)")
    for col, justify in (("", "left"), ("baseline", "right"), ("meshplan", "right")):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    t.add_column("meshplan / baseline", justify="right")
    for row in cmp.rows:
        t.add_row(*row)
    out.print(t)
    for line in cmp.reasons:
        out.print(line, markup=False, soft_wrap=True)


@app.command()
@user_errors
def estimate(
    model: ModelOpt = None,
    cluster: ClusterOpt = None,
    gpus: GpusOpt = None,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    dp: IntOpt = None,
    tp: IntOpt = None,
    pp: IntOpt = None,
    cp: IntOpt = None,
    ep: IntOpt = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch")] = None,
    recompute: RecomputeOpt = None,
    zero: ZeroOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualOpt = None,
    cp_mode: CpModeOpt = None,
    cp_shares: CpSharesOpt = None,
    cp_head_shares: CpHeadSharesOpt = None,
    cp_head_degree: CpHeadDegreeOpt = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write plan JSON here.")
    ] = None,
    profile: ProfileOpt = None,
    compiled: Annotated[
        bool,
        typer.Option(
            "--compile",
            help="Price fused kernels, as torch.compile or Megatron-LM's fused kernels run them.",
        ),
    ] = False,
    float8: Annotated[
        str | None,
        typer.Option("--float8", help="Float8 linear layers: tensorwise (torchao's recipe)."),
    ] = None,
    float8_all_gather: Annotated[
        bool, typer.Option("--float8-all-gather", help="FSDP all-gathers FP8 weights.")
    ] = False,
    tp_overlap: Annotated[
        bool,
        typer.Option(
            "--tp-overlap", help="TP traffic overlapped with GEMMs (async TP, --tp-comm-overlap)."
        ),
    ] = False,
    precision: PrecisionOpt = None,
    host_us: HostOpt = None,
    hybrid_precision: Annotated[
        str,
        typer.Option(
            "--hybrid-precision",
            help="Per-group precision to price: GROUP=MODE[,GROUP=MODE] with MODE int8 or fp8 "
            "(that group's transformer linears run their forward GEMMs so), or off.",
        ),
    ] = "off",
    hybrid_linears: Annotated[
        str | None,
        typer.Option(
            "--hybrid-linears",
            help="With --hybrid-precision: only these linears of each layer, by their path "
            "inside it, comma-separated (attn.q_proj,mlp.up_proj); default every one.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print plan JSON.")] = False,
    from_config: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Read the configuration from torchtitan:job.toml (or a saved 0.3 command "
            "line), megatron:args.txt or deepspeed:ds_config.json.",
        ),
    ] = None,
    layout: Annotated[
        Path | None,
        typer.Option(
            "--layout",
            help="Price this stage list (YAML/JSON: stages of layers, replicas and tp per "
            "device group), e.g. another planner's plan; it sets dp, tp, pp and ZeRO-0.",
        ),
    ] = None,
) -> None:
    """Predict step time, throughput, MFU and memory of a configuration you choose.

    --layout prices a stage list instead (each stage its layers, replicas per device group
    and each group's TP degree: Sailor's, Metis's or a hand-written plan; `meshplan.layout`).

    --compile/--float8/--tp-overlap price the step as another training stack would run it
    (meshplan's own runtime is eager bf16 without TP overlap, the default).
    """
    from meshplan.cost_model.engine import Engine

    from .api import estimate_plan

    hybrid = _hybrid_option(hybrid_precision, 1.0)
    if hybrid == "auto":
        raise ValueError("--hybrid-precision auto is for `meshplan plan`; give GROUP=MODE here")
    linears = tuple(x.strip() for x in (hybrid_linears or "").split(",") if x.strip())
    if linears and not isinstance(hybrid, dict):
        raise ValueError("--hybrid-linears needs --hybrid-precision GROUP=MODE")
    engine = Engine(  # checked before tracing
        compiled,
        float8,
        float8_all_gather,
        tp_overlap,
        hybrid=tuple(sorted(hybrid.items())) if isinstance(hybrid, dict) else (),
        hybrid_linears=linears,
        host_node_s=None if (us := _host_us(host_us)) is None else us * 1e-6,
    )
    _check_output(output)
    _check_precision(precision)
    balance_cp = cp_shares == "auto"
    pins = _pins(
        dp, tp, pp, cp, ep, micro_batch, global_batch, recompute, zero, schedule, virtual_stages,
        cp_mode, None if balance_cp else cp_shares, cp_head_shares, cp_head_degree,
    )  # fmt: skip
    if from_config is not None and layout is not None:
        raise ValueError("--from and --layout both set the configuration; give one of them")
    if from_config is not None:
        given = [f"--{k.replace('_', '-')}" for k in pins.pinned()]
        given += ["--seq-len"] if seq_len is not None else []
        given += ["--cp-shares"] if balance_cp else []
        given += ["--host-us"] if host_us is not None else []
        given += [] if engine.is_eager else ["--compile/--float8/--tp-overlap/--hybrid-precision"]
        if given:
            raise ValueError(
                f"--from {from_config} sets the configuration; leave out {', '.join(given)} "
                "(edit the file instead)"
            )
        from .configs import estimate as estimate_config

        cfg, c, graph = _load_framework(from_config, model, cluster, gpus, profile)
        result = estimate_config(cfg, c, graph)
        _print_plan(result, as_json)
        if not as_json:
            _print_framework(cfg)
    else:
        from .layout import read_layout

        stages = read_layout(layout) if layout is not None else None  # before tracing
        name, m, inputs, c = _load(model, cluster, gpus, seq_len, profile=profile)
        graph = _trace(name, m, inputs)
        result = estimate_plan(
            graph,
            cluster=c,
            parallel=pins,
            engine=engine,
            precision=precision,
            layout=stages,
            balance_cp=balance_cp,
        )
        _print_plan(result, as_json)
    if not result.predicted.fits:
        worst = max(result.predicted.memory, key=lambda r: r.peak_bytes - r.capacity_bytes)
        err.print(
            f"[yellow]warning:[/] does not fit: stage {worst.stage} on {worst.group} needs "
            f"{worst.peak_bytes / 2**30:.1f} GiB, capacity {worst.capacity_bytes / 2**30:.1f} GiB"
        )
    if output:
        result.to_json(output)


@app.command()
@user_errors
def validate(
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON to check.")],
    cluster: ClusterOpt = None,
    gpus: GpusOpt = None,
) -> None:
    """Check a plan file: version, schema, that it means what it says (every derived fact
    recomputed, no field changed since it was made), that this runtime can run it, and (with
    --cluster) that it matches the cluster. `meshplan launch` refuses what this refuses."""
    from meshplan.ir import Cluster
    from meshplan.ir.plan import Plan
    from meshplan.runtime.apply import check_plan

    c = None
    if cluster:
        c = (
            Cluster.load(cluster)
            if Path(cluster).suffix.lower() in (".yaml", ".yml", ".json")
            else Cluster.preset(cluster, gpus=gpus)
        )
    p = Plan.from_json(plan_file, cluster=c)
    try:
        check_plan(p)  # what `meshplan launch` and `runtime.apply` refuse
    except ValueError as e:
        raise ValueError(f"{plan_file}: {e}") from None
    out.print(
        f"{plan_file}: valid {p.version} plan for {p.model.name} on {p.cluster.name} "
        f"({p.world_size} GPUs, dp={p.parallel.dp} tp={p.parallel.tp} pp={p.parallel.pp})"
    )


@app.command()
def models() -> None:
    """List the built-in model presets."""
    from meshplan.models import PRESETS

    t = Table(title="model presets (meshplan plan --model NAME)")
    for col in ("name", "params", "layers", "hidden", "heads/kv", "seq", "description"):
        t.add_column(col)
    for name, (cfg, desc) in PRESETS.items():
        t.add_row(
            name,
            f"{cfg.num_params() / 1e9:.2f}B",
            str(cfg.layers),
            str(cfg.hidden),
            f"{cfg.heads}/{cfg.num_kv_heads}",
            str(cfg.seq_len),
            desc,
        )
    out.print(t)


@app.command()
def clusters() -> None:
    """List the cluster presets and the GPU types they can be built from."""
    from meshplan.ir.cluster_io import list_presets
    from meshplan.ir.devices import PRECISIONS
    from meshplan.ir.hardware import gpu_spec, known_gpus

    t = Table(title="cluster presets (meshplan plan --cluster NAME [--gpus N])")
    t.add_column("name")
    t.add_column("description")
    for name, desc in list_presets():
        t.add_row(name, desc)
    out.print(t)
    g = Table(title="GPU types (--cluster TYPE builds 8-GPU nodes of it)")
    for col in ("type", "bf16 TFLOP/s", "fp32 TFLOP/s", "precisions", "memory GiB", "HBM TB/s"):
        g.add_column(col)
    for name in known_gpus():
        spec = gpu_spec(name)
        g.add_row(
            name,
            f"{spec.peak('bfloat16') / 1e12:.0f}" if spec.supports("bf16") else "-",
            f"{spec.peak('float32') / 1e12:.1f}",
            " ".join(p for p in PRECISIONS if spec.supports(p)),
            f"{spec.memory_bytes / 2**30:.0f}",
            f"{spec.hbm_bandwidth / 1e12:.2f}",
        )
    out.print(g)


@app.command()
@user_errors
def whatif(
    model: ModelOpt = None,
    cluster: Annotated[
        list[str] | None,
        typer.Option(
            "--cluster",
            "-c",
            help="Base cluster: preset, GPU type or YAML/JSON file; repeat to compare several "
            "(default dgx-h100).",
        ),
    ] = None,
    gpus: GpusOpt = None,
    vary: Annotated[
        list[str] | None,
        typer.Option(
            "--vary",
            help="AXIS=V1,V2,... with AXIS gpus, gpu (swap the GPU type), inter_bw (per NIC) or "
            "wan_bw, e.g. inter_bw=100,200,400Gbps; repeat for a cartesian product.",
        ),
    ] = None,
    mix: Annotated[
        str | None,
        typer.Option("--mix", help="Mixed clusters of --gpus GPUs, e.g. H100:A100=1:3,1:1,3:1."),
    ] = None,
    tokens: Annotated[
        str | None, typer.Option("--tokens", help="Training run to price: 1T, 300B, 1e12, ...")
    ] = None,
    price: Annotated[
        list[str] | None,
        typer.Option("--price", help="GPU=$ per GPU-hour, e.g. H100=2.5 (repeatable)."),
    ] = None,
    global_batch: BatchOpt = None,
    seq_len: SeqOpt = None,
    dp: IntOpt = None,
    tp: IntOpt = None,
    pp: IntOpt = None,
    cp: IntOpt = None,
    ep: IntOpt = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch")] = None,
    recompute: RecomputeOpt = None,
    zero: ZeroOpt = None,
    fmt: Annotated[str, typer.Option("--format", help="table, csv or json.")] = "table",
    plot: Annotated[
        Path | None,
        typer.Option(
            "--plot",
            help="Write throughput-vs-cost (Pareto frontier) and step-time breakdown plots to "
            "this .png/.svg/.pdf (needs matplotlib).",
        ),
    ] = None,
    cache_dir: Annotated[
        Path | None,
        typer.Option("--cache-dir", help="Plan cache folder (default ~/.cache/meshplan/whatif)."),
    ] = None,
    no_cache: Annotated[
        bool, typer.Option("--no-cache", help="Plan every configuration afresh; no cache.")
    ] = False,
    time_limit: Annotated[
        float,
        typer.Option(
            "--time-limit",
            help="Solver budget per configuration (seconds of counted work; see plan).",
        ),
    ] = 10.0,
) -> None:
    """Compare hardware configurations: best plan, tokens/s, MFU, cost and bottleneck of each.

    meshplan whatif --model llama3-70b --gpus 128 --vary gpu=H100,A100 --tokens 1T --plot w.png
    """
    from meshplan.models import DEFAULT_MODEL
    from rich.markup import escape
    from rich.progress import Progress

    from .api import load_model
    from .solver import check_budget
    from .whatif import (
        parse_price,
        parse_tokens,
        parse_vary,
        plot_records,
        records_table,
        records_to_csv,
        records_to_json,
        require_matplotlib,
    )
    from .whatif import whatif as run_whatif

    fmt = fmt.strip().lower()
    if fmt not in ("table", "csv", "json"):
        raise ValueError(f"--format must be table, csv or json, got {fmt!r}")
    if plot is not None:
        if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
            raise ValueError(f"--plot {plot}: use a .png, .svg or .pdf file name")
        try:
            require_matplotlib()  # before the sweep, not after it
        except ImportError as e:
            err.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
            raise typer.Exit(EXIT_USER_ERROR) from None
    axes: dict[str, list[str]] = {}
    for text in vary or []:
        axis, values = parse_vary(text)
        if axis in axes:
            raise ValueError(f"--vary {axis} given twice; list all its values in one --vary")
        axes[axis] = values
    prices = dict(parse_price(p) for p in price or [])
    n_tokens = parse_tokens(tokens) if tokens else None
    # Inputs every configuration shares are checked once here, not reported per row.
    if gpus is not None and gpus < 1:
        raise ValueError(f"--gpus must be a positive integer, got {gpus}")
    check_budget(time_limit, "--time-limit")
    if mix and cluster:
        raise ValueError("--mix builds its own clusters from GPU types; leave out --cluster")
    if mix and gpus is None and "gpus" not in axes:
        raise ValueError("--mix needs a total GPU count: give --gpus N (or --vary gpus=...)")
    pins = _pins(dp, tp, pp, cp, ep, micro_batch, global_batch, recompute, zero)
    name = model or DEFAULT_MODEL
    m, inputs = load_model(name, seq_len=seq_len)
    graph = _trace(name, m, inputs)
    sweep = functools.partial(
        run_whatif,
        graph,
        clusters=cluster or None,
        gpus=gpus,
        vary=axes,
        mix=mix,
        parallel=pins,
        tokens=n_tokens,
        prices=prices,
        time_limit_s=time_limit,
        cache_dir=cache_dir,
        use_cache=not no_cache,
    )
    if err.is_terminal:
        with Progress(console=err, transient=True) as bar:
            task = bar.add_task("planning", total=None)
            records = sweep(
                progress=lambda done, total, label: bar.update(
                    task, completed=done, total=total, description=f"planning {label}"
                )
            )
    else:
        records = sweep()
    if fmt == "json":
        sys.stdout.write(records_to_json(records))
    elif fmt == "csv":
        sys.stdout.write(records_to_csv(records))
    else:
        out.print(records_table(records))
    if plot is not None:
        sys.stdout.flush()  # the table first, then the note
        err.print(f"wrote {plot_records(records, plot)}")


def _verify(plan_or_pins, model: str | None, *, steps, nproc_max, seq_len, timeout):
    """Run `meshplan.verify` for the CLI and print the layouts, the notes and the verdict."""
    from meshplan.ir.plan import Plan

    from .verify import layout_text, model_fn_for
    from .verify import verify as run_verify

    is_plan = isinstance(plan_or_pins, Plan)
    parallel = plan_or_pins.parallel if is_plan else plan_or_pins
    if model is None:
        from meshplan.models import PRESETS

        name = plan_or_pins.model.name if is_plan else ""
        if name.lower() not in PRESETS:
            raise ValueError(
                f"the plan's model {name!r} is not a preset: give --model file.py:factory (a "
                "small real model)"
                if is_plan
                else "give --model NAME or path/to/file.py:factory"
            )
        model = name
    model_fn = model_fn_for(model, parallel, seq_len=seq_len)
    if is_plan:
        out.print(f"plan:   {layout_text(parallel)}", markup=False, soft_wrap=True)
    # No spinner: its thread would be running when the ranks fork.
    report = run_verify(
        model_fn, plan_or_pins, steps=steps, seq_len=seq_len, max_ranks=nproc_max, timeout_s=timeout
    )
    out.print(f"verify: {report.layout}", markup=False, soft_wrap=True)
    out.print(f"model:  {model} ({report.model})", markup=False, soft_wrap=True)
    for note in report.notes:
        out.print(f"note: {note}", markup=False, soft_wrap=True)
    out.print(report.summary(), markup=False, soft_wrap=True)
    return report


StepsOpt = Annotated[int, typer.Option("--steps", help="SGD steps compared.")]
NprocMaxOpt = Annotated[
    int, typer.Option("--nproc-max", help="At most this many CPU ranks (degrees reduced).")
]
VerifyTimeoutOpt = Annotated[
    float, typer.Option("--timeout", help="Seconds before the ranks are stopped.")
]


@app.command()
@user_errors
def verify(
    plan_file: Annotated[
        Path | None, typer.Argument(help="Plan JSON to verify (or pin a layout: --tp 2 ...).")
    ] = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            help="Preset (built at verify size; default: the plan's) or path/to/file.py:factory "
            "building a small real model.",
        ),
    ] = None,
    steps: StepsOpt = 2,
    nproc_max: NprocMaxOpt = 8,
    seq_len: SeqOpt = None,
    dp: IntOpt = None,
    tp: IntOpt = None,
    pp: IntOpt = None,
    cp: IntOpt = None,
    ep: IntOpt = None,
    micro_batch: Annotated[int | None, typer.Option("--micro-batch")] = None,
    global_batch: BatchOpt = None,
    recompute: RecomputeOpt = None,
    zero: ZeroOpt = None,
    schedule: ScheduleOpt = None,
    virtual_stages: VirtualOpt = None,
    timeout: VerifyTimeoutOpt = 300.0,
) -> None:
    """Run a plan's layout on CPU ranks with the model at a small size and compare losses and
    gradients with one process: PASS, or the first parameter that diverges.

    Exit status 0 on PASS, 1 on FAIL, 2 on a usage mistake.
    """
    from meshplan.ir.plan import Plan

    pins = _pins(
        dp, tp, pp, cp, ep, micro_batch, global_batch, recompute, zero, schedule, virtual_stages
    )
    if plan_file is not None and pins.pinned():
        raise ValueError("give a plan file or pin a layout (--tp 2 ...), not both")
    if plan_file is None and not pins.pinned():
        raise ValueError("give a plan file (meshplan verify plan.json) or pin a layout (--tp 2)")
    target = Plan.from_json(plan_file) if plan_file is not None else pins
    report = _verify(
        target, model, steps=steps, nproc_max=nproc_max, seq_len=seq_len, timeout=timeout
    )
    if not report.ok:
        raise typer.Exit(1)


# The program comes after `--` (or, without options of its own, after the plan); an option
# before `--` that launch does not know is a mistake, not something to hand to torchrun.
@app.command(context_settings={"allow_extra_args": True})
def launch(
    ctx: typer.Context,
    plan_file: Annotated[Path, typer.Argument(help="Plan JSON to run.")],
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's rank.")] = 0,
    rdzv_endpoint: Annotated[
        str | None, typer.Option("--rdzv-endpoint", help="HOST:PORT of node 0 (multi-node).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print every node's command; start nothing.")
    ] = False,
    verify_first: Annotated[
        bool,
        typer.Option("--verify", help="Run `meshplan verify` first; launch nothing on FAIL."),
    ] = False,
    verify_model: Annotated[
        str | None,
        typer.Option(
            "--verify-model",
            help="Model for --verify: preset or path/to/file.py:factory (default: the plan's).",
        ),
    ] = None,
) -> None:
    """Run a plan: torchrun for this node (`meshplan launch plan.json -- python train.py`)."""
    from meshplan.runtime.launch import TorchLog
    from meshplan.runtime.launch import launch as run_launch

    @user_errors
    def go() -> int:
        if verify_first:
            from meshplan.ir.plan import Plan

            report = _verify(
                Plan.from_json(plan_file),
                verify_model,
                steps=2,
                nproc_max=8,
                seq_len=None,
                timeout=300.0,
            )
            if not report.ok:
                err.print("[bold red]error:[/] verify failed; not launching")
                raise typer.Exit(1)
        return run_launch(
            plan_file,
            list(ctx.args),
            node_rank=node_rank,
            rdzv_endpoint=rdzv_endpoint,
            dry_run=dry_run,
            echo=lambda line: out.print(line, soft_wrap=True, markup=False),
            on_failure=causes.append,
            torch_log=None if _debug else held.append,
        )

    causes: list[str] = []  # the ranks' own account of a failure (runtime/watchdog.py)
    held: list[TorchLog] = []  # torch's own log, held back; `--debug` passes it through
    code = go()
    summary = held[0].summary() if held else None
    if summary:
        err.print(
            f"note: {summary}; `meshplan --debug launch ...` prints it",
            markup=False,
            soft_wrap=True,
        )
    if code:
        why = causes[0] if causes else "see the rank above"
        from rich.markup import escape

        err.print(
            f"[bold red]error:[/] training exited with status {code}: {escape(why)}",
            soft_wrap=True,
        )
        raise typer.Exit(code)


@app.command()
@user_errors
def profile(
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            "-o",
            help="Dataset to append to (default: data/op_latency/<device>.jsonl.gz).",
        ),
    ] = None,
    families: Annotated[
        str | None,
        typer.Option(help="Comma-separated: gpt2,llama,mixtral,bert,sweep (default all)."),
    ] = None,
    dtypes: Annotated[str, typer.Option(help="Comma-separated dtypes.")] = "float32,bfloat16",
    quick: Annotated[bool, typer.Option("--quick", help="A few ops only (seconds).")] = False,
    max_seconds: Annotated[float, typer.Option(help="Time cap of one measurement.")] = 0.12,
    threads: Annotated[int, typer.Option(help="CPU threads (0: torch's default).")] = 1,
    device: Annotated[
        str | None, typer.Option(help="cpu or cuda (default: cuda if present).")
    ] = None,
) -> None:
    """Micro-benchmark the IR's operators on this device; append to the latency dataset."""
    from meshplan.measure.profile import run_profile

    path, rows, skipped = run_profile(
        output,
        families=families.split(",") if families else None,
        dtypes=tuple(dtypes.split(",")),
        quick=quick,
        max_seconds=max_seconds,
        threads=threads or None,
        device=device,
    )
    note = f" ({skipped} ops had no recipe)" if skipped else ""
    out.print(f"appended {rows} rows to {path}{note}")


@app.command()
@user_errors
def calibrate(
    output: Annotated[Path, typer.Option("--output", "-o", help="Profile to write (.json/.yaml).")],
    nproc: Annotated[int, typer.Option("--nproc", help="Ranks to start on this host.")] = 2,
    min_size: Annotated[str, typer.Option(help="Smallest message, e.g. 4KiB.")] = "4KiB",
    max_size: Annotated[str, typer.Option(help="Largest message, e.g. 64MiB.")] = "64MiB",
    collectives: Annotated[
        str,
        typer.Option(help="Comma-separated: all_reduce,all_gather,reduce_scatter,all_to_all,p2p."),
    ] = "all_reduce,all_gather,reduce_scatter,all_to_all,p2p",
    iters: Annotated[int, typer.Option(help="Timed calls per size.")] = 5,
    warmup: Annotated[int, typer.Option(help="Untimed calls per size.")] = 2,
    backend: Annotated[str, typer.Option(help="auto, gloo (CPU) or nccl (CUDA).")] = "auto",
    gpu: Annotated[
        str | None, typer.Option(help="GPU type of this host (default: detected; CPU for gloo).")
    ] = None,
    intra_link: Annotated[
        str | None, typer.Option(help="Tier name inside a node (default: the GPU type's).")
    ] = None,
    inter_link: Annotated[
        str | None, typer.Option(help="Tier name between nodes (when ranks span hosts).")
    ] = None,
    nics_per_node: Annotated[int, typer.Option(help="NICs per node on this machine.")] = 1,
    gemm: Annotated[bool, typer.Option(help="Measure the GEMM-efficiency table.")] = True,
    gemm_shapes: Annotated[
        str | None, typer.Option(help="MxNxK list, e.g. 4096x4096x4096,8192x4096x14336.")
    ] = None,
    gemm_dtypes: Annotated[
        str | None, typer.Option(help="Comma-separated (default bfloat16 on GPU, float32 on CPU).")
    ] = None,
    timeout: Annotated[float, typer.Option(help="Seconds before the ranks are stopped.")] = 600.0,
) -> None:
    """Measure collective bandwidth curves per link tier and GEMM efficiency on this host and
    write a cluster profile for `plan --profile` / `estimate --profile`."""
    from meshplan.ir.cluster_io import dump_profile
    from meshplan.measure.calibrate import (
        CalibrateConfig,
        parse_shapes,
        parse_size,
        summary,
    )
    from meshplan.measure.calibrate import calibrate as run_calibration
    from meshplan.runtime.errors import RankFailure

    _check_output(output)
    if Path(output).suffix.lower() not in (".json", ".yaml", ".yml"):
        raise ValueError(f"--output {output}: a profile file ends in .json, .yaml or .yml")
    lo, hi = parse_size(min_size), parse_size(max_size)
    if not 4 <= lo <= hi:  # checked before any rank starts, naming the flags
        raise ValueError(
            f"--min-size {min_size} and --max-size {max_size}: need 4 bytes <= --min-size "
            "<= --max-size"
        )
    cfg = CalibrateConfig(
        min_size=lo,
        max_size=hi,
        collectives=tuple(c.strip() for c in collectives.split(",") if c.strip()),
        warmup=warmup,
        iters=iters,
        backend=backend,
        gpu=gpu,
        intra_link=intra_link,
        inter_link=inter_link,
        nics_per_node=nics_per_node,
        gemm=gemm,
        gemm_shapes=parse_shapes(gemm_shapes) if gemm_shapes else None,
        gemm_dtypes=tuple(gemm_dtypes.split(",")) if gemm_dtypes else None,
    )
    try:
        result = run_calibration(nproc, cfg, timeout_s=timeout)
    except RankFailure as e:  # the rank's own one-line cause (a bad flag, a timeout)
        raise ValueError(f"calibration failed on rank {e.rank}: {e.cause}") from None
    dump_profile(result, output)
    for line in summary(result):
        out.print(line)
    out.print(f"wrote {output}")


def main() -> None:
    """Entry point of the `meshplan` script.

    The script's process keeps what it imported to the end, so it moves those objects out of
    the collector's way (`gc.freeze`) and collects the young generation less often
    (`solver_objective.GC_YOUNG_THRESHOLD`, as the solver does); `_trace` freezes the
    traced model the same way. Full collections otherwise walk torch's million objects
    again and again: ~0.6 s of `meshplan plan` on Sailor's 512-GPU scenario
    (docs/planner.md)."""
    _fewer_collections()
    # Piped output (a file, CI logs) gets 120 columns rather than rich's 80, so the plan's
    # tables keep their headers; a terminal, or a COLUMNS setting, keeps its own width.
    if not sys.stdout.isatty():
        os.environ.setdefault("COLUMNS", "120")
    try:
        app(prog_name="meshplan")
    except SystemExit as e:
        _leave(e.code)
    _leave(0)


# Set by `main`: this process is the `meshplan` script (not `app` called in-process).
_AS_SCRIPT = False


def _fewer_collections() -> None:
    """The script's garbage-collection settings (`main`): what exists now never collected,
    the young generation collected every GC_YOUNG_THRESHOLD allocations."""
    import gc

    from .solver_objective import GC_YOUNG_THRESHOLD

    global _AS_SCRIPT
    _AS_SCRIPT = True
    gc.freeze()
    young, *older = gc.get_threshold()
    gc.set_threshold(max(young, GC_YOUNG_THRESHOLD), *older)


def _leave(code: object) -> None:
    """Exit the `meshplan` script with `code` (`sys.exit`'s meaning: None is 0, an int is the
    status, anything else is printed and gives 1), skipping the interpreter's teardown.

    Python's teardown frees every object one by one: after planning Llama-3-70B on 512 GPUs
    that is ~1.4 s of a ~9.5 s command (docs/planner.md), for nothing, since every output
    is written and closed by then. So the script flushes its streams, shuts logging down and
    leaves with `os._exit`. It exits normally (`sys.exit`, atexit handlers run) where those
    handlers matter: a process group of torch.distributed is up in this process, or coverage
    is measuring. `app` called in-process (tests, `python -m` callers of `app`) never gets here.
    """
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    dist = sys.modules.get("torch.distributed")
    distributed_up = dist is not None and dist.is_available() and dist.is_initialized()
    if distributed_up or "coverage" in sys.modules:
        sys.exit(status)
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`meshplan plan | head`) or stream
            pass
    os._exit(status)


if __name__ == "__main__":
    main()
