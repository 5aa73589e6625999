"""The studies of ``benchmarks/adversary.py`` at real answer lengths (SPEC §10), with their targets, fixed
here before any of them ran:

- **length_honest** / **length_honest_bf16** (/ **length_honest_bf16_vllm**, the vLLM engine's, added
  later with the same target): honest HF-engine completions of a 54.5M model
  (``adversary_length_runs.honest_length``, ``--length`` tokens, 256 by default), every one re-run by the
  check in the engine's declared precision, the whole completion taken as graded (the strictest reading).
  Target: >= ``HONEST_COMPLETIONS`` completions of >= 256 tokens re-run, 0 false forgeries; reported beside
  it: near ties and graded ties, the room a near tie leaves per 1,024 tokens, and the per-position
  distributions of the log-prob error and of the draw deficit. A run of fewer completions (``--length-n``)
  is reported as such: the target is not met by a smaller sample. The sample is gathered run by run
  (added after the first two readings, before any shard ran; the target unchanged): each run is a *shard*
  with a stream of prompts and seeds of its own, kept in ``results/adversary_length_shards/``, and the
  reading pools every shard of a dtype (the first readings are shard 0); from shard 1 on a batch is 64
  completions, a lease of the math preset (8 prompts x 8), where the first readings' was 16.
- **length_attacks**: ``echo2 run`` with that model, one honest local worker, and the attackers of
  ``adversary_length.py`` (``adversary_length_runs.PLAN``: identities and submissions each). Targets:
  0 forged groups admitted trainable from the launderer, the answer rewriter and the phrase inserter; for
  the sleeper, the partial forger and the forger beside a flood, forged groups admitted trainable per
  attacker (all its identities) <= identities x ``floor_bound(check_floor)`` (16 forged submissions an
  identity at the default floor 0.25: more is a 1% event), and the median of the submissions from an
  identity's first lie to its quarantine, over those three attackers' identities, <= ``MEDIAN_CAUGHT``
  (the floor's own median is 3; one not caught counts as its budget + 1); 0 honest quarantines.
- **stale_flood**: ``adversary_runs.liveness_run`` (``echo2 run``, the embedded default, one honest worker
  at 300 rollouts/s, a 60 s window) with 3 stale hoarders, or a flood of 36 fresh identities doing
  honest one-prompt work beside a proven forger, interleaved with the baseline, 3 repeats. Targets: median
  step rate >= 0.8 x the baseline's; the honest worker's stale share (its groups dropped as stale, of the
  groups it answered in the window) at most 2 points above the baseline's (median of the repeats); 0
  prompts given up (``data/prompts_skipped``) in every run; the forger's forged groups admitted trainable
  <= ``floor_bound(check_floor)``.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

HONEST_COMPLETIONS = 10_000
MIN_LENGTH = 256
MEDIAN_CAUGHT = 6
STALE_FLOOD_RATE = 0.8
STALE_POINTS = 0.02
CONDITIONS = ("baseline", "stale_hoard", "flood")
SHARDS = "adversary_length_shards"  # one file a run of length_honest(_bf16): <dtype>_<shard>.json
SHARD_ROWS = 64  # completions a batch from shard 1 on: a lease of the math preset (8 prompts x 8)
SUMMED = ("completions", "tokens", "check_tokens", "false_forgeries", "graded_ties_whole_completion",
          "near_ties", "room_positions")  # fmt: skip
SHARD_SUMMARY = (
    "shard",
    "rows",
    "completions",
    "tokens",
    "false_forgeries",
    "seconds",
    "minutes_budget",
    "commit",
)


def study_length_honest(
    out: Path, dtype: str, completions: int, length: int, minutes: float, shard: int | None = None,
    rows: int = SHARD_ROWS, engine: str = "hf", pool_only: bool = False,
) -> dict[str, Any]:  # fmt: skip
    """One run (a shard) of honest completions, kept in ``out/SHARDS/<kind>_<shard>.json`` (``kind``: the
    dtype for the HF engine, ``vllm_<dtype>`` for vLLM's), then every shard of that kind at ``length``
    pooled into the study's reading: the sample grows run by run (each shard its own stream of prompts
    and seeds, so no completion is counted twice) until it reaches the target. ``shard`` (default: the
    next unused) must be new; the run asks for what the pool still lacks. ``pool_only``: run nothing, read
    the shards kept so far."""
    from echo2_bench.adversary_length_runs import honest_length

    kind = dtype if engine == "hf" else f"{engine}_{dtype}"
    study = {"float32": "length_honest", "bfloat16": "length_honest_bf16"}[dtype] + (
        "" if engine == "hf" else "_vllm"
    )
    if engine == "hf":
        adopt_first_reading(out, study, dtype)
    have = read_shards(out / SHARDS, kind, length)
    if shard is None:
        shard = 1 + max((int(s["shard"]) for s in have), default=0)
    elif (out / SHARDS / f"{kind}_{shard}.json").exists():
        raise SystemExit(
            f"--length-shard {shard}: the {kind} shard {shard} was run already (its draws would repeat)"
        )
    left = completions - sum(int(s["completions"]) for s in have)
    if left > 0 and not pool_only:
        commit, path = _commit(), out / SHARDS / f"{kind}_{shard}.json"
        path.parent.mkdir(parents=True, exist_ok=True)

        def keep(got: dict[str, Any]) -> None:  # after every batch: a run stopped midway keeps its batches
            got["commit"] = commit
            path.with_suffix(".part").write_text(json.dumps(got, indent=1))
            path.with_suffix(".part").replace(path)

        got = honest_length(
            out,
            dtype,
            left,
            length,
            rows=rows,
            minutes=minutes,
            engine_name=engine,
            shard=shard,
            on_batch=keep,
        )
        keep(got)
        have.append(got)
    pooled = pool_honest(have)
    pooled["target"] = (
        f">= {HONEST_COMPLETIONS} completions of >= {MIN_LENGTH} tokens re-run, 0 false forgeries"
    )
    pooled["sample_reached"] = pooled["completions"] >= HONEST_COMPLETIONS and length >= MIN_LENGTH
    pooled["met"] = pooled["sample_reached"] and pooled["false_forgeries"] == 0
    pooled["command"] = (
        f"python benchmarks/adversary.py --study {study} --length-minutes <budget> (one shard a run)"
    )
    return pooled


def read_shards(where: Path, kind: str, length: int) -> list[dict[str, Any]]:
    """The shards of ``kind`` (a dtype, or ``vllm_<dtype>``) run at ``length`` tokens, in shard order."""
    got = [json.loads(f.read_text()) for f in sorted(where.glob(f"{kind}_*.json"))] if where.is_dir() else []
    return sorted((g for g in got if g["length"] == length), key=lambda g: int(g["shard"]))


def adopt_first_reading(out: Path, study: str, dtype: str) -> None:
    """The readings taken before shards existed drew from shard 0's stream: the oldest of ``study``'s
    readings in ``adversary_length.json`` that is not itself a pool becomes shard 0, so it is counted once."""
    path, first = out / SHARDS / f"{dtype}_0.json", out / "adversary_length.json"
    if path.exists() or not first.is_file():
        return
    newest = json.loads(first.read_text()).get(study)
    chain = [newest, *newest.get("earlier_readings", [])] if newest else []
    alone = [r for r in chain if "shards" not in r and "histogram" in r.get("logprob_error", {})]
    if alone:
        oldest = {k: v for k, v in alone[-1].items() if k not in ("earlier_readings", "reading")}
        oldest.update(
            shard=0, rows=oldest.get("rows", 16), check_tokens=oldest.get("check_tokens", oldest["tokens"])
        )
        oldest["commit"] = oldest.get("commit", "before shards (its reading in adversary_length.json)")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(oldest, indent=1))


def pool_honest(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' samples as one: counts summed, per-position histograms merged, rates per 1,024 tokens
    of the pool; each shard listed with its size, rows a batch, time and commit."""
    from echo2.check.positions import LogHistogram
    from echo2_bench.adversary_length_runs import distribution, room_at_margins

    if not shards:
        raise SystemExit("no shard to pool: run the study with a time budget (--length-minutes)")
    first = shards[0]
    for s in shards:
        for key in ("dtype", "engine", "length", "logprob_tolerance", "draw_tolerance"):
            if s[key] != first[key]:
                raise SystemExit(
                    f"shard {s['shard']} has {key} = {s[key]!r}, shard {first['shard']} {first[key]!r}"
                )
    total = {k: sum(int(s[k]) for s in shards) for k in SUMMED}
    hists: dict[str, Any] = {}
    for key in ("logprob_error", "draw_deficit_where_not_the_draw", "top2_gap"):
        hists[key] = LogHistogram()
        for s in shards:
            hists[key].merge(LogHistogram.from_dict(s[key]["histogram"]))
    per = 1024 / max(1, total["check_tokens"])
    return {
        **{k: first[k] for k in ("dtype", "engine", "length", "logprob_tolerance", "draw_tolerance")},
        **total,
        "near_ties_per_1024_tokens": per * total["near_ties"],
        "room_per_1024_tokens": per * total["room_positions"],
        **{k: distribution(h) for k, h in hists.items()},
        "room_per_1024_at_margin": room_at_margins(hists["top2_gap"]),
        "seconds": sum(float(s["seconds"]) for s in shards),
        "shards": [{k: s.get(k) for k in SHARD_SUMMARY} for s in shards],
    }


def _commit() -> str:
    """The code a shard ran: the checkout's commit, marked when the working tree differs from it."""
    import subprocess

    def git(*args: str) -> str:
        got = subprocess.run(["git", *args], capture_output=True, text=True, cwd=Path(__file__).parent)
        return got.stdout.strip()

    changed = git("status", "--porcelain", "-uno", "--", ":/src", ":/benchmarks")
    return git("rev-parse", "HEAD") + ("+changes" if changed else "")


def study_length_attacks(
    out: Path, length: int, flood_width: int, minutes: float = 0.0, kinds: list[str] | None = None
) -> dict[str, Any]:
    """``kinds`` (default: all of ``PLAN``, in its order) runs some attackers alone: such a reading is
    partial whatever they do (the target needs all six)."""
    from echo2_bench.adversary_length_runs import PLAN, attacks_run

    unknown = sorted(set(kinds or ()) - set(PLAN))
    if unknown:
        raise SystemExit(f"--length-kinds: unknown attacker(s) {unknown}; known: {list(PLAN)}")
    plan = {k: v for k, v in PLAN.items() if not kinds or k in kinds}
    commit = _commit()  # the code that runs: stamped before it starts (the checkout may move meanwhile)
    got = attacks_run(out, length, plan, flood_width, minutes=minutes)
    got["commit"] = commit
    got["kinds_asked"] = list(plan)
    got["minutes_budget"] = minutes
    got["kinds_read"] = [k for k, v in got["kinds"].items() if not v["cut_short"]]
    got["partial"] = got["kinds_read"] != list(PLAN)
    median = got["patient_median_caught_after_lies"]
    got["plan"] = {k: {"identities": v[0], "budget": v[1]} for k, v in PLAN.items()}
    got["length"] = length
    got["flood_width"] = flood_width
    got["target"] = (
        "0 forged groups admitted trainable from launder, rewrite, insert; sleeper, partial, forger "
        "(beside a flood): <= identities x floor_bound(check_floor) each, median submissions from the "
        f"first lie to the quarantine <= {MEDIAN_CAUGHT}; 0 honest quarantines"
    )
    got["met"] = (
        not got["partial"]
        and all(k["met"] for k in got["kinds"].values())
        and median is not None
        and median <= MEDIAN_CAUGHT
        and got["honest_quarantined"] == 0
    )
    return got


def study_stale_flood(out: Path, repeats: int, window_s: float, warm_s: float, rate: float) -> dict[str, Any]:
    from echo2.config import SecurityConfig
    from echo2_bench import adversary_runs as ar
    from echo2_bench.adversary_length_runs import floor_bound
    from echo2_bench.stale_flood import flood, honest_stale_share, stale_hoard

    attacks = {"baseline": None, "stale_hoard": stale_hoard(3), "flood": flood(36)}
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in CONDITIONS}
    for i in range(repeats):  # interleaved: every condition once per repeat
        for cond in CONDITIONS:
            run_dir = out / "adversary_runs" / f"stale_flood_{cond}_{i}"
            got = ar.liveness_run(run_dir, attacks[cond], warm_s, window_s, rate)
            got["honest"] = honest_stale_share(run_dir, "local-0", *got["window_wall"])
            rows = [r for r in ar.records(run_dir) if "data/prompts_skipped" in r]
            got["prompts_skipped"] = int(rows[-1]["data/prompts_skipped"]) if rows else 0
            runs[cond].append(got)
            stale, skipped = got["honest"]["stale_share"], got["prompts_skipped"]
            print(
                f"stale_flood {cond} #{i}: {got['step_rate']:.3f} steps/s, stale {stale:.3f}, "
                f"skipped {skipped}"
            )
    bound = floor_bound(SecurityConfig().floor())
    result: dict[str, Any] = {"runs": runs, "window_s": window_s, "repeats": repeats, "forger_bound": bound}
    base = runs["baseline"]
    for cond in CONDITIONS[1:]:
        ratios = [a["step_rate"] / b["step_rate"] for a, b in zip(runs[cond], base, strict=True)]
        points = [
            a["honest"]["stale_share"] - b["honest"]["stale_share"]
            for a, b in zip(runs[cond], base, strict=True)
        ]
        skipped = sum(r["prompts_skipped"] for r in runs[cond])
        entry: dict[str, Any] = {
            "ratios": ratios, "median_ratio": statistics.median(ratios), "stale_points": points,
            "median_stale_points": statistics.median(points), "prompts_skipped": skipped,
        }  # fmt: skip
        entry["met"] = (
            entry["median_ratio"] >= STALE_FLOOD_RATE
            and entry["median_stale_points"] <= STALE_POINTS
            and skipped == 0
        )
        if cond == "flood":
            forged = [len(r["attack"]["forger_admitted_forged"]) for r in runs[cond]]
            entry["forger_admitted_forged"] = forged
            entry["met"] = entry["met"] and max(forged) <= bound
        result[cond] = entry
    result["baseline_skipped"] = sum(r["prompts_skipped"] for r in base)
    result["met"] = all(result[c]["met"] for c in CONDITIONS[1:]) and result["baseline_skipped"] == 0
    result["target"] = (
        f"median step rate >= {STALE_FLOOD_RATE} x the baseline's, the honest stale share at most "
        f"{STALE_POINTS:.0%} points above the baseline's, 0 prompts given up; the flood's forger <= {bound} "
        "forged groups admitted trainable"
    )
    return result


def record(out: Path, study: str, got: dict[str, Any], reading: str) -> None:
    """Keep ``got`` as ``study``'s newest reading in ``out/adversary_length.json`` (earlier ones kept)."""
    from echo2_bench.record import on_record

    path = out / "adversary_length.json"
    res: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    res[study] = on_record(res.get(study), got, reading)
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=1, default=str))
