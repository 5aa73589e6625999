"""Benchmark for SPEC §4 / issue 3: snapshot broadcast on a one-machine WAN.

    sudo nice -n 19 .venv/bin/python benchmarks/broadcast.py            # netns, tbf-shaped (root)
    nice -n 19 .venv/bin/python benchmarks/broadcast.py --mode loopback  # no root: app-paced

Writes results/broadcast.json and results/broadcast.png (T_bcast vs N for Star-Unlimited, Star-Limited
and Tree-Pipelined with T* drawn), plus the loopback relay-chain, kill/stall and corruption numbers.
Same flags as `echo2 bench-broadcast`.
"""

from __future__ import annotations

import sys

from echo2.broadcast.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
