"""The paper's systems experiments on the simulator: one run, Fig. 3c, Fig. 4, Table 2 (pure compute;
plots live in :mod:`echo2.sim.plots`, files are written by the CLI and the benchmark)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from echo2.config import load_settings
from echo2.errors import InfeasibleError
from echo2.physics import broadcast
from echo2.physics.rules import kappa_from_staleness, knee
from echo2.planner import capacity
from echo2.planner.activation import Candidate, activate
from echo2.planner.plan import make_plan
from echo2.sim.config import SimScenario
from echo2.sim.engine import SimParams, SimResult, SimWorker, simulate

log = logging.getLogger(__name__)

# Fig. 4 compares the three strategies of SPEC section 4 (tree-chains has the same model as tree-pipelined)
BCAST_STRATEGIES: tuple[broadcast.StrategyName, ...] = ("star-unlimited", "star-limited", "tree-pipelined")

# SPEC section 6, Table 2 of the paper (Qwen3-8B, mixed-price pool): reference values to print beside ours
PAPER_TABLE2 = {
    "full": {"machines": 9, "usd_per_step": 8.098, "t_bcast_s": 1437.0, "wait_s": 0.0},
    "no_p2p": {"machines": 9, "usd_per_step": 8.432, "t_bcast_s": 1830.0, "wait_s": 131.9},
    "no_p2p_plus1": {"machines": 10, "usd_per_step": 8.630, "t_bcast_s": 1872.0, "wait_s": 84.1},
    "no_cost_aware": {"machines": 9, "usd_per_step": 9.339, "t_bcast_s": 1437.0, "wait_s": 0.0},
}


def with_overrides(sc: SimScenario, **changes: Any) -> SimScenario:
    """A copy with dotted-path overrides, e.g. ``{"plan.staleness.S": 4, "sim.steps": 30}``, through the
    one config loader (``config.load_settings``: the same paths, validation and error format as a file's)."""
    return load_settings(SimScenario, overrides=changes, what="scenario", tree=sc.model_dump())


def workers_of(sc: SimScenario) -> list[SimWorker]:
    """Every worker of the catalog (``count`` per type), ids ``<type>-<j>`` like the planner's."""
    return [
        SimWorker(f"{w.name}-{j}", w.name, w.usd_per_hour, w.rollouts_per_s, w.link_bytes_per_s)
        for w in sc.plan.workers
        for j in range(w.count)
    ]


@dataclass(frozen=True)
class Setup:
    """A runnable simulation: parameters, the marketplace, the initial active set, and the plan."""

    params: SimParams  # engine parameters
    workers: list[SimWorker]  # the marketplace
    active_ids: list[str]  # active at t = 0
    plan: dict[str, Any]  # echo2 plan's view of the scenario


def setup(sc: SimScenario, *, policy: str | None = None, seed: int | None = None) -> Setup:
    """Plan the scenario, pick the initial active set (fixed counts or the plan's policy), build params."""
    plan = make_plan(sc.plan)
    workers = workers_of(sc)
    seed = sc.sim.seed if seed is None else seed
    if sc.sim.fixed_workers is not None:
        active = [f"{name}-{j}" for name, n in sc.sim.fixed_workers.items() for j in range(n)]
    else:
        cands = [Candidate(w.worker_id, w.type_name, w.usd_per_hour, w.rollouts_per_s) for w in workers]
        act = activate(policy or sc.plan.activation, cands, plan["mu_target"], seed=seed)
        active = [c.worker_id for c in act.selected]
    p = sc.plan
    if p.model is None:
        raise InfeasibleError("the simulator needs [model] snapshot_gb to model broadcasts")
    params = SimParams(
        rollouts_per_step=p.batch.rollouts,
        group_size=p.batch.group_size,
        t_train_s=p.learner.t_train,
        staleness=p.staleness.S,
        kappa=plan["kappa"],
        learner_usd_per_hour=p.learner.usd_per_hour or 0.0,
        snapshot_bytes=p.model.anchor_bytes,  # G, or a LoRA run's adapter
        b0_bytes_per_s=p.network.b0_bytes_per_s,
        strategy=sc.sim.strategy or p.network.strategy,
        steps=sc.sim.steps,
        seed=seed,
        reload_s=p.network.reload_s,
        chunk_bytes=p.network.chunk_bytes,
        hop_latency_s=p.network.hop_latency_s,
        patch_ratio=p.model.delta_ratio,
        anchor_every=p.model.anchor_every,
        gamma=p.staleness.gamma,
        noise_sigma=sc.sim.noise_sigma,
        straggler_prob=sc.sim.straggler_prob,
        straggler_factor=sc.sim.straggler_factor,
        overlap_generation=sc.sim.overlap_generation,
        warmup_steps=sc.sim.warmup_steps,
        mu_target=plan["mu_target"],
        controller=sc.controller if sc.sim.controller else None,
        control_interval_s=sc.sim.control_interval_s,
        churn_mean_lifetime_s=sc.churn.mean_lifetime_s,
        join_interval_s=sc.churn.join_interval_s,
        buffer_steps=sc.sim.buffer_steps,
        record_metrics=sc.sim.record_metrics,
        useful_share=p.useful_share,
    )
    return Setup(params, workers, active, plan)


def run(sc: SimScenario) -> tuple[SimResult, dict[str, Any]]:
    """One run of the scenario as configured; returns the result and the plan."""
    s = setup(sc)
    return simulate(s.params, s.workers, s.active_ids), s.plan


def bubble_sweep(sc: SimScenario) -> dict[str, Any]:
    """Fig. 3c: steady-state bubble ratio vs number of workers, one curve per S, N_min marked.

    Uses the catalog's first worker type as a homogeneous pool. The knee is
    :func:`echo2.physics.rules.knee` of the simulated curve (the smallest N whose bubble is <= 5%, the
    rule the measured curve uses too). The analytic curve is the cycle model
    (capacity.cycle_bubble_ratio).
    """
    wt = sc.plan.workers[0]
    curves: dict[str, Any] = {}
    for s_budget in sc.experiment.staleness:
        kappa = kappa_from_staleness(s_budget)
        sc_s = with_overrides(sc, **{"plan.staleness.S": s_budget, "plan.staleness.kappa": kappa})
        try:
            plan = make_plan(sc_s.plan)
        except InfeasibleError as exc:
            curves[str(s_budget)] = {"feasible": False, "reason": str(exc)}
            continue
        n_min = capacity.n_min(plan["mu_min"], wt.rollouts_per_s)
        n_gamma = math.ceil(plan["gamma"] * n_min - 1e-9)
        n_max = sc.experiment.n_max or 2 * n_min + 2
        ns = list(range(1, min(n_max, wt.count) + 1))
        sim_b, ana_b, smax, bound_ok = [], [], [], True
        for n in ns:
            run_sc = with_overrides(sc_s, **{"sim.fixed_workers": {wt.name: n}})
            res, _ = run(run_sc)
            sim_b.append(res.summary["bubble_ratio"])
            smax.append(res.summary["staleness_max"])
            bound_ok &= res.summary["staleness_max"] <= s_budget
            ana_b.append(
                capacity.cycle_bubble_ratio(
                    kappa=kappa,
                    t_train=plan["t_train_s"],
                    t_bcast=plan["t_bcast_s"],
                    rollouts=plan["rollouts_per_step"],
                    mu_pool=n * wt.rollouts_per_s,
                )
            )
        curves[str(s_budget)] = {
            "feasible": True,
            "kappa": kappa,
            "t_bcast_s": plan["t_bcast_s"],
            "mu_min": plan["mu_min"],
            "n_min": n_min,
            "n_gamma": n_gamma,
            "ns": ns,
            "bubble_sim": sim_b,
            "bubble_analytic": ana_b,
            "staleness_max": smax,
            "knee": knee(ns, sim_b),
            "bubble_at_n_gamma": sim_b[n_gamma - 1] if n_gamma <= len(ns) else None,
            "bubble_at_n_min_minus_2": sim_b[n_min - 3] if n_min >= 3 else None,
            "staleness_within_budget": bound_ok,
        }
    return {"worker_type": wt.name, "worker_rate": wt.rollouts_per_s, "curves": curves}


def bcast_sweep(sc: SimScenario) -> dict[str, Any]:
    """Fig. 4: T_bcast (last worker, reload included) vs N for the three strategies, with T*.

    One model for the planner and the simulator (:mod:`echo2.physics.broadcast`): each point is the
    last worker's completion time on N equal links, which is exactly the planner's estimate;
    ``lower_bound`` is T* + reload.
    """
    p = sc.plan
    assert p.model is not None
    g = p.model.snapshot_bytes
    bw = p.workers[0].link_bytes_per_s
    b0 = p.network.b0_bytes_per_s
    out: dict[str, Any] = {
        "ns": list(sc.experiment.ns),
        "b0_mbps": p.network.b0_mbps,
        "bw_mbps": p.workers[0].bandwidth_mbps,
        "snapshot_gb": p.model.snapshot_gb,
        "reload_s": p.network.reload_s,
        "sim": {},
    }
    for strat in BCAST_STRATEGIES:
        out["sim"][strat] = [
            broadcast.homogeneous_time(
                strat,
                g,
                b0,
                bw,
                n,
                chunk_bytes=p.network.chunk_bytes,
                hop_latency_s=p.network.hop_latency_s,
                reload_s=p.network.reload_s,
            )
            for n in sc.experiment.ns
        ]
    out["lower_bound"] = [broadcast.lower_bound(g, b0, bw, n) + p.network.reload_s for n in sc.experiment.ns]
    tree = np.array(out["sim"]["tree-pipelined"])
    lb = np.array(out["lower_bound"])
    out["tree_over_lower_bound_max"] = float((tree / lb).max())
    return out


def _row(
    sc: SimScenario,
    *,
    policy: str,
    strategy: broadcast.StrategyName,
    extra: int = 0,
    seeds: int = 1,
    patch_ratio: float | None = None,
) -> dict[str, Any]:
    rows = []
    changes: dict[str, Any] = {"sim.strategy": strategy}
    if patch_ratio is not None:
        changes["plan.model.patch_ratio"] = patch_ratio
    for k in range(seeds):
        s = setup(with_overrides(sc, **changes), policy=policy, seed=sc.sim.seed + k)
        ids = list(s.active_ids)
        if extra:
            by_id = {w.worker_id: w for w in s.workers}
            rest = sorted(
                (w for w in s.workers if w.worker_id not in ids),
                key=lambda w: (w.usd_per_hour / w.rollouts_per_s, w.worker_id),
            )
            ids += [w.worker_id for w in rest[:extra]]
            assert all(i in by_id for i in ids)
        res = simulate(s.params, s.workers, ids)
        by = {w.worker_id: w for w in s.workers}
        sm = res.summary
        rows.append(
            {
                "machines": len(ids),
                "workers_usd_per_hour": math.fsum(by[i].usd_per_hour for i in ids),
                "mu_pool": math.fsum(by[i].rollouts_per_s for i in ids),
                "usd_per_step": sm["usd_per_step_steady"],
                "t_bcast_s": sm["t_bcast_mean_s"],
                "wait_per_step_s": sm["idle_per_step_s"],
                "wait_per_cycle_s": sm["idle_per_step_s"] * s.params.kappa,
                "bubble_ratio": sm["bubble_ratio"],
                "staleness_max": sm["staleness_max"],
            }
        )
    keys = rows[0].keys()
    return {k: float(np.mean([r[k] for r in rows])) for k in keys} | {"seeds": seeds}


def ablation(sc: SimScenario) -> dict[str, Any]:
    """Table 2: full / without P2P / without P2P + 1 machine / without cost-aware activation, and
    with ``experiment.patch_ratio`` set, "+ deltas" rows: the full system and the one without P2P
    publishing patches of that size (an anchor every ``model.anchor_every``; planned with the mean
    bytes per publication, so the planner may pick fewer machines).

    full = greedy activation + Tree-Pipelined; without P2P = same machines + Star-Limited; without
    cost-aware = random ("NoCost") activation + Tree-Pipelined, averaged over ``experiment.seeds``.
    """
    rows = {
        "full": _row(sc, policy="greedy", strategy="tree-pipelined"),
        "no_p2p": _row(sc, policy="greedy", strategy="star-limited"),
        "no_p2p_plus1": _row(sc, policy="greedy", strategy="star-limited", extra=1),
        "no_cost_aware": _row(sc, policy="random", strategy="tree-pipelined", seeds=sc.experiment.seeds),
    }
    if (r := sc.experiment.patch_ratio) is not None:
        rows["full_deltas"] = _row(sc, policy="greedy", strategy="tree-pipelined", patch_ratio=r)
        rows["no_p2p_deltas"] = _row(sc, policy="greedy", strategy="star-limited", patch_ratio=r)
    full = rows["full"]["usd_per_step"]
    for r in rows.values():
        r["cost_vs_full"] = r["usd_per_step"] / full
    paper_full = PAPER_TABLE2["full"]["usd_per_step"]
    paper = {k: v | {"cost_vs_full": v["usd_per_step"] / paper_full} for k, v in PAPER_TABLE2.items()}
    return {"rows": rows, "paper": paper, "exact_optimum_usd_per_hour": _exact_cost(sc)}


def _exact_cost(sc: SimScenario) -> float:
    s = setup(sc, policy="exact")
    by = {w.worker_id: w for w in s.workers}
    return math.fsum(by[i].usd_per_hour for i in s.active_ids)
