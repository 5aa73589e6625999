"""Benchmark for SPEC §4 / issue 3: snapshot broadcast on a one-machine WAN.

    sudo nice -n 19 .venv/bin/python benchmarks/broadcast.py            # netns, tbf-shaped (root)
    nice -n 19 .venv/bin/python benchmarks/broadcast.py --mode loopback  # no root: app-paced

Writes results/broadcast.json and results/broadcast.png (T_bcast vs N for Star-Unlimited, Star-Limited
and Tree-Pipelined with T* drawn), plus the loopback relay-chain, kill/stall and corruption numbers.
The harness it drives lives in ``benchmarks/echo2_bench/`` (this script's folder is on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DESCRIPTION = "measure snapshot broadcast (star vs tree-pipelined) on shaped links; writes JSON + PNG"


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="benchmarks/broadcast.py", description=DESCRIPTION)
    p.add_argument(
        "--mode",
        choices=("auto", "netns", "loopback"),
        default="auto",
        help="netns: tbf-shaped veth links (root); loopback: app-paced, no root (default: auto)",
    )
    p.add_argument("--ns", type=_ints, default=(4, 8, 16, 32), help="worker counts N (default 4,8,16,32)")
    p.add_argument("--size-mb", type=float, default=8.0, help="snapshot size G in MB (default 8)")
    p.add_argument(
        "--chunk-kib",
        type=_chunk_kib,
        default=16,
        help="chunk size in KiB, or 'auto': the publisher picks it per snapshot as the runtime does "
        "(physics.broadcast.relay_chunk_bytes; default 16)",
    )
    p.add_argument("--bw-mbps", type=float, default=8.0, help="per-worker link B_w in Mbit/s (default 8)")
    p.add_argument("--ratio", type=float, default=3.0, help="B0/B_w (paper: 3 or 8; default 3)")
    p.add_argument("--strategies", default="star-unlimited,star-limited,tree-pipelined")
    p.add_argument("--fault-n", type=int, default=8, help="N for the fault runs (default 8)")
    p.add_argument("--no-faults", action="store_true", help="skip the kill/stall/drip/corruption runs")
    p.add_argument("--no-relay", action="store_true", help="skip the loopback relay-chain probe")
    p.add_argument("--out", default="results/broadcast.json", help="JSON path (PNG next to it)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-scenario timeout in seconds")
    return p


def _chunk_kib(text: str) -> int:
    """KiB, or 0 for 'auto' (chosen per snapshot)."""
    return 0 if text == "auto" else int(text)


def run(args: argparse.Namespace) -> int:
    from echo2.broadcast.factory import registry
    from echo2.errors import ConfigError
    from echo2_bench.broadcast_bench import BenchConfig, run_benchmark, write_outputs
    from echo2_bench.netns import HarnessError, netns_available

    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in registry()]
    if unknown:
        raise ConfigError(f"--strategies: unknown {unknown}; choose from {sorted(registry())}")
    if args.size_mb <= 0 or args.chunk_kib < 0 or args.bw_mbps <= 0 or args.ratio <= 0:
        raise ConfigError("--size-mb, --bw-mbps and --ratio must be > 0, --chunk-kib > 0 or 'auto'")
    if args.mode == "netns" and (why := netns_available()):
        raise HarnessError(f"--mode netns {why}; use --mode loopback")
    cfg = BenchConfig(
        mode=args.mode, ns=args.ns, size=int(args.size_mb * 1e6), chunk=args.chunk_kib << 10,
        bw_mbps=args.bw_mbps, ratio=args.ratio, strategies=strategies, fault_n=args.fault_n,
        faults=not args.no_faults, relay=not args.no_relay, timeout=args.timeout,
    )  # fmt: skip
    report = run_benchmark(cfg)
    out = Path(args.out)
    write_outputs(report, out, out.with_suffix(".png"))
    print(json.dumps(report["targets"], indent=2, default=str))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from echo2.errors import Echo2Error

    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    try:
        return run(args)
    except Echo2Error as exc:
        print(f"benchmarks/broadcast.py: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("benchmarks/broadcast.py: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
