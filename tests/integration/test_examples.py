"""CI runs both examples briefly on the embedded default and checks that they learn: held-out
accuracy after a minute of GRPO is above the warm start's (by more than one evaluation's noise)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MIN_GAIN = 0.04  # accuracy points (as a fraction) over the start; one 256-prompt evaluation moves ~0.03


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    """One warm-start cache for both examples (the default model's warm start takes ~40 s here)."""
    return str(tmp_path_factory.mktemp("echo2-cache"))


@pytest.mark.parametrize(
    ("script", "args"),
    [("minimal_grpo.py", ["--minutes", "1"]), ("minimal_async_grpo.py", ["--minutes", "1"])],
)
def test_example_learns(script, args, cache):
    env = {**os.environ, "ECHO2_CACHE": cache}
    res = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                         timeout=600, env=env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    start = float(re.search(r"start: held-out accuracy ([0-9.]+)", res.stdout).group(1))  # type: ignore[union-attr]
    end = float(re.search(r"end after \d+ \w+: held-out accuracy ([0-9.]+)", res.stdout).group(1))  # type: ignore[union-attr]
    assert end >= start + MIN_GAIN, res.stdout
    if script == "minimal_async_grpo.py":
        assert re.search(r"max staleness [0-3] \(S = 3\)", res.stdout), res.stdout  # never above S
