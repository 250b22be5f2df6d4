"""A result's declared tensors are checked before anything is decoded: a file whose header (codec none) or
module frame's header (int8, int4, topk) declares a [10**9, 10**6] float32 tensor is refused by name with
the declared and the expected shape, and a frame of zeros longer than its tensors take is refused after
decompressing no more than they take (zstd's own decompress would allocate what the frame claims)."""

import json
import struct
import tracemalloc

import pytest
import torch
import zstandard
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.codec.compress import FORMAT, compress, decompress
from dipaco.codec.sparse import TopK
from dipaco.config import ResilienceConfig
from dipaco.islands.coordinator.acceptance import ResultChecks
from dipaco.model.topology import Topology
from dipaco.store.board import open_result, write_encoded_result
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import ResultMeta, Task

HUGE = [10**9, 10**6]  # 4e15 bytes in float32
TOPOLOGY = Topology(levels=(1,), level_blocks=((0,),), private_blocks=frozenset(), private_embeddings=False)
MODULES = {"embeddings": {"e": torch.zeros(6, 4)}, "level0.module0": {"w": torch.zeros(4, 3), "b": torch.zeros(3)}}
SPEC = TopK(density=0.5, bits=2, chunk=64)
BLOCK = 1 << 17  # zstd's largest block


def zstd_frame(prefix: bytes, *, zeros: int, claimed: int) -> bytes:
    """A zstd frame by hand: `prefix` in a raw block, then `zeros` zero bytes in run-length blocks (4 bytes per
    128 KiB), its header claiming `claimed` bytes of content (zstd's decompress allocates that much up front)."""
    blocks = [(0, prefix)] + [(1, b"\0")] * (zeros // BLOCK)  # (type: 0 raw, 1 run-length; content)
    sizes = [len(prefix)] + [BLOCK] * (zeros // BLOCK)
    out = bytearray(struct.pack("<I", 0xFD2FB528) + bytes([0xC0, 7 << 3]) + struct.pack("<Q", claimed))
    for i, ((kind, content), size) in enumerate(zip(blocks, sizes, strict=True)):
        last = i == len(blocks) - 1 and len(prefix) + zeros == claimed
        out += ((size << 3) | (kind << 1) | last).to_bytes(3, "little") + content
    return bytes(out)


def inner_header(method: str, shapes: dict[str, list[int]], *, data: int) -> bytes:
    """A module frame's safetensors header declaring `shapes` (format 3: names and shapes), with one uint8
    part of `data` bytes."""
    meta = ({"method": method, "names": list(shapes), "shapes": list(shapes.values())}
            | ({"topk": SPEC.to_json()} if method == "topk" else {}))
    header = {"q": {"dtype": "U8", "shape": [data], "data_offsets": [0, data]}}
    header["__metadata__"] = {"dipaco": json.dumps(meta)}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text


def result_file(method: str, bomb: bytes | None) -> bytes:
    """An honest file of MODULES' zeros, level0.module0's frame replaced by `bomb` (codec none: `bomb` unused,
    its header declares level0.module0/w HUGE)."""
    tensors = {f"{m}/{p}": t for m, params in MODULES.items() for p, t in params.items()}
    data, _ = compress(tensors, method=method, topk=SPEC if method == "topk" else None)
    if method == "none":
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        header["level0.module0/w"]["shape"] = HUGE
        text = json.dumps(header).encode()
        return struct.pack("<Q", len(text)) + text + data[8 + size:]
    frames = load_safetensors(data)
    frames["level0.module0"] = torch.frombuffer(bytearray(bomb), dtype=torch.uint8)
    return save_safetensors(frames, metadata={"dipaco": json.dumps({"method": method, "format": FORMAT})})


def stored(tmp_path, method: str, data: bytes) -> tuple[ModuleStore, Task]:
    store = ModuleStore(f"file://{tmp_path}/store")
    for name, params in MODULES.items():
        store.write_module(0, name, params)
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    meta = ResultMeta(path=0, round=1, base=0, attempt=0, tokens=1, train_loss=1.0, losses=(1.0,), val_loss_start=1.0,
                      seconds=1.0, bytes_down_modules=0, bytes_down_inner=0, inner_state_local=False,
                      data_parallel_ranks=1)
    write_encoded_result(store, task, data, meta, compression=method)
    return store, task


@pytest.mark.parametrize("method", ["none", "int8", "int4", "topk"])
def test_a_result_declaring_a_huge_tensor_is_refused_by_name_before_anything_is_decoded(tmp_path, method):
    shapes = {"level0.module0/w": HUGE, "level0.module0/b": [3]}
    prefix = inner_header(method, shapes, data=4)
    bomb = zstd_frame(prefix, zeros=4 * BLOCK, claimed=len(prefix) + 4 * 10**15)  # zeros "all the way"
    store, task = stored(tmp_path, method, result_file(method, bomb))
    checks = ResultChecks(store, TOPOLOGY, resilience=ResilienceConfig())
    tracemalloc.start()
    try:
        reason = checks.check(task, 0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    suffix = {"none": ".safetensors"}.get(method, f".{method}.safetensors")
    assert reason is not None and f"path-0000{suffix}: level0.module0/w has shape {HUGE}, the module's is [4, 3]" in reason
    assert peak < 8 << 20  # nothing near the declared size was allocated


@pytest.mark.parametrize("method", ["int8", "int4", "topk"])
def test_a_frame_holding_more_than_its_tensors_take_is_refused_after_reading_only_that(tmp_path, method):
    """The frame declares the module's own shapes, then 64 MiB of zeros (valid zstd, claimed in its header)."""
    shapes = {"level0.module0/w": [4, 3], "level0.module0/b": [3]}
    prefix = inner_header(method, shapes, data=4)
    bomb = zstd_frame(prefix, zeros=512 * BLOCK, claimed=len(prefix) + 512 * BLOCK)
    assert len(zstandard.ZstdDecompressor().decompress(bomb)) == len(prefix) + 512 * BLOCK  # a valid frame
    store, task = stored(tmp_path, method, result_file(method, bomb))
    result = open_result(store, store_meta(store))
    assert result.declared["level0.module0/w"][1] == [4, 3]  # the header is honest: the declared check passes
    tracemalloc.start()
    try:
        with pytest.raises(StoreError, match="decompresses to more than the [0-9]+ bytes its tensors take"):
            result.decode(shapes={"level0.module0/w": [4, 3], "level0.module0/b": [3], "embeddings/e": [6, 4]})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20
    assert "decompresses to more" in ResultChecks(store, TOPOLOGY, resilience=ResilienceConfig()).check(task, 0)


def store_meta(store: ModuleStore) -> ResultMeta:
    return ResultMeta.from_json(store.read_json("results/round-000001/path-0000.json"), file="path-0000.json")


@pytest.mark.parametrize("method", ["int8", "int4", "topk"])
def test_honest_frames_decode_the_same_with_and_without_the_expected_shapes(method):
    g = torch.Generator().manual_seed(0)
    tensors = {"a/w": torch.randn(40, 30, generator=g), "a/b": torch.randn(7, generator=g), "b/s": torch.randn(())}
    data, _ = compress(tensors, method=method, topk=SPEC if method == "topk" else None)
    shapes = {name: list(t.shape) for name, t in tensors.items()}
    free, bounded = decompress(data, method=method)[0], decompress(data, method=method, shapes=shapes)[0]
    assert all(torch.equal(free[k], bounded[k]) for k in tensors)
    with pytest.raises(ValueError, match=r"a/w: declared shape \[40, 30\], expected \[30, 40\]"):
        decompress(data, method=method, shapes=shapes | {"a/w": [30, 40]})
    with pytest.raises(ValueError, match=r"missing \['c'\]"):
        decompress(data, method=method, shapes=shapes | {"c/x": [1]})
