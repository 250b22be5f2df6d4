"""Command line for shard directories: print the summary of one, or verify all its checksums.

Run: ``python -m sharding info DIR`` (per-path blocks and tokens) or ``python -m sharding verify DIR``
(reads every shard file). Shards are built by ``dipaco`` (``sharding.build.build_shards``).
"""

from __future__ import annotations

import argparse
import logging
import sys

from sharding.format import ShardError
from sharding.reader import ShardReader

logger = logging.getLogger(__name__)


def format_info(reader: ShardReader) -> str:
    """A human-readable summary of a shard directory's index."""
    idx = reader.index
    lines = [
        f"{reader.directory}: format {idx['format_version']}, created {idx.get('created', '?')}",
        f"seq_len {reader.seq_len}, vocab {reader.vocab_size} ({reader.token_dtype}), "
        f"eos {reader.eos_token_id}",
        f"tokenizer {reader.tokenizer_fingerprint[:16]}  router {str(reader.router_fingerprint)[:16]}",
        "",
        f"{'path':>6} {'docs':>9} {'train blocks':>13} {'train tokens':>14} {'val blocks':>11} "
        f"{'val tokens':>12} {'dropped':>8} {'shards':>7}",
    ]
    for e in idx["paths"]:
        tr, va = e["train"], e["val"]
        n_shards = len(tr["shards"]) + len(va["shards"])
        lines.append(
            f"{e['path']:>6} {tr.get('documents', 0):>9} {tr['blocks']:>13} {tr['tokens']:>14} "
            f"{va['blocks']:>11} {va['tokens']:>12} {e.get('dropped_tokens', 0):>8} {n_shards:>7}"
        )
    docs = sum(e["train"].get("documents", 0) for e in idx["paths"])
    lines.append(
        f"{'all':>6} {docs:>9} {reader.num_blocks(None, 'train'):>13} {reader.num_tokens(None, 'train'):>14} "
        f"{reader.num_blocks(None, 'val'):>11} {reader.num_tokens(None, 'val'):>12} "
        f"{sum(e.get('dropped_tokens', 0) for e in idx['paths']):>8}"
    )
    test = idx["test"]
    lines += [
        "",
        f"test: {test['documents']} documents, {test['tokens']} tokens, "
        f"{test['too_short']} too short, {test.get('truncated', 0)} truncated, "
        f"{len(test['shards'])} shard(s)",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sharding", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="print the per-path summary of a shard directory").add_argument("dir")
    sub.add_parser("verify", help="read every shard file and check its sha256").add_argument("dir")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        reader = ShardReader(args.dir)
        if args.command == "info":
            print(format_info(reader))
        else:
            print(f"{args.dir}: {reader.verify()} files OK")
    except (FileNotFoundError, ShardError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
