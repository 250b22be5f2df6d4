"""What a store-only island downloads per task, against its path's shard size and the whole run's shards.

    python bench/bench_store_only.py          # ~3 min on 2 CPU cores: 2x2 and 4x4 grids of the tiny model

For each grid, configs/tiny.yaml on the first `--documents` documents of the bundled corpus (route and
shard through the Python API), with `sharding.tokens_per_shard` small enough that a path has several
train shards. The store is `s3://` on moto's S3 server on loopback when `moto[server]` and `s3fs` are
installed (else a local directory); the coordinator's side initialises it and publishes the run
(`dipaco.pipeline.published.publish_run`). Then, for every path, an island with only the URL
(`fetch_run` into an empty directory, a cold cache of its own) runs one task of that path
(`dipaco.islands.island.training.train_task`, not pushed) and then a second task of the same path in the same
process (warm cache). Per task: the shard bytes it downloaded (the cache's counter), the module and
inner-state bytes it read, the path's shard bytes (train + val, from index.json) and the whole run's
shard bytes (what copying the run directory to the island's machine would cost).

Writes bench/results/store-only.{json,md} with the machine they were measured on.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import markdown_table, write_results  # noqa: E402
from dipaco.config import load_config, save_config  # noqa: E402
from dipaco.islands.island.training import train_task  # noqa: E402
from dipaco.pipeline.context import PathFactory  # noqa: E402
from dipaco.pipeline.published import fetch_run, publish_run, shard_files  # noqa: E402
from dipaco.pipeline.version_zero import start_or_resume_store  # noqa: E402
from dipaco.run_dir import RunDir  # noqa: E402
from dipaco.stages.island import island_setup  # noqa: E402
from dipaco.stages.route import route  # noqa: E402
from dipaco.stages.shard import shard  # noqa: E402
from dipaco.store.records import Task  # noqa: E402

log = logging.getLogger("bench_store_only")
TINY = ROOT / "configs" / "tiny.yaml"


def s3_store(bucket: str) -> tuple[str, object] | None:
    """An s3:// URL on a moto server started here (and the server), or None without moto[server] / s3fs."""
    try:
        import s3fs
        from moto.server import ThreadedMotoServer
    except ImportError:
        return None
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}")
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().mkdir(bucket)
    return f"s3://{bucket}", server


def measure_grid(levels: list[int], *, documents: int, tokens_per_shard: int, base_url: str, work: Path) -> dict:
    name = "x".join(map(str, levels))
    overrides = [f"topology.levels=[{','.join(map(str, levels))}]", f"corpus.max_documents={documents}",
                 f"sharding.tokens_per_shard={tokens_per_shard}", "hardware.device=cpu",
                 f"store.url={base_url}/{name}"]
    run = RunDir(work / f"run-{name}")
    config = load_config(TINY, overrides)
    route(config, run)
    shard(config, run)
    save_config(config, run.config)
    factory = PathFactory(config, run)
    start_or_resume_store(factory)
    published = publish_run(factory.store, run)
    files = shard_files(run.shards / "index.json")
    sizes = {f: (run.shards / f).stat().st_size for f in files}
    all_bytes = sum(sizes.values())
    rows = []
    for path in range(factory.topology.n_paths):
        island_config, island_run = fetch_run(config.store.url, run_root=work / f"island-{name}-{path}",
                                              overrides=[f"store.cache_dir={work / f'cache-{name}-{path}'}"])
        island = PathFactory(island_config, island_run)
        setup = island_setup(island_config, island_run, factory=island)
        stats = island.reader.fetch.cache.stats
        path_bytes = sum(size for f, size in sizes.items() if f.startswith(f"path-{path:04d}/"))
        train_shards = sum(1 for f in files if f.startswith(f"path-{path:04d}/train"))
        for task_number in (1, 2):
            shard_before, store_before, started = stats.downloaded_bytes, island.store.bytes_read, time.perf_counter()
            task = Task.open(path=path, base=0, step_offset=(task_number - 1) * island_config.inner.steps,
                             inner_from=None)
            out = train_task(setup, task)
            rows.append({"grid": name, "path": path, "task": task_number, "cache": "cold" if task_number == 1 else "warm",
                         "shard_bytes_downloaded": stats.downloaded_bytes - shard_before,
                         "module_bytes": out.meta.bytes_down_modules, "inner_bytes": out.meta.bytes_down_inner,
                         "store_bytes_read": island.store.bytes_read - store_before,
                         "path_shard_bytes": path_bytes, "path_train_shards": train_shards,
                         "run_shard_bytes": all_bytes, "seconds": time.perf_counter() - started})
    cold = [r for r in rows if r["task"] == 1]
    return {"grid": name, "paths": factory.topology.n_paths, "run_shard_bytes": all_bytes,
            "published_objects": published.objects, "published_bytes": published.uploaded_bytes,
            "cold_downloaded_over_path": statistics.mean(r["shard_bytes_downloaded"] / r["path_shard_bytes"] for r in cold),
            "cold_downloaded_over_run": statistics.mean(r["shard_bytes_downloaded"] / all_bytes for r in cold),
            "warm_shard_bytes_downloaded": sum(r["shard_bytes_downloaded"] for r in rows if r["task"] == 2),
            "tasks": rows}


def render(results: dict) -> str:
    lines = ["# Store-only islands: bytes downloaded per task", "",
             f"Store: {results['store']}. Each path: an island with only the URL, an empty cache, one task "
             f"({results['inner_steps']} inner steps of batch {results['batch_size']}), then a second task of the same "
             "path in the same process. `path shards` = the path's train + val shard bytes; `run shards` = every "
             "shard file of the run (what copying the run directory would move).", ""]
    rows = []
    for grid in results["grids"]:
        for r in grid["tasks"]:
            rows.append([r["grid"], r["path"], r["cache"], f"{r['shard_bytes_downloaded']:,}", f"{r['path_shard_bytes']:,}",
                         r["path_train_shards"], f"{r['shard_bytes_downloaded'] / r['path_shard_bytes']:.2f}",
                         f"{r['shard_bytes_downloaded'] / r['run_shard_bytes']:.3f}", f"{r['module_bytes']:,}"])
    lines.append(markdown_table(["grid", "path", "cache", "shard bytes downloaded", "path shards (bytes)",
                                 "path train shards", "downloaded / path", "downloaded / run shards",
                                 "module bytes read"], rows))
    lines += ["", "Summary (means over paths, first task, cold cache):", ""]
    lines.append(markdown_table(
        ["grid", "paths", "run shards (bytes)", "downloaded / path shards", "downloaded / run shards",
         "shard bytes downloaded by second tasks"],
        [[g["grid"], g["paths"], f"{g['run_shard_bytes']:,}", f"{g['cold_downloaded_over_path']:.2f}",
          f"{g['cold_downloaded_over_run']:.3f}", g["warm_shard_bytes_downloaded"]] for g in results["grids"]]))
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=3000, help="documents of the bundled corpus")
    parser.add_argument("--tokens-per-shard", type=int, default=8192, help="sharding.tokens_per_shard")
    parser.add_argument("--grid", action="append", default=None, help="levels, e.g. 2,2 (repeat; default 2,2 and 4,4)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    torch.set_num_threads(1)
    grids = [[int(x) for x in g.split(",")] for g in (args.grid or ["2,2", "4,4"])]
    with tempfile.TemporaryDirectory(prefix="bench-store-only-") as tmp:
        work = Path(tmp)
        s3 = s3_store("bench")
        base_url, store_kind = (s3[0], "s3:// on moto's S3 server (loopback)") if s3 else (str(work / "store"),
                                                                                          "a local directory")
        try:
            measured = [measure_grid(levels, documents=args.documents, tokens_per_shard=args.tokens_per_shard,
                                     base_url=base_url, work=work) for levels in grids]
        finally:
            if s3:
                s3[1].stop()
    tiny = load_config(TINY)
    results = {"store": store_kind, "documents": args.documents, "tokens_per_shard": args.tokens_per_shard,
               "inner_steps": tiny.inner.steps, "batch_size": tiny.inner.batch_size, "seq_len": tiny.sharding.seq_len,
               "grids": measured}
    path = write_results("store-only", results, render(results))
    print(render(results))
    print(f"results in {path}")


if __name__ == "__main__":
    main()
