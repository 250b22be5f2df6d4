"""Bytes of top-k result files written in codec format 2 (an entry per tensor and part) against the same
pseudo-gradients re-encoded in format 3 (each part concatenated, dipaco.codec.compress): lossless, so the
decoded tensors are equal and only the container's bytes change.

    python experiments/codec_format_bytes.py 'runs/.../store/results/round-*/*.topk.safetensors' --density 0.05 --bits 2

Writes experiments/results/codec-format3.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path

import torch
import zstandard
from safetensors.torch import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.recording import EXPERIMENT_RESULTS, markdown_table, write_results  # noqa: E402
from dipaco.codec.compress import compress, decompress  # noqa: E402
from dipaco.codec.sparse import TopK, decode_tensor  # noqa: E402

TEXT = """Format 2 stored an entry per tensor and part (4 x 18 entries per module here, each with its full name),
whose header took about 1.1 KB of a 7.1 KB module frame after zstd; format 3 stores each part once per
module, the tensors' pieces concatenated, with the names and shapes listed once. The decoded tensors are
equal (checked), so perplexity does not change; pseudo-gradients up and the contributions down
(`compression.download: results` copies the same frames) shrink by about this factor."""


def format2_tensors(data: bytes, spec: TopK) -> dict[str, torch.Tensor]:
    """The float32 tensors a format-2 top-k file holds (decoded by hand: this dipaco refuses format 2)."""
    tensors = {}
    for frame in load(data).values():
        payload = zstandard.ZstdDecompressor().decompress(frame.numpy().tobytes())
        blob = load(payload)
        meta = json.loads(json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])["__metadata__"]["dipaco"])
        for name, shape in meta["shapes"].items():
            parts = {p: blob[f"{name}::{p}"] for p in ("gaps", "codes", "lo", "step")}
            tensors[name] = decode_tensor(parts, shape=shape, spec=spec, name=name)
    return tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", help="a glob of format-2 .topk.safetensors result files")
    parser.add_argument("--density", type=float, required=True)
    parser.add_argument("--bits", type=int, required=True)
    parser.add_argument("--chunk", type=int, default=4096)
    args = parser.parse_args()
    spec = TopK(density=args.density, bits=args.bits, chunk=args.chunk)
    old = new = 0
    files = sorted(glob.glob(args.files))
    for f in files:
        data = open(f, "rb").read()
        tensors = format2_tensors(data, spec)
        encoded, _ = compress(tensors, method="topk", topk=spec)
        back, _ = decompress(encoded, method="topk")
        assert all(torch.equal(back[k], tensors[k]) for k in tensors), f  # lossless
        old, new = old + len(data), new + len(encoded)
    out = {"files": len(files), "format2_bytes": old, "format3_bytes": new, "ratio": new / old,
           "settings": spec.to_json()}
    table = markdown_table(["files", "format 2 bytes", "format 3 bytes", "format 3 / format 2"],
                           [[len(files), f"{old:,}", f"{new:,}", f"{new / old:.3f}"]])
    write_results("codec-format3", out, "# Codec format 3 against format 2: the container's bytes of top-k results\n\n"
                  + table + "\n\n" + TEXT + "\n", results_dir=EXPERIMENT_RESULTS)
    print(f"{len(files)} files: format 2 {old:,} bytes, format 3 {new:,} bytes ({new / old:.3f})")


if __name__ == "__main__":
    main()
