"""`echo2 report RUN_DIR`: one self-contained HTML page of a run, finished or running (module imports
stay stdlib-only; the page is drawn by ``echo2.observe.report``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from echo2.cli.common import Command


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a run directory (the one holding metrics.jsonl)")
    p.add_argument("--out", help="where to write the page (default <run_dir>/report.html)")


def _run(args: argparse.Namespace) -> int:
    from echo2.observe.report import write_report

    out = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {out} ({out.stat().st_size / 1024:.0f} KiB)")
    return 0


REPORT = Command(
    help="an HTML report of a run directory (summary, plots, pool, decisions, config), openable offline",
    add_arguments=_add_arguments,
    run=_run,
)
