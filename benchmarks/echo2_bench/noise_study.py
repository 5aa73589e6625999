"""The seeded sampling noise's cost (``rollout/sampling.gumbel_noise``): the formula computed whole (the code
before, kept here as ``plain``) against the blocked, in-place computation, side by side in one process.

Every worker step draws ``[rows, V]`` noise values and the learner's generation check recomputes
``[tokens, V]`` of them for every completion it re-runs, so at a real vocabulary the hash is a share of
both. Targets, fixed before the first run:

1. **noise alone** (``noise``): one generation step of 64 rows and one check of a 1,024-token completion
   (every step of one row), at V = 32,768 (the benchmarks' 55M shape) and 151,936 (Qwen3): the blocked
   computation equal to the plain formula bit for bit, and at 151,936 <= 0.5x its time (median of
   interleaved repeats).
2. **what it buys** (readings, no target): the generation check of ``SAMPLES`` completions of 512 tokens
   (this benchmark's ``step`` study's check) and the HF engine sampling 16 rows of 256 tokens, on the
   55M shape, with the plain noise swapped in for the "before" side; interleaved pairs, ratio after /
   before."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

NOISE_VOCABS, QWEN3_VOCAB, MAX_NOISE_RATIO = (32_768, 151_936), 151_936, 0.5
NOISE_REPEATS, GEN_ROWS, GEN_TOKENS = 7, 16, 256


def plain(seed: int, rows: Any, step: Any, vocab: int) -> Any:
    """The noise as ``sampling``'s docstring states it, the whole ``[rows, vocab]`` at once (the code
    before the blocked computation, operation for operation)."""
    import torch

    from echo2.rollout import sampling as s

    tokens_V = (torch.arange(vocab, dtype=torch.int64, device=rows.device) * s._STRIDE) & s._MASK
    bits = s._mix(s._key(seed, rows, step)[:, None] ^ tokens_V[None, :]) >> (32 - s._BITS)
    return -torch.log(-torch.log((bits.to(torch.float32) + 0.5) * s._U_SCALE))


@contextmanager
def noise_of(fn: Callable[..., Any]) -> Iterator[None]:
    """Every caller of ``sampling.gumbel_noise`` (the engine's draw, the check) computes with ``fn``."""
    from echo2.rollout import sampling

    kept = sampling.gumbel_noise
    sampling.gumbel_noise = fn
    try:
        yield
    finally:
        sampling.gumbel_noise = kept


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def noise_alone(repeats: int = NOISE_REPEATS, vocabs: tuple[int, ...] = NOISE_VOCABS) -> dict[str, Any]:
    import torch

    from echo2.rollout.sampling import gumbel_noise

    torch.set_num_threads(2)
    cases = {
        "step_64_rows": (torch.arange(64), 3),
        "check_1024_tokens": (torch.zeros(1024, dtype=torch.long), torch.arange(1024)),
    }
    rows_out = []
    for vocab in vocabs:
        for case, (rows, step) in cases.items():
            same = torch.equal(gumbel_noise(5, rows, step, vocab), plain(5, rows, step, vocab))
            before, after = [], []
            for _ in range(repeats):  # interleaved: the machine's speed moves during the study
                before.append(_timed(lambda: plain(5, rows, step, vocab)))  # noqa: B023
                after.append(_timed(lambda: gumbel_noise(5, rows, step, vocab)))  # noqa: B023
            b, a = statistics.median(before), statistics.median(after)
            rows_out.append(
                {"vocab": vocab, "case": case, "bit_identical": same, "before_s": b, "after_s": a,
                 "ratio": a / b, "before_runs_s": before, "after_runs_s": after}
            )  # fmt: skip
    at_qwen3 = [r for r in rows_out if r["vocab"] == QWEN3_VOCAB]
    met = all(r["bit_identical"] for r in rows_out) and all(r["ratio"] <= MAX_NOISE_RATIO for r in at_qwen3)
    return {
        "target": f"bit for bit the plain formula; at V = {QWEN3_VOCAB:,} <= {MAX_NOISE_RATIO}x its time",
        "rows": rows_out,
        "met": met,
        "source": "runtime code (rollout/sampling.py) on this machine, 2 threads",
    }


def what_it_buys(setup: Callable[..., Any], check_once: Callable[..., float], shape: dict[str, int],
                 completion: int, pairs: int) -> dict[str, Any]:  # fmt: skip
    """The check of a submission of ``completion``-token answers (``setup`` / ``check_once``:
    check_scale's) and a sampled generation on ``shape``, plain noise (before) and blocked (after),
    ``pairs`` interleaved pairs each."""
    import torch

    from echo2.config import SamplingConfig
    from echo2.rollout.engines.hf import HFEngine
    from echo2.rollout.sampling import gumbel_noise

    model, check, lease, sub = setup(shape, completion)
    engine = HFEngine(model, (0,), 0, SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=GEN_TOKENS))
    prompts = [[1 + (7 * i + j) % (shape["vocab"] - 1) for j in range(16)] for i in range(GEN_ROWS)]

    def generate() -> None:
        engine.generate(prompts, seed=3, max_new_tokens=GEN_TOKENS)

    check_once(check, lease, sub)  # warm
    out: dict[str, Any] = {}
    for name, work in (("check", lambda: check_once(check, lease, sub)), ("generate", generate)):
        runs = []
        for _ in range(pairs):
            with noise_of(plain):
                before = _timed(work)
            with noise_of(gumbel_noise):
                after = _timed(work)
            runs.append({"before_s": before, "after_s": after, "ratio": after / before})
        out[name] = {"pairs": runs, "median_ratio": statistics.median(r["ratio"] for r in runs)}
    out["check"]["what"] = (
        f"the generation check of 4 completions of {completion} tokens, V = {shape['vocab']:,}"
    )
    out["generate"]["what"] = (
        f"HF engine, {GEN_ROWS} rows x {GEN_TOKENS} sampled tokens, fp32, V = {shape['vocab']:,}"
    )
    out["threads"] = torch.get_num_threads()
    return out
