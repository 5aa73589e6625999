"""The terminal view: the live status area, logs above it, plain periodic lines, and ``--quiet``."""

from __future__ import annotations

import io
import logging
import re

import pytest
from rich.console import Console

from echo2.cli import build_parser, log_level
from echo2.cli.run import live_view
from echo2.config import TrainConfig
from echo2.observe.view import ProgressView

RECORD = {
    "step": 12,
    "time_s": 30.0,
    "learner/version": 12,
    "reward/mean": 0.4123,
    "reward/accuracy": 0.52,
    "learner/bubble_ratio": 0.125,
    "store/staleness_max": 3,
    "pool/active_workers": 4,
    "cost/usd_per_hour": 1.4,
}
_CSI = re.compile(r"\x1b\[(\??)([0-9;]*)([A-Za-z])")


def screen(raw: str) -> list[str]:
    """What a terminal shows after ``raw``: just the controls rich's Live uses (CR, LF, CSI A/K/m/?l/?h)."""
    lines, row, col, i = [""], 0, 0, 0
    while i < len(raw):
        m = _CSI.match(raw, i)
        if m:
            private, arg, op = m.groups()
            if op == "A":
                row = max(0, row - int(arg or 1))
            elif op == "K":
                lines[row] = "" if arg == "2" else lines[row][:col]
            elif op not in "mlh" or (op in "lh" and not private):
                raise AssertionError(f"unexpected control {m.group()!r}")
            i = m.end()
            continue
        ch = raw[i]
        if ch == "\r":
            col = 0
        elif ch == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + ch + line[col + 1 :]
            col += 1
        i += 1
    return [line.rstrip() for line in lines if line.strip()]


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def root_stream():
    """A root handler writing to a terminal-like buffer, as ``logging.basicConfig`` sets one up."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    yield buf, handler
    root.removeHandler(handler)
    root.setLevel(old_level)


def test_live_area_shows_the_bar_and_the_headline_metrics():
    buf, clock = io.StringIO(), FakeClock()
    console = Console(file=buf, force_terminal=True, width=110)
    with ProgressView(
        TrainConfig(steps=100, max_minutes=1.0), "echo2 run", True, console=console, clock=clock
    ) as view:
        assert view.live_mode
        view.update(RECORD)
        clock.t = 6.0  # the clock runs on between steps: 36 s of a 60 s budget binds over 12/100 steps
        frame = Console(file=io.StringIO(), width=110)
        frame.print(view.render())
        assert "60%" in frame.file.getvalue() and "0:00:36 / 0:01:00" in frame.file.getvalue()
    shown = "\n".join(screen(buf.getvalue()))  # the last frame stays, at the last record's time
    for text in ("echo2 run", "50%", "step 12/100", "0:00:30 / 0:01:00"):
        assert text in shown
    for text in ("v 12", "reward 0.41", "acc 0.52", "bubble 0.12", "stale 3", "workers 4", "$/h 1.40"):
        assert text in shown


def test_progress_follows_whichever_limit_binds():
    clock = FakeClock()
    view = ProgressView(
        TrainConfig(steps=100, max_minutes=1.0), "t", False, console=Console(file=io.StringIO()), clock=clock
    )
    view.update({"step": 10, "time_s": 45.0})
    assert view.fraction() == pytest.approx(0.75)  # the budget binds
    view.update({"step": 90, "time_s": 10.0})
    assert view.fraction() == pytest.approx(0.9)  # the step count binds
    clock.t = 100.0
    assert view.fraction() == 1.0


def test_log_lines_print_above_the_live_area_not_through_it(root_stream):
    buf, handler = root_stream
    console = Console(file=buf, force_terminal=True, width=100)
    log = logging.getLogger("echo2.test_view")
    view = ProgressView(TrainConfig(steps=100, max_minutes=None), "echo2 run", True, console=console)
    try:
        assert handler not in logging.getLogger().handlers  # swapped for the live console's handler
        view.update(RECORD)
        log.info("hello from the learner")
        view.update({**RECORD, "step": 13, "learner/version": 13})
        log.warning("a worker is slow")
        view.update({**RECORD, "step": 14, "learner/version": 14})
    finally:
        view.close()
    assert handler in logging.getLogger().handlers  # restored on close
    lines = screen(buf.getvalue())
    hello = [i for i, line in enumerate(lines) if "hello from the learner" in line]
    slow = [i for i, line in enumerate(lines) if "a worker is slow" in line]
    bar = [i for i, line in enumerate(lines) if "echo2 run" in line]
    assert len(hello) == len(slow) == len(bar) == 1, lines  # each printed once, none overwritten
    assert hello[0] < slow[0] < bar[0] == len(lines) - 2  # logs in order, above the two-line area
    assert "v 14" in lines[-1] and "step 14/100" in lines[-2]
    assert "echo2.test_view" in lines[hello[0]] and "step" not in lines[hello[0]] + lines[slow[0]]


@pytest.mark.parametrize("tty", [False, True])  # stdout not a tty; or --no-progress on a tty
def test_plain_mode_prints_periodic_lines_without_control_sequences(tty, root_stream):
    buf, handler = io.StringIO(), root_stream[1]
    clock = FakeClock()
    console = Console(file=buf, force_terminal=tty, width=100)
    view = ProgressView(
        TrainConfig(steps=100), "echo2 run", not tty, console=console, interval_s=10.0, clock=clock
    )
    assert not view.live_mode and handler in logging.getLogger().handlers
    for step, t in enumerate([0.0, 3.0, 11.0, 12.0, 25.0, 26.0], start=1):
        clock.t = t
        view.update({**RECORD, "step": step, "time_s": t, "learner/version": step})
    view.close()
    out = buf.getvalue()
    assert "\x1b" not in out and "\r" not in out
    lines = out.splitlines()
    assert lines[0].split() == ["time", "step", "v", "reward", "acc", "bubble", "stale", "workers", "usd/h"]
    assert [line.split()[1] for line in lines[1:]] == ["1", "3", "5", "6"]  # t = 0, 11, 25; 26 at close
    assert lines[2].split() == ["0:00:11", "3", "3", "0.41", "0.52", "0.12", "3", "4", "1.40"]


def test_plain_mode_shows_a_dash_for_fields_not_seen_yet():
    buf = io.StringIO()
    view = ProgressView(TrainConfig(steps=5), "t", True, console=Console(file=buf))
    view.update({"step": 1, "time_s": 1.0, "learner/version": 1, "reward/mean": 0.5})
    view.close()
    assert buf.getvalue().splitlines()[1].split() == ["0:00:01", "1", "1", "0.50", "-", "-", "-", "-", "-"]


def test_quiet_means_plain_lines_and_warning_level(root_stream):
    parse = build_parser().parse_args
    assert log_level(parse(["train"])) == logging.INFO
    assert log_level(parse(["-v", "run", "--quiet"])) == logging.DEBUG  # -v wins
    quiet = parse(["run", "--quiet"])
    assert log_level(quiet) == logging.WARNING and not live_view(quiet)
    assert not live_view(parse(["learner", "--no-progress"])) and live_view(parse(["train"]))
    buf, _ = root_stream
    logging.getLogger().setLevel(log_level(quiet))
    log = logging.getLogger("echo2.test_view")
    log.info("publishing v3")
    log.warning("worker exit codes [1]")
    assert buf.getvalue().splitlines() == ["WARNING echo2.test_view: worker exit codes [1]"]
