"""`echo2 bench-broadcast`: run the dissemination sweep and write JSON + a Fig. 4-style PNG."""

from __future__ import annotations

import argparse

from echo2.cli import Command


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"worker counts must be >= 1, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--mode",
        choices=("auto", "netns", "loopback"),
        default="auto",
        help="netns: tbf-shaped veth links (root); loopback: app-paced, no root (default: auto)",
    )
    p.add_argument("--ns", type=_ints, default=(4, 8, 16, 32), help="worker counts N (default 4,8,16,32)")
    p.add_argument("--size-mb", type=float, default=8.0, help="snapshot size G in MB (default 8)")
    p.add_argument("--chunk-kib", type=int, default=16, help="chunk size in KiB (default 16)")
    p.add_argument("--bw-mbps", type=float, default=8.0, help="per-worker link B_w in Mbit/s (default 8)")
    p.add_argument("--ratio", type=float, default=3.0, help="B0/B_w (paper: 3 or 8; default 3)")
    p.add_argument("--strategies", default="star-unlimited,star-limited,tree-pipelined")
    p.add_argument("--fault-n", type=int, default=8, help="N for the kill/stall/corruption runs (default 8)")
    p.add_argument("--no-faults", action="store_true", help="skip the kill/stall/corruption runs")
    p.add_argument("--no-relay", action="store_true", help="skip the loopback relay-chain probe")
    p.add_argument("--out", default="results/broadcast.json", help="JSON path (PNG next to it)")
    p.add_argument("--timeout", type=float, default=300.0, help="per-scenario timeout in seconds")


def run(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from echo2.broadcast.bench import BenchConfig, run_benchmark, write_outputs
    from echo2.broadcast.netns import HarnessError, netns_available
    from echo2.broadcast.registry import registry
    from echo2.errors import ConfigError

    strategies = tuple(s.strip() for s in args.strategies.split(",") if s.strip())
    unknown = [s for s in strategies if s not in registry()]
    if unknown:
        raise ConfigError(f"--strategies: unknown {unknown}; choose from {sorted(registry())}")
    if args.size_mb <= 0 or args.chunk_kib <= 0 or args.bw_mbps <= 0 or args.ratio <= 0:
        raise ConfigError("--size-mb, --chunk-kib, --bw-mbps and --ratio must all be > 0")
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


BENCH_BROADCAST = Command(
    help="measure snapshot broadcast (star vs tree-pipelined) on shaped links; writes JSON + PNG",
    add_arguments=add_arguments,
    run=run,
)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m echo2.broadcast.cli``), same behaviour as ``echo2 bench-broadcast``."""
    import logging
    import sys

    from echo2.errors import Echo2Error

    parser = argparse.ArgumentParser(prog="echo2 bench-broadcast", description=BENCH_BROADCAST.help)
    add_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")  # fmt: skip
    try:
        return run(args)
    except Echo2Error as exc:
        print(f"echo2 bench-broadcast: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("echo2 bench-broadcast: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
