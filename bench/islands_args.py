"""bench/bench_islands.py's command line: the options, checked, as a `Setting` (and the namespace for the rest)."""

from __future__ import annotations

import argparse

import bench.bench_islands as islands
from bench.bench_islands import Setting


def setting_from(argv: list[str]) -> tuple[Setting, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=islands.__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2, help="topology.replicas: 4 x this paths and islands")
    parser.add_argument("--rounds", type=int, default=20, help="run.rounds (results applied per path)")
    parser.add_argument("--inner-steps", type=int, default=10, help="inner.steps H per task")
    parser.add_argument("--step-seconds", type=float, default=2.0, help="the pace p (faults.step_seconds)")
    parser.add_argument("--checkpoint-steps", type=int, default=1)
    parser.add_argument("--restart", type=float, default=0.15, help="restart time R in task times T")
    parser.add_argument("--mtbf", default="auto",
                        help="comma-separated MTBF per island in task times T, or 'auto': where the simulator, fitted to "
                             "the failure-free rows, predicts --dp-target data-parallel and --sync-target sync goodput")
    parser.add_argument("--dp-target", type=float, default=0.30)
    parser.add_argument("--sync-target", type=float, default=0.60)
    parser.add_argument("--no-straggler", action="store_true", help="skip the straggler rows")
    parser.add_argument("--name", default="islands", help="results name: bench/results/NAME.{json,md}")
    parser.add_argument("--only", default="", help="comma-separated rows to run (again); the others are kept from the JSON")
    parser.add_argument("--keep", action="store_true", help="keep the rows the JSON has; run only the missing ones")
    parser.add_argument("--markdown-only", action="store_true", help="re-render bench/results/NAME.md from its JSON")
    parser.add_argument("--predict", action="store_true", help="(re)compute the simulator's column from the JSON")
    parser.add_argument("--bandwidth", nargs="+", type=float, default=None, metavar="B",
                        help="instead of the rows above: failure-free sync rows with every island's store traffic "
                             "limited to B bytes/s each way (faults.store_bandwidth; 0 = unlimited), one per --variants "
                             "and B (bench/islands_bandwidth.py)")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="with --bandwidth: float32 then the settings to compare (bench/bench_compression.py's names)")
    parser.add_argument("--workers", type=int, default=1,
                        help="instead of the rows above: elastic islands of this many workers each against data "
                             "parallel over the same workers, at the one --mtbf given (bench/islands_elastic.py)")
    parser.add_argument("--seeds", default="0", help="with --workers: comma-separated run.seed values of the island rows")
    parser.add_argument("--recompute-goodput", action="store_true",
                        help="goodput by work from the JSON's applied tokens and run seconds (bench/islands_goodput.py), "
                             "then the simulator's column")
    args = parser.parse_args(argv)
    if min(args.replicas, args.rounds, args.inner_steps) < 1 or args.step_seconds <= 0 or args.checkpoint_steps < 1:
        parser.error(f"--replicas, --rounds, --inner-steps and --checkpoint-steps must be >= 1 and --step-seconds > 0, "
                     f"got {args.replicas}, {args.rounds}, {args.inner_steps}, {args.checkpoint_steps}, {args.step_seconds}")
    if args.bandwidth is not None and min(args.bandwidth) < 0:
        parser.error(f"--bandwidth values are bytes per second >= 0, got {args.bandwidth}")
    mtbf = None if args.mtbf == "auto" else tuple(float(x) for x in args.mtbf.split(",") if x.strip())
    if mtbf is not None and any(m <= 0 for m in mtbf):
        parser.error(f"--mtbf values must be > 0, got {args.mtbf!r}")
    if args.workers < 1 or (args.workers > 1 and (mtbf is None or len(mtbf) != 1)):
        parser.error(f"--workers {args.workers}: a count >= 1; above 1 give one per-worker --mtbf, got {args.mtbf!r}")
    if not (0 < args.dp_target < 1 and 0 < args.sync_target < 1):
        parser.error(f"--dp-target and --sync-target are goodputs in (0, 1), got {args.dp_target}, {args.sync_target}")
    return Setting(replicas=args.replicas, rounds=args.rounds, inner_steps=args.inner_steps,
                   step_seconds=args.step_seconds, checkpoint_steps=args.checkpoint_steps, restart_tasks=args.restart,
                   mtbf_tasks=mtbf, dp_target=args.dp_target, sync_target=args.sync_target,
                   straggler=not args.no_straggler, name=args.name), args
