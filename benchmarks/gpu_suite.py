"""The GPU suite: everything echo2 claims of a GPU that one borrowed H200 can show, in at most 7 minutes.

    bash scripts/prepare-gpu-carry                      # here: the wheels the H200 lacks, into .gpu-carry/
    python benchmarks/gpu_suite.py --wheels .gpu-carry  # there (docs/learner.md: the exact command)
    python benchmarks/gpu_suite.py --smoke --out /tmp/gpu_suite.json   # every section, tiny, on the CPU (CI)

The machine: one H200 (141 GB), torch 2.11 + CUDA 13.0, transformers 5.17, Python 3.12, no network, no
pydantic and no vLLM, at most 64 MiB carried with a run. So ``--wheels DIR`` unpacks the wheels
``scripts/prepare-gpu-carry`` fetched (the versions of the lock, for Python 3.12 on manylinux x86-64)
into a temporary folder put first on the path of every section's process. No weights are downloaded:
every model is a random-init Qwen3 of a released shape (token ids in, token ids out).

Sections, each in its group's process, each with a hard time budget (``BUDGET_S``: a section past it
stops and reports what it read so far; a section that fails is recorded and the next one runs; a
section whose input another did not make is skipped, saying so). The parent stops the whole suite at
``TOTAL_S`` (7 minutes) whatever happens:

- **preflight**: versions; the device; the bf16 matmul peak measured on it; the seeded sampling noise
  of a 256-row step at the learner's vocabulary on the device (blocked and as the formula computed
  whole) and its agreement with the CPU's.
- **learner**: the learner (``GRPOTrainer``, bf16-mixed: fp32 masters, grads and AdamW, bf16 autocast)
  at the Qwen3-1.7B shape, R = 256 rows of 64-token prompts and 512-token completions, at 16,384- and
  8,192-token micro-batches: step time (median of 2 after a warm-up), tokens/s, MFU = 6 x params x
  tokens / (step s x peak) against the measured peak and the datasheet's (989 TFLOP/s dense bf16),
  peak allocated and reserved memory against the memory model (``planner/memory_model.py``).
- **publication**: the learner's bf16 copy (device to host), its digest, one update, the lossless patch
  between the two (encode), the worker's side (apply, digest, install into an HF engine on the GPU),
  and that engine's logits equal to a model freshly loaded from the full snapshot's bytes.
- **engine**: that HF engine generating 16 prompts x 4 completions x 1,024 tokens (bf16): tokens/s.
- **bf16_errors**: those 64 honest completions re-run by the generation check in bf16 at its bf16
  tolerances: the largest and the p99.9 per-token log-prob error, draw misses per completion.
- **check**: the check of 4 x 1,024-token completions at 1.7B: seconds alone, its device memory, the
  host-to-device copy of a version switch, seconds while an update runs (the default ``check_duty``
  and duty 1) beside the update's seconds alone and with it.
- **four_b**: two updates at the Qwen3-4B shape with activation checkpointing (32 rows, 8,192-token
  micro-batches) with the check's bf16 model on the device: the peak against 80 GiB (the README's
  claim) and the memory model.
- **sharded**: the sharded learner at world size 1 on NCCL (the code path, not a speed-up): loaded on
  the meta device with rank 0 reading, its publication's digest against a one-process model's, two
  updates beside the one-process learner's, a DCP checkpoint written and read back.

Targets (fixed here before any run on the H200): MFU >= 35% of the datasheet at the 1.7B shape at the
16,384-token micro-batch; peak allocated memory within 15% of the model at both micro-batch sizes;
every honest bf16 completion passes the check; the patched install and a fresh load give equal
logits; the sharded publication equals the one-process one. The rest are readings. Writes
``results/gpu_suite.json`` and ``results/gpu_suite.png`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

GROUPS = {  # one process each, in this order; a group's sections share its models
    "main": ("preflight", "learner", "publication", "engine", "bf16_errors", "check"),
    "four_b": ("four_b",),
    "sharded": ("sharded",),
}
BUDGET_S = {"preflight": 15, "learner": 75, "publication": 60, "engine": 45, "bf16_errors": 35, "check": 45,
            "four_b": 50, "sharded": 35}  # fmt: skip
STARTUP_S = 15  # a group's process: imports, the CUDA context
TOTAL_S = 420  # the whole suite, 7 minutes
SMOKE_BUDGET_S, SMOKE_TOTAL_S = 60, 300
NEEDS = {  # what a section reads of the group's state (made by the ones before it)
    "publication": ("model", "trainer"),
    "engine": ("engine",),
    "bf16_errors": ("generated", "w_pub"),
    "check": ("generated", "w_pub", "trainer"),
}
MIN_MFU, MEMORY_WITHIN = 0.35, 0.15


class SectionTimeout(Exception):
    """A section ran past its budget."""


# ---- the carried wheels -----------------------------------------------------------------------------
def use_wheels(folder: Path) -> dict[str, Any]:
    """Every wheel in ``folder`` unpacked into one temporary folder, put first on this process's path and
    on its children's (``PYTHONPATH``): pure-Python wheels and compiled ones alike (an extension module
    cannot be imported from a zip). What the machine has of the same packages is shadowed, and said."""
    import importlib.metadata as md

    wheels = sorted(folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no wheels there (run scripts/prepare-gpu-carry first)")
    into = Path(tempfile.mkdtemp(prefix="echo2-carry-"))
    shadowed = {}
    for whl in wheels:
        with zipfile.ZipFile(whl) as z:
            z.extractall(into)
        name = whl.name.split("-")[0]
        with contextlib.suppress(md.PackageNotFoundError):
            shadowed[name] = md.version(name)
    sys.path.insert(0, str(into))
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(into), os.environ.get("PYTHONPATH")) if p)
    return {"folder": str(folder), "unpacked_to": str(into), "wheels": [w.name for w in wheels],
            "shadowed_installed": shadowed}  # fmt: skip


# ---- a group's process ----------------------------------------------------------------------------------
def run_group(group: str, smoke: bool, log: Path) -> None:
    """The sections of ``group`` one after another, each under its alarm; one JSON line per section to
    ``log`` as it starts and as it ends (what a killed process still leaves)."""
    import torch  # imported (and the CUDA context made) before any alarm: an import cut short breaks it
    import transformers  # noqa: F401

    from echo2_bench.gpu_sections import H200, SECTIONS, SMOKE, Ctx

    ctx = Ctx(SMOKE if smoke else H200)
    if ctx.cuda:
        torch.cuda.init()

    def alarm(signum: int, frame: Any) -> None:
        raise SectionTimeout

    signal.signal(signal.SIGALRM, alarm)
    with log.open("a") as f:
        for name in GROUPS[group]:
            missing = [k for k in NEEDS.get(name, ()) if k not in ctx.state]
            if missing:
                _line(
                    f,
                    {"name": name, "status": "skipped", "reason": f"needs {missing} from an earlier section"},
                )
                continue
            _line(f, {"name": name, "event": "start"})
            budget = SMOKE_BUDGET_S if smoke else BUDGET_S[name]
            ctx.partial = {}
            t0 = time.perf_counter()
            signal.alarm(budget)
            try:
                result, status, error = SECTIONS[name](ctx), "ok", None
            except SectionTimeout:
                result, status, error = ctx.partial, "timeout", f"past its budget of {budget} s"
            except Exception as exc:  # one section's failure is its reading; the next one runs
                result, status = ctx.partial, "error"
                error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}"
            finally:
                signal.alarm(0)
            _line(f, {"name": name, "status": status, "seconds": time.perf_counter() - t0, "budget_s": budget,
                      "error": error, "result": result})  # fmt: skip
            _release(ctx)
    trace = os.environ.get("ECHO2_GPU_SUITE_MODULES")
    if trace:  # the modules this process imported (scripts/prepare-gpu-carry's test reads them)
        with open(trace, "a") as t:
            t.write("\n".join(sorted({m.split(".")[0] for m in sys.modules})) + "\n")


def _line(f: Any, record: dict[str, Any]) -> None:
    f.write(json.dumps(record, default=_plain) + "\n")
    f.flush()


def _plain(x: Any) -> Any:
    """What JSON cannot hold as it is: numbers and tensors as floats, the rest as text."""
    try:
        return float(x)
    except (TypeError, ValueError):
        return str(x)


def _release(ctx: Any) -> None:
    import gc

    import torch

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()


# ---- the parent --------------------------------------------------------------------------------------
def run_suite(smoke: bool, out: Path) -> dict[str, Any]:
    start = time.perf_counter()
    total = SMOKE_TOTAL_S if smoke else TOTAL_S
    sections: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for group, names in GROUPS.items():
            left = total - (time.perf_counter() - start)
            want = STARTUP_S + sum(SMOKE_BUDGET_S if smoke else BUDGET_S[n] for n in names)
            if left < STARTUP_S + 5:
                for n in names:
                    sections[n] = {"status": "skipped", "reason": f"the suite's {total} s were spent"}
                continue
            log = Path(tmp) / f"{group}.jsonl"
            cmd = [
                sys.executable,
                __file__,
                "--group",
                group,
                "--log",
                str(log),
                *(["--smoke"] if smoke else []),
            ]
            sections.update(_child(cmd, log, names, min(want, left)))
    result = {
        "suite": "gpu_suite",
        "smoke": smoke,
        "wall_s": time.perf_counter() - start,
        "total_budget_s": total,
        "sections": sections,
        "command": "python benchmarks/gpu_suite.py --wheels .gpu-carry",
    }
    result["met"] = None if smoke else verdicts(sections)
    return result


def _child(cmd: list[str], log: Path, names: tuple[str, ...], timeout: float) -> dict[str, Any]:
    """Run one group's process under ``timeout``; every section's record (a section it never finished:
    ``killed`` with the process's last words, or ``not run``)."""
    tail = ""
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        tail = (res.stderr or "")[-3000:] if res.returncode else ""
    except subprocess.TimeoutExpired as exc:  # the group's whole budget spent: the process is killed
        tail = f"the group's process was killed after {timeout:.0f} s\n" + _text(exc.stderr)[-2000:]
    got: dict[str, Any] = {}
    running = None
    if log.is_file():
        for line in log.read_text().splitlines():
            rec = json.loads(line)
            if rec.get("event") == "start":
                running = rec["name"]
            else:
                got[rec.pop("name")] = rec
                running = None
    if running is not None:
        got[running] = {"status": "killed", "error": tail}
    for n in names:
        got.setdefault(n, {"status": "not run", "error": tail})
    return got


def _text(b: Any) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def verdicts(sections: dict[str, Any]) -> dict[str, Any]:
    """The declared targets, each met, not met, or None when its section gave no reading."""

    def res(name: str) -> dict[str, Any]:
        s = sections.get(name, {})
        return s.get("result") or {} if s.get("status") == "ok" else {}

    runs = res("learner").get("runs") or []
    first = next((r for r in runs if r["micro_batch_tokens"] == 16384), None)
    within = [abs(r["allocated_vs_model"]) <= MEMORY_WITHIN for r in runs if "allocated_vs_model" in r]
    errors, pub, sh = res("bf16_errors"), res("publication"), res("sharded")
    return {
        "mfu_datasheet_ge_35pct": None if first is None else first["mfu_datasheet"] >= MIN_MFU,
        "memory_within_15pct": all(within) if len(within) == len(runs) and runs else None,
        "honest_bf16_pass": None if not errors else errors.get("failing_completions") == 0,
        "patched_install_equals_fresh": pub.get("logits_equal_fresh"),
        "sharded_publication_equal": sh.get("publication_equal_at_load"),
        "claim_4b_80_gib": res("four_b").get("claim_80_gib"),
    }


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = {k: (v.get("result") or {}) for k, v in result["sections"].items()}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.3))
    ax = axes[0]
    runs = s.get("learner", {}).get("runs") or []
    for i, r in enumerate(runs):
        for j, (key, label) in enumerate(
            (("mfu_datasheet", "MFU (datasheet)"), ("mfu_measured_peak", "MFU (measured peak)"))
        ):
            if r.get(key) is not None:
                ax.bar(i + 0.4 * j, 100 * r[key], 0.4, color=f"C{j}", label=label if i == 0 else None)
    ax.axhline(100 * MIN_MFU, color="k", ls=":", lw=1)
    ax.set_xticks(
        [i + 0.2 for i in range(len(runs))],
        [f"{r['micro_batch_tokens']:,}-token\nmicro-batches" for r in runs],
    )
    ax.set_ylabel("%")
    tokens = s.get("learner", {}).get("tokens_per_update", 0)
    ax.set_title(f"learner, Qwen3-1.7B shape, bf16-mixed, {tokens:,} tokens an update", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[1]
    bars = [(f"1.7B\n{r['micro_batch_tokens']:,}", r) for r in runs]
    if s.get("four_b"):
        bars.append(("4B, activation\ncheckpointing", s["four_b"]))
    for i, (_, r) in enumerate(bars):
        for j, key in enumerate(("model_gib", "peak_allocated_gib", "peak_reserved_gib")):
            if r.get(key) is not None:
                ax.bar(i + 0.27 * j, r[key], 0.27, color=f"C{j}", label=key if i == 0 else None)
    ax.axhline(80, color="k", ls=":", lw=1)
    ax.set_xticks([i + 0.27 for i in range(len(bars))], [b[0] for b in bars])
    ax.set_ylabel("GiB")
    ax.set_title("device memory: the model vs the peak", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    errs = s.get("bf16_errors", {})
    per = [c["max_logprob_error"] for c in errs.get("completions") or []]
    if per:
        ax.hist(per, bins=20)
        ax.axvline(errs["logprob_tolerance"], color="k", ls=":", lw=1)
    ax.set_xlabel("largest log-prob error of a completion")
    ax.set_title(f"honest bf16 completions re-run by the check (p99.9 token error "
                 f"{errs.get('p999_error', float('nan')):.3g})", fontsize=9)  # fmt: skip
    fig.suptitle(
        f"{s.get('preflight', {}).get('device', '?')}{' (smoke)' if result['smoke'] else ''}", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="every section at tiny shapes on the CPU (CI)")
    p.add_argument("--wheels", type=Path, help="a folder of wheels from scripts/prepare-gpu-carry to use")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_suite.json")
    p.add_argument("--group", choices=tuple(GROUPS), help=argparse.SUPPRESS)
    p.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.group:
        run_group(a.group, a.smoke, a.log)
        return 0
    carried = use_wheels(a.wheels) if a.wheels else None
    if not a.smoke:
        import torch

        if not torch.cuda.is_available():
            print("gpu_suite.py: no CUDA device here; --smoke runs every section on the CPU", file=sys.stderr)
            return 2
    try:
        result = run_suite(a.smoke, a.out)
        result["carried"] = carried
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=_plain))
        try:
            plot(result, a.out.with_suffix(".png"))
        except Exception as exc:  # the readings are in the JSON already; say why there is no figure
            print(f"gpu_suite.py: no figure: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        if carried:
            shutil.rmtree(carried["unpacked_to"], ignore_errors=True)
    for name, sec in result["sections"].items():
        print(
            f"{name:12s} {sec['status']:8s} {sec.get('seconds', 0):6.1f} s  {(sec.get('error') or '')[:120]}"
        )
    print(json.dumps({"met": result["met"], "wall_s": round(result["wall_s"], 1)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
