"""Step 3 of the search (`meshplan.solver`): the placement model of one (configuration,
split) pair (OR-Tools CP-SAT), variables -> constraints -> objective, one method of
`_PlacementModel` per constraint family.

Sets
    c, l        one candidate configuration and its split (`solver_candidates`); the search fixes
                (c, l) before building a model, since different (c, l) share no variable
    s < pp_c    pipeline stages;   g in G  device groups

Data (seconds and bytes, from `meshplan.cost_model.plan_tables`, integerised by `_Scale`)
    u[c,l,s,g]  one micro-batch (fwd + bwd + recompute + TP/CP/EP traffic) of stage s on g
    w, o, q, d, e   DP overlap window, optimizer, boundary p2p, DP traffic in one group / across
                two groups (shared GroupLink divided among k crossing stages), as before
    m_c, v_c, pp_c, rep_c (m_c for ZeRO-3, else 1), R[c,g] replicas of tp*cp GPUs g can hold

Variables (per (c, l))
    n[s,g]      int, replicas of stage s in group g;  b[s,g] = (n[s,g] >= 1)
    cross[s]    bool, stage s spans several groups;  k = sum_s cross[s]
    us[s], U, P, comm[s], W[s], E, O, T

Constraints (each family added by the named method of `_PlacementModel`)
    replicas        `replicas`: sum_g n[s,g] = dp;  b <= n <= min(dp, R[g]) * b
    memory          `variables`: n[s,g] exists only where the stage fits in g's memory
    capacity        `capacity`: sum_s tp * cp * n[s,g] <= gpus(g)  (TP inside an NVLink
                    domain: no variables where tp does not divide domain_gpus(g), a node's
                    GPUs unless the group sets nvlink_domain; `tp_domain_problem`)
    stage_times     `stage_times`: us[s] >= u[s,g] * b[s,g];  U >= us[s]
    boundaries      `boundaries`: P >= q[s,a,b] * (b[s,a] + b[s+1,b] - 1)
    data_parallel   `data_parallel`: cross, k, comm[s] >= d or e(k), W[s] = max_g w b,
                    E >= comm[s] - eta W[s],  E >= (1 - eta) comm[s]
    optimizer       `optimizer`: O >= o[s,g] * b[s,g]
    bubble          `bubble` (ZB-V only): Z >= z[s,g] * b[s,g], z = `StageTime.zb_bubble`
    step_time       `step_time`: v T >= (v m - 1) U + sum_s us[s] + v (m v + pp - 1) P
                                        + v rep E + v O      (interleaved 1F1B: m U +
                    (sum_s us - U) / v + (m v + pp - 1) P; v = 1 is plain 1F1B); ZB-V:
                    T >= m U + (pp - 1) Z + (2 m + pp - 1) P + rep E + O; T <= cutoff
    objective       minimise T (objective "throughput"; "cost" and "min_gpus" score its
                    placement, `solver_objective`)

The greedy placement of the screen is the hint (`AddHint`) and the incumbent the cutoff; one
worker and a fixed seed make the solve deterministic (`_PlacementModel.solve`).
"""

from __future__ import annotations

import math
from fractions import Fraction

from meshplan.cost_model.pricer import OVERLAP_EFFICIENCY
from meshplan.ir import Cluster
from ortools.sat.python import cp_model

from .solver_objective import (
    CPSAT_DETERMINISTIC_PER_WORK,
    CPSAT_MIN_DETERMINISTIC,
    Placement,
    _Work,
)
from .solver_screen import _Priced

# Integer time unit: the best greedy step time is represented by about this many units, so
# rounding each table entry to a unit costs at most ~1e-7 of the step per term.
UNITS_PER_STEP = 10_000_000


class _Scale:
    """Seconds -> integer time units (`UNITS_PER_STEP` units for the reference step time)."""

    def __init__(self, reference_s: float) -> None:
        self.unit = max(reference_s, 1e-12) / UNITS_PER_STEP

    def __call__(self, seconds: float) -> int:
        return max(0, round(seconds / self.unit))


class _PlacementModel:
    """The model of the module docstring restricted to one (candidate, split): lock-step
    placements, objective min T (step seconds)."""

    def __init__(self, pr: _Priced, cluster: Cluster, scale: _Scale, cutoff_s: float) -> None:
        self.m = cp_model.CpModel()
        self.pr, self.t, self.cluster, self.q = pr, pr.tables, cluster, scale
        eta = Fraction(OVERLAP_EFFICIENCY).limit_denominator(1000)
        self.eta_num, self.eta_den = eta.numerator, eta.denominator
        self.hi = self._upper()
        self.variables()
        self.replicas()
        self.capacity()
        t, v = self.t, self.t.chunks
        if t.zero_bubble:  # m U + (pp - 1) Z + (2 m + pp - 1) P + rep E + O, T >= it
            step_v = (
                t.m * self.stage_times()
                + (t.pp - 1) * self.bubble()
                + (t.m * v + t.pp - 1) * self.boundaries()
                + t.rep * self.data_parallel()
                + self.optimizer()
            )
            v = 1
        else:
            step_v = (
                (v * t.m - 1) * self.stage_times()
                + sum(self.us)
                + v * (t.m * v + t.pp - 1) * self.boundaries()
                + v * t.rep * self.data_parallel()
                + v * self.optimizer()
            )
        self.step_time(step_v, cutoff_s, v)
        self.m.Minimize(self.T)

    def _upper(self) -> int:
        """An upper bound on the step time in units (variable domains)."""
        t, q = self.t, self.q
        big_u = max(max(x.total for x in row.values()) for row in t.time)
        p2p = max((max(row.values()) for row in t.p2p), default=0.0)
        comm = 0.0
        for s in range(t.pp):
            comm = max(comm, max(t.dp_single[s].values(), default=0.0))
            comm = max([comm] + [ct.time(t.pp) for ct in t.dp_cross[s].values()])
        opt = max(max(row.values()) for row in t.optimizer)
        pipe = (t.m + t.pp) * big_u + (t.m * t.chunks + t.pp - 1) * p2p
        return q(pipe + t.rep * comm + opt) + 1

    def variables(self) -> None:
        """n[s,g], b[s,g] only where stage s fits in g's memory (the memory family), T."""
        self.n: list[dict[str, cp_model.IntVar]] = []
        self.b: list[dict[str, cp_model.IntVar]] = []
        dp = self.pr.cand.dp
        for s in range(self.t.pp):
            self.n.append(
                {
                    g: self.m.NewIntVar(0, min(dp, self.t.replica_capacity[g]), f"n[{s},{g}]")
                    for g in self.pr.allowed[s]
                }
            )
            self.b.append({g: self.m.NewBoolVar(f"b[{s},{g}]") for g in self.pr.allowed[s]})
        self.T = self.m.NewIntVar(0, self.hi, "T")

    def replicas(self) -> None:
        """sum_g n[s,g] = dp;  b = (n >= 1)."""
        dp = self.pr.cand.dp
        for s, n_s in enumerate(self.n):
            self.m.Add(sum(n_s.values()) == dp).WithName(f"replicas[{s}]")
            for g, n in n_s.items():
                self.m.Add(n >= self.b[s][g])
                self.m.Add(n <= min(dp, self.t.replica_capacity[g]) * self.b[s][g])

    def capacity(self) -> None:
        """sum_s tp * cp * n[s,g] <= GPUs of g."""
        per = self.pr.cand.tp * self.pr.cand.cp
        for g in self.cluster.groups:
            terms = [per * n_s[g.name] for n_s in self.n if g.name in n_s]
            if terms:
                self.m.Add(sum(terms) <= g.num_gpus).WithName(f"capacity[{g.name}]")

    def stage_times(self) -> cp_model.IntVar:
        """us[s] >= u[s,g] * b[s,g];  U >= us[s]. Returns U."""
        t, q, m = self.t, self.q, self.m
        self.us = [m.NewIntVar(0, self.hi, f"us[{s}]") for s in range(t.pp)]
        big_u = m.NewIntVar(0, self.hi, "U")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                m.Add(self.us[s] >= q(t.time[s][g].total) * bv).WithName(f"stage_time[{s},{g}]")
            m.Add(big_u >= self.us[s])
        return big_u

    def bubble(self) -> cp_model.IntVar:
        """ZB-V only: Z >= z[s,g] * b[s,g] (`StageTime.zb_bubble`). Returns Z."""
        t, q, m = self.t, self.q, self.m
        big_z = m.NewIntVar(0, self.hi, "Z")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                v = q(t.bubble_unit(s, g))
                if v:
                    m.Add(big_z >= v * bv).WithName(f"bubble[{s},{g}]")
        return big_z

    def boundaries(self) -> cp_model.IntVar:
        """P >= q[s,a,b] * (b[s,a] + b[s+1,b] - 1). Returns P."""
        t, q, m = self.t, self.q, self.m
        p2p = m.NewIntVar(0, self.hi, "P")
        for s in range(t.pp - 1):
            for a, ba in self.b[s].items():
                for c, bc in self.b[s + 1].items():
                    v = q(t.p2p[s][(a, c)])
                    if v:
                        m.Add(p2p >= v * (ba + bc - 1)).WithName(f"boundary[{s},{a},{c}]")
        return p2p

    def data_parallel(self) -> cp_model.IntVar:
        """cross, k, comm, W and E >= comm - eta * min(comm, W) (see the docstring). Returns E."""
        t, q, m, b = self.t, self.q, self.m, self.b
        cross: list[cp_model.IntVar | None] = []
        for s, b_s in enumerate(b):
            if len(b_s) < 2:
                cross.append(None)
                continue
            cv = m.NewBoolVar(f"cross[{s}]")
            m.Add(cv <= sum(b_s.values()) - 1)
            gs = list(b_s)
            for j, a in enumerate(gs):
                for c in gs[j + 1 :]:
                    m.Add(cv >= b_s[a] + b_s[c] - 1)
            cross.append(cv)
        k = m.NewIntVar(0, t.pp, "k")
        m.Add(k == sum(cv for cv in cross if cv is not None))
        exposed = m.NewIntVar(0, self.hi, "E")
        for s, b_s in enumerate(b):
            comm = m.NewIntVar(0, self.hi, f"comm[{s}]")
            for g, bv in b_s.items():
                v = q(t.dp_single[s][g])
                if v:
                    expr = v * bv - (v * cross[s] if cross[s] is not None else 0)
                    m.Add(comm >= expr).WithName(f"dp_single[{s},{g}]")
            order = [g for g in t.groups if g in b_s]
            for j, a in enumerate(order):
                for c in order[j + 1 :]:
                    ct = t.dp_cross[s][(a, c)]
                    both = b_s[a] + b_s[c] - 1
                    # Raw or coded traffic (`CrossTraffic.coded`): comm covers the one chosen.
                    pieces: list = [(ct, [])]
                    if ct.coded is not None:
                        z = m.NewBoolVar(f"coded[{s},{a},{c}]")
                        pieces = [(ct, [z.Not()]), (ct.coded, [z])]
                    for piece, when in pieces:
                        m.Add(comm >= q(piece.unshared) * both).WithName(
                            f"dp_cross[{s},{a},{c}]"
                        ).OnlyEnforceIf(when)
                        if piece.per_stage is not None:
                            lat, per = q(piece.latency), q(piece.per_stage)
                            big_m = lat + per * t.pp
                            m.Add(comm >= lat + per * k - big_m * (1 - both)).OnlyEnforceIf(when)
            window = m.NewIntVar(0, self.hi, f"W[{s}]")
            m.AddMaxEquality(window, [q(t.window[s][g]) * bv for g, bv in b_s.items()])
            # E >= comm - eta * min(comm, W) = max(comm - eta * W, (1 - eta) * comm)
            m.Add(self.eta_den * exposed >= self.eta_den * comm - self.eta_num * window)
            m.Add(self.eta_den * exposed >= (self.eta_den - self.eta_num) * comm)
        return exposed

    def optimizer(self) -> cp_model.IntVar:
        """O >= o[s,g] * b[s,g]. Returns O."""
        opt = self.m.NewIntVar(0, self.hi, "O")
        for s, b_s in enumerate(self.b):
            for g, bv in b_s.items():
                self.m.Add(opt >= self.q(self.t.optimizer[s][g]) * bv)
        return opt

    def step_time(self, step_v, cutoff_s: float, v: int) -> None:
        """v T >= v * step time; T <= the incumbent (a placement that cannot beat it is
        useless)."""
        self.m.Add(v * self.T >= step_v).WithName("step_time")
        if math.isfinite(cutoff_s):
            self.m.Add(self.T <= self.q(cutoff_s) + 1).WithName("cutoff")

    def hint(self, placement: Placement) -> None:
        """Warm start from a greedy placement."""
        for s, n_s in enumerate(self.n):
            chosen = dict(placement[s])
            for g, nv in n_s.items():
                self.m.AddHint(nv, chosen.get(g, 0))
                self.m.AddHint(self.b[s][g], 1 if chosen.get(g, 0) else 0)

    def solve(self, work: _Work, share: float):
        """(status, placement or None, lower bound in seconds), spending at most `share` work
        units of `work` (at least CPSAT_MIN_DETERMINISTIC deterministic seconds).

        Deterministic: one worker and a fixed seed make CP-SAT follow one search path, and its
        limit is deterministic time (`max_deterministic_time`), which counts work, not
        seconds; the wall-clock limit is only the budget's safety net."""
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.random_seed = 0
        solver.parameters.max_deterministic_time = max(
            CPSAT_MIN_DETERMINISTIC, share * CPSAT_DETERMINISTIC_PER_WORK
        )
        solver.parameters.max_time_in_seconds = work.seconds_left()
        status = solver.Solve(self.m)
        work.charge("cpsat", solver.deterministic_time)
        if status not in (cp_model.OPTIMAL, cp_model.INFEASIBLE):
            work.past_deadline()  # stopped on the safety net rather than its own budget?
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            placement = [
                [(g, solver.Value(nv)) for g, nv in n_s.items() if solver.Value(nv)]
                for n_s in self.n
            ]
            return status, placement, solver.BestObjectiveBound() * self.q.unit
        return status, None, solver.BestObjectiveBound() * self.q.unit
