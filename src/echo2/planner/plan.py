"""Compose a capacity plan from a scenario (pure): what `echo2 plan` prints.

Steps (SPEC sections 2, 3, 5):
1. ``kappa`` from the config, else ``max(1, S - 1)`` (:func:`echo2.physics.rules.kappa_from_staleness`).
2. ``T_bcast``: the measured override if given, else the chosen strategy's homogeneous estimate for
   the active-set size (:func:`echo2.physics.broadcast.estimates`, the simulator's model with all
   links equal); since T_bcast(N) and N depend on each other, iterate N -> T_bcast(N) -> mu_min
   -> active set -> N until N repeats (Star-Limited can diverge: then the plan is infeasible).
3. ``mu_min``, ``mu_target = gamma * mu_min``; the active set by the scenario's activation policy.
4. Step time from the cycle model ``max(kappa*T_train, T_bcast + kappa*R/mu_pool) / kappa``,
   cost per step ``(learner $/h + sum worker $/h) * step_s / 3600`` and savings against baselines.
"""

from __future__ import annotations

import math
from typing import Any

from echo2.errors import InfeasibleError
from echo2.physics import broadcast
from echo2.physics.rules import bubble_ratio
from echo2.planner import capacity
from echo2.planner.activation import Activation, Candidate, activate, expand_catalog
from echo2.planner.memory_model import QWEN3_SHAPES, fits
from echo2.planner.scenario import PlanScenario

# the strategies the plan reports estimates for: the three of SPEC section 4 plus the scenario's own
_REPORTED: tuple[broadcast.StrategyName, ...] = ("star-unlimited", "star-limited", "tree-pipelined")


def t_bcast_estimates(sc: PlanScenario, n: int) -> dict[str, float] | None:
    """Estimated T_bcast (s, reload included) per strategy for ``n`` workers, plus ``lower_bound``
    (``T*`` + reload), for the mean bytes per publication (G, or anchors and patches with
    ``[model] patch_ratio``); None without a snapshot size.

    The worker link is the slowest link in the catalog (a chain runs at its slowest member).
    """
    if sc.model is None:
        return None
    net = sc.network
    shown = tuple(dict.fromkeys((*_REPORTED, net.strategy)))
    return broadcast.estimates(
        sc.model.publication_bytes,
        net.b0_bytes_per_s,
        min(w.link_bytes_per_s for w in sc.workers),
        max(1, n),
        chunk_bytes=net.chunk_bytes,
        hop_latency_s=net.hop_latency_s,
        reload_s=net.reload_s,
        strategies=shown,
    )


def _choose(sc: PlanScenario, kappa: int, t_bcast: float) -> tuple[float, Activation]:
    mu_min = (
        capacity.mu_min(kappa=kappa, t_train=sc.learner.t_train, t_bcast=t_bcast, rollouts=sc.batch.rollouts)
        / sc.useful_share
    )  # linear in R: the pool generates R / useful_share for R useful ones
    target = capacity.mu_target(mu_min, sc.staleness.gamma)
    return mu_min, activate(sc.activation, _candidates(sc, target), target)


def _candidates(sc: PlanScenario, target: float) -> list[Candidate]:
    """The catalog as candidates. Workers of one type are interchangeable, and no policy but ``random``
    ever takes more than ``ceil(target/mu) + 1`` of a type (one fewer still reaches the target, and the
    prune step releases it), so for those policies each type is cut to that many: a 200,000-worker
    catalog plans as fast as a 1,000-worker one, with the same counts by type."""
    rows = []
    for w in sc.workers:
        n = w.count
        if sc.activation != "random":
            n = min(n, math.ceil(target / w.rollouts_per_s) + 1)
        rows.append((w.name, w.usd_per_hour, w.rollouts_per_s, n))
    return expand_catalog(rows)


def make_plan(sc: PlanScenario) -> dict[str, Any]:
    """The full plan as a JSON-ready dict (keys documented in docs/planner.md)."""
    kappa = sc.staleness.effective_kappa
    t_train = sc.learner.t_train  # on the learner's gpus (a stated scaling from where it was measured)
    r = sc.batch.rollouts
    lora = sc.model is not None and sc.model.lora is not None
    if sc.network.t_bcast_s is not None and not lora:  # a measured one is of whole weights
        t_bcast, source = sc.network.t_bcast_s, "config (network.t_bcast_s)"
        mu_min, act = _choose(sc, kappa, t_bcast)
    else:
        source = f"model ({sc.network.strategy})" + (
            ", the adapter's bytes (network.t_bcast_s measures whole weights)"
            if lora and sc.network.t_bcast_s is not None
            else ""
        )
        n, seen = 1, set()
        while True:
            est = t_bcast_estimates(sc, n)
            assert est is not None
            t_bcast = est[sc.network.strategy]
            try:
                mu_min, act = _choose(sc, kappa, t_bcast)
            except InfeasibleError as exc:
                if n == 1:
                    raise
                raise InfeasibleError(
                    f"no self-consistent plan with the {sc.network.strategy} broadcast: at N = {n} workers "
                    f"T_bcast = {t_bcast:.0f} s, and the pool that would hide it needs more workers, whose "
                    f"broadcast takes longer still ({exc}); use tree-pipelined, raise kappa / S, "
                    "or give a measured --t-bcast"
                ) from None
            n_new = len(act.selected)
            if n_new == n or n_new in seen:
                break
            seen.add(n)
            n = n_new
            if len(seen) > 50:  # pragma: no cover - defensive
                raise InfeasibleError("T_bcast(N) and N did not settle; give network.t_bcast_s")
    mu_target = capacity.mu_target(mu_min, sc.staleness.gamma)
    n_active = len(act.selected)
    mu_pool = act.mu_pool
    mu_useful = mu_pool * sc.useful_share  # what of the pool's rate a batch can use
    cycle = max(kappa * t_train, t_bcast + kappa * r / mu_useful)
    step_s = cycle / kappa
    conservative = capacity.staleness_bound_conservative(
        kappa=kappa, t_train=t_train, t_bcast=t_bcast, rollouts=r, mu_pool=mu_useful
    )
    tight = capacity.staleness_bound_tight(kappa=kappa, t_train=t_train, t_bcast=t_bcast)
    per_type = {
        w.name: {
            "usd_per_hour": w.usd_per_hour,
            "rollouts_per_s": w.rollouts_per_s,
            "rho": w.usd_per_hour / w.rollouts_per_s,
            "n_min": capacity.n_min(mu_min, w.rollouts_per_s),
            "n_target": capacity.n_min(mu_target, w.rollouts_per_s),
        }
        for w in sc.workers
    }
    plan: dict[str, Any] = {
        "model": sc.model.name if sc.model else None,
        "snapshot_gb": sc.model.snapshot_gb if sc.model else None,
        "publication_gb": sc.model.publication_bytes / 1e9 if sc.model else None,
        "patch_ratio": sc.model.patch_ratio if sc.model else None,
        "rollouts_per_step": r,
        "t_train_s": t_train,
        "learner_gpus": sc.learner.gpus,
        "t_train_source": (
            f"stated scaling from {sc.learner.t_train_s:g} s on {sc.learner.t_train_gpus} GPUs "
            f"(efficiency {sc.learner.scaling_efficiency:g})"
            if sc.learner.t_train_gpus not in (None, sc.learner.gpus)
            else f"learner.t_train_s on {sc.learner.gpus} GPUs"
        ),
        "staleness": sc.staleness.S,
        "kappa": kappa,
        "gamma": sc.staleness.gamma,
        "t_bcast_s": t_bcast,
        "t_bcast_source": source,
        "t_bcast_estimates_s": t_bcast_estimates(sc, n_active),
        "feasible": True,
        "overlap_holds": capacity.overlap_holds(
            kappa=kappa, t_train=t_train, t_bcast=t_bcast, rollouts=r, mu_pool=mu_useful
        ),
        "useful_share": sc.useful_share,
        "mu_min": mu_min,
        "mu_target": mu_target,
        "per_type": per_type,
        "activation": sc.activation,
        "active_set": act.counts_by_type(),
        "active_workers": n_active,
        "mu_pool": mu_pool,
        "workers_usd_per_hour": act.usd_per_hour if sc.priced else None,
        "step_s": step_s,
        "bubble_ratio_expected": bubble_ratio(kappa * t_train, cycle),
        "staleness_bound": min(sc.staleness.S, conservative),
        "staleness_bound_conservative": conservative,
        "staleness_bound_tight": tight,
    }
    # N_min of the homogeneous pool; for a catalog, that of its cheapest-rho type (a reference)
    plan["n_min"] = min(per_type.values(), key=lambda v: v["rho"])["n_min"]
    if sc.learner.usd_per_hour is not None and sc.priced:
        usd_h = sc.learner.usd_per_hour + act.usd_per_hour
        cost = capacity.cost_per_step(usd_per_hour=usd_h, step_seconds=step_s)
        plan["usd_per_hour"] = usd_h
        plan["usd_per_step"] = cost
        plan["baselines"] = {
            b.name: {
                "usd_per_step": capacity.cost_per_step(usd_per_hour=b.usd_per_hour, step_seconds=b.step_s),
                "saving": capacity.saving(
                    cost, capacity.cost_per_step(usd_per_hour=b.usd_per_hour, step_seconds=b.step_s)
                ),
            }
            for b in sc.baselines
        }
    else:
        plan["usd_per_hour"] = plan["usd_per_step"] = None
        plan["baselines"] = {}
    plan["learner_memory"] = learner_memory_plan(sc)
    if not math.isfinite(step_s):  # pragma: no cover - defensive
        raise InfeasibleError("step time is not finite")
    if sc.model is not None and sc.model.lora is not None:  # the pool a run of whole weights would need
        plan["lora_rank"] = sc.model.lora.rank
        plan["adapter_gb"] = sc.model.anchor_bytes / 1e9
        whole = sc.model_copy(update={"model": sc.model.model_copy(update={"lora": None})})
        try:
            w = make_plan(whole)
            plan["whole_weights"] = {k: w[k] for k in WHOLE_KEYS}
        except InfeasibleError as exc:
            plan["whole_weights"] = {"feasible": False, "reason": str(exc)}
    return plan


# what a LoRA plan reports of the same scenario publishing whole weights (``echo2 plan --lora-rank``)
WHOLE_KEYS = ("publication_gb", "t_bcast_s", "mu_min", "active_set", "active_workers", "mu_pool",
              "workers_usd_per_hour", "step_s", "usd_per_step", "feasible", "learner_memory")  # fmt: skip


def learner_memory_plan(sc: PlanScenario) -> dict[str, Any] | None:
    """The learner's memory need for the scenario's model shape (``planner/memory_model.py``): bytes per
    parameter on the device, GiB for weights + gradients + optimizer (+ check model) and for one
    micro-batch's activations, and whether one of the learner's GPUs holds it: as one device, and with
    ``gpus`` > 1 on the largest rank of a learner sharded over them (``learner/sharded.py``)."""

    if sc.model is None or sc.model.shape is None:
        return None
    shape, lr = QWEN3_SHAPES[sc.model.shape], sc.learner
    rank = sc.model.lora.rank if sc.model.lora is not None else None
    kw: dict[str, Any] = {
        "staleness": sc.staleness.S,
        "kappa": sc.staleness.effective_kappa,
        "lora_rank": rank,
    }
    one = fits(shape, lr.gpu_gib or 0.0, lr.precision, micro_batch_tokens=lr.micro_batch_tokens, **kw)
    out: dict[str, Any] = {"shape": sc.model.shape, "params": shape.params, "lora_rank": rank, "one_gpu": one}
    if lr.gpus > 1 and rank is not None:
        out["ranks"] = lr.gpus
        out["sharded"] = "LoRA on the sharded learner is not built: the LoRA learner runs on one GPU"
    elif lr.gpus > 1:
        out["ranks"] = lr.gpus
        out["per_gpu_sharded"] = fits(
            shape,
            lr.gpu_gib or 0.0,
            lr.precision,
            micro_batch_tokens=lr.micro_batch_tokens,
            world_size=lr.gpus,
            **kw,
        )
    if lr.gpu_gib is None:
        for v in out.values():
            if isinstance(v, dict):
                v["fits"] = None
    return out


def infeasible_plan(sc: PlanScenario, exc: InfeasibleError) -> dict[str, Any]:
    """What `--json` prints when no plan exists: the capacity numbers that are defined, and why."""
    kappa = sc.staleness.effective_kappa
    return {
        "kappa": kappa,
        "staleness": sc.staleness.S,
        "mu_min": None,
        "n_min": None,
        "staleness_bound": None,
        "feasible": False,
        "reason": str(exc),
    }
