"""What error feedback still holds at the end of a run: the paths' final residuals against a round's update.

    python experiments/residual_left.py runs/bench-compression            # the runs bench/bench_compression.py made

For every run under the folder whose paths carry an error-feedback residual (`compression.codec: topk`),
per kind of module (the shared blocks, the path-private embeddings): the norm of the residuals the paths'
last inner states hold (what they trained and never sent: the stored model does not have it), against the
norm of the last round's update of the stored modules (θ_{R-1} − θ_R) in that run and in the float32 run of
the same seed (`seed<N>-float32`, else `--reference`). A residual of several rounds' updates is training the evaluated model never got.
Writes experiments/results/residual-left.{json,md}.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402


def kind(module: str) -> str:
    return "private embeddings" if module.endswith(".embeddings") else "shared blocks"


def last_update(store: Path) -> dict[str, float]:
    """Per kind of module, the norm of θ_{R-1} − θ_R over the stored modules (the last two versions)."""
    from safetensors.torch import load_file

    versions = sorted((store / "modules").glob("round-*"))
    if len(versions) < 2:
        raise SystemExit(f"{store / 'modules'}: needs the last two module versions")
    before, after = versions[-2], versions[-1]
    squares: dict[str, float] = {}
    for file in sorted(after.glob("*.safetensors")):
        new, old = load_file(str(file)), load_file(str(before / file.name))
        squares[kind(file.stem)] = squares.get(kind(file.stem), 0.0) + sum(
            float((new[k].double() - old[k].double()).square().sum()) for k in new)
    return {k: math.sqrt(v) for k, v in squares.items()}


def final_residual(store: Path) -> dict[str, float] | None:
    """Per kind of module, the norm of the residuals in every path's last inner state (None without any)."""
    from dipaco.carried.state import CarriedState
    from dipaco.store.module_store import ModuleStore

    squares: dict[str, float] = {}
    for path in sorted((store / "islands").glob("path-*")):
        states = sorted(path.glob("inner-round-*.safetensors"))
        if not states:
            continue
        ref = states[-1].relative_to(store).as_posix()
        residual = CarriedState.from_tensors(*ModuleStore(str(store)).read_tensors_with_meta(ref), where=ref).residual
        for name, tensor in residual.items():
            module = name.split("/")[0]
            squares[kind(module)] = squares.get(kind(module), 0.0) + float(tensor.double().square().sum())
    return {k: math.sqrt(v) for k, v in squares.items()} if squares else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, help="a folder of runs (bench/bench_compression.py's --runs)")
    parser.add_argument("--reference", default="seed0-float32",
                        help="the float32 run in that folder (default: the run's own seed's, seed<N>-float32)")
    parser.add_argument("--name", default="residual-left")
    args = parser.parse_args()
    rows = []
    for run in sorted(p for p in args.runs.iterdir() if (p / "store").is_dir()):
        residual = final_residual(run / "store")
        if residual is None:
            continue
        update = last_update(run / "store")
        seed = run.name.split("-")[0]  # bench_compression's runs are seed<N>-<variant>: compare within a seed
        same_seed = args.runs / f"{seed}-float32"
        reference = last_update((same_seed if same_seed.exists() else args.runs / args.reference) / "store")
        for k in sorted(residual):
            rows.append({"run": run.name, "kind": k, "final_residual": residual[k], "last_update": update.get(k),
                         "float32_last_update": reference.get(k),
                         "residual_over_float32_round": residual[k] / reference[k] if reference.get(k) else None})
    headers = ["run", "modules", "final residual norm", "last round's update (this run)", "last round's update (float32)",
               "residual ÷ a float32 round's update"]
    table = [[r["run"], r["kind"], f"{r['final_residual']:.3f}", f"{r['last_update']:.3f}", f"{r['float32_last_update']:.3f}",
              f"{r['residual_over_float32_round']:.1f}"] for r in rows]
    markdown = (f"# What error feedback still holds at the end of the run (runs in {args.runs})\n\n"
                "Norms summed over the paths and their modules of each kind. The residual is training the paths "
                "did and never sent: the stored (evaluated) model lacks it.\n\n" + markdown_table(headers, table) + "\n")
    write_results(args.name, {"rows": rows, "runs": str(args.runs)}, markdown, results_dir=EXPERIMENT_RESULTS)
    print(markdown)


if __name__ == "__main__":
    main()
