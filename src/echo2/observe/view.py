"""The terminal view of a run: one live status area at the bottom, or plain periodic lines.

**Live** (stdout is a terminal and the view is enabled): a rich ``Live`` area with a bar that follows
whichever limit binds, the wall-clock budget or the step count (``max`` of the two fractions), and the
step's headline metrics: version, train reward, the last held-out accuracy, bubble ratio, staleness,
active workers and $/h. While it is open, log records that would go to the terminal are printed
through the live console, so they land *above* the area instead of through it; ``print`` is redirected
the same way. ``close()`` puts the original handlers back.

**Plain** (stdout is not a terminal, or the view is disabled: ``--no-progress`` / ``--quiet``): no
cursor movement and no colour, only a header and then at most one line every ``interval_s`` seconds
(taken at a step boundary) plus a last one on close, for log files::

    time     step      v  reward    acc  bubble  stale  workers  usd/h

A field keeps its newest value (held-out accuracy is not in every record); ``-`` means not seen yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any

from echo2.config import TrainConfig
from echo2.observe.catalog import STEP, TIME_S, VIEW

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

_FIELDS = tuple((c.name, c.metric.key, c.fmt) for c in VIEW)  # column name, metric key, format
_LABELS = {c.name: c.label for c in VIEW if c.label}  # live-area label where it differs from the name
_WIDTHS = {c.name: c.width for c in VIEW}
_PLAIN_INTERVAL_S = 10.0


def hms(seconds: float) -> str:
    """``H:MM:SS`` of a non-negative duration."""
    s = max(0, int(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressView:
    """The run's terminal view; ``update(record)`` once per learner step, ``close()`` at the end."""

    def __init__(
        self,
        train: TrainConfig,
        desc: str,
        enabled: bool,
        *,
        console: Console | None = None,
        interval_s: float = _PLAIN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        from rich.console import Console

        self.desc = desc
        self.budget_s = train.max_minutes * 60 if train.max_minutes else None
        self.max_steps = train.steps
        self.console = console if console is not None else Console()
        self.interval_s = interval_s
        self.clock = clock
        self.last: dict[str, str] = {}  # newest formatted value of each field
        self.step = 0  # steps seen (or the record's own ``step``, which counts from a resume point)
        self.time_s = 0.0  # the newest record's ``time_s`` (seconds since the learner's loop started)
        self.at: float | None = None  # clock() when that record arrived
        self.live_mode = enabled and self.console.is_terminal and not self.console.is_dumb_terminal
        self._pending = False  # plain mode: an update not yet written as a line
        self._next_line_at = -float("inf")
        self._header_done = False
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []
        self._live: Any = None
        self._closed = False
        if self.live_mode:
            self._start_live()

    # ---- the interface ---------------------------------------------------------------------------
    def update(self, record: dict[str, Any]) -> None:
        self.step = int(record.get(STEP.key, self.step + 1))
        self.time_s = float(record.get(TIME_S.key, self.time_s))
        self.at = self.clock()
        for name, key, fmt in _FIELDS:
            if record.get(key) is not None:
                self.last[name] = fmt.format(record[key])
        if self._live is not None:
            self._live.refresh()
        else:
            self._pending = True
            if self.at >= self._next_line_at:
                self._write_line()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # the clock stops: the last frame shows the last record's time
        if self._live is not None:
            try:
                self._live.stop()
            finally:
                self._restore_logs()
        elif self._pending:
            self._write_line()

    def __enter__(self) -> ProgressView:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- progress ----------------------------------------------------------------------------------
    def elapsed_s(self) -> float:
        """Seconds of the learner's loop: the last record's ``time_s``, advanced by the clock since
        (until ``close``)."""
        if self.at is None:
            return 0.0
        return self.time_s + (0.0 if self._closed else max(0.0, self.clock() - self.at))

    def fraction(self) -> float:
        """How far the run is, by whichever limit binds first (steps or the wall-clock budget)."""
        f = self.step / self.max_steps
        if self.budget_s:
            f = max(f, self.elapsed_s() / self.budget_s)
        return min(1.0, f)

    # ---- live mode ---------------------------------------------------------------------------------
    def _start_live(self) -> None:
        from rich.live import Live

        self._live = Live(
            console=self.console,
            get_renderable=self.render,
            refresh_per_second=2,  # the clock ticks between steps; cheap on a busy machine
            redirect_stdout=True,
            redirect_stderr=True,
        )
        self._live.start()
        self._route_logs()

    def render(self) -> RenderableType:
        """The live area: a progress line and, once a step has reported, a metrics line."""
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        frac = self.fraction()
        detail = f"step {self.step}/{self.max_steps}  {hms(self.elapsed_s())}"
        if self.budget_s:
            detail += f" / {hms(self.budget_s)}"
        bar = Table.grid(padding=(0, 1), expand=True)
        bar.add_column(no_wrap=True)
        bar.add_column(ratio=1)
        bar.add_column(no_wrap=True, justify="right")
        bar.add_column(no_wrap=True)
        bar.add_row(
            Text(self.desc, style="bold"),
            ProgressBar(total=1.0, completed=frac),
            Text(f"{frac:4.0%}"),
            Text(detail, style="cyan"),
        )
        if self.at is None:
            return Group(bar, Text("waiting for the first learner step…", style="dim"))
        metrics = Text()
        for name, _, _ in _FIELDS:
            if name in self.last:
                metrics.append(f"{_LABELS.get(name, name)} ", style="dim")
                metrics.append(self.last[name], style="bold")
                metrics.append("   ")
        metrics.rstrip()
        return Group(bar, metrics)

    def _route_logs(self) -> None:
        """Swap the root logger's terminal stream handlers for one printing through the live console."""
        from rich.logging import RichHandler

        root = logging.getLogger()
        for i, h in enumerate(root.handlers):
            if not (type(h) is logging.StreamHandler and self._is_terminal_stream(h.stream)):
                continue
            repl = RichHandler(
                level=h.level,
                console=self._live.console,
                show_path=False,
                log_time_format="%H:%M:%S",
                markup=False,
            )
            repl.setFormatter(logging.Formatter("%(name)s: %(message)s"))
            for f in h.filters:
                repl.addFilter(f)
            root.handlers[i] = repl
            self._swapped.append((h, repl))

    def _is_terminal_stream(self, stream: IO[str]) -> bool:
        """Writes to ``stream`` would land on the live area's screen (the console's file, or a tty)."""
        if stream is self.console.file:
            return True
        isatty = getattr(stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed stream
            return False

    def _restore_logs(self) -> None:
        root = logging.getLogger()
        for orig, repl in self._swapped:
            if repl in root.handlers:
                root.handlers[root.handlers.index(repl)] = orig
        self._swapped.clear()

    # ---- plain mode --------------------------------------------------------------------------------
    def _write_line(self) -> None:
        out = self.console.file
        if not self._header_done:
            out.write(self._row("time", "step", {name: name for name, _, _ in _FIELDS}) + "\n")
            self._header_done = True
        out.write(self._row(hms(self.time_s), str(self.step), self.last) + "\n")
        out.flush()
        self._pending = False
        self._next_line_at = self.clock() + self.interval_s

    @staticmethod
    def _row(t: str, step: str, values: dict[str, str]) -> str:
        cells = [f"{t:<8}", f"{step:>5}"]
        cells += [f"{values.get(name, '-'):>{_WIDTHS[name]}}" for name, _, _ in _FIELDS]
        return " ".join(cells)
