"""Benchmark harnesses for echo2; not part of the product package.

``netns`` builds the one-machine WAN (namespaces, veths, tbf), ``harness`` runs a broadcast scenario
with real processes (``proc`` are their entry points), ``faults`` injects kill / stall / corruption
into a worker through the product's ``ChunkTap`` seam, and ``broadcast_bench`` is the Fig. 4 sweep
behind ``benchmarks/broadcast.py``. Import it with ``benchmarks/`` on ``sys.path`` (pytest does so
through ``pythonpath`` in pyproject.toml; the scripts in ``benchmarks/`` get it as their own folder).
"""

from __future__ import annotations

from pathlib import Path

BENCHMARKS_DIR = Path(__file__).resolve().parent.parent  # the folder that holds this package
