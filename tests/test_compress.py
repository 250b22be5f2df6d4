"""Compressed pseudo-gradients against an independent numpy quantiser: one scale per row of a matrix, one
per vector or scalar; round-trip error within half a step; reproducible bytes; exact byte counts."""

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as load_safetensors

from dipaco.codec.compress import compress, decompress, dequantize_rows, pack_int4, quantize_rows, unpack_int4
from dipaco.store.board import ResultReader, read_result, write_result
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import ResultMeta, Task

Q_MAX = {"int8": 127, "int4": 7}


def _delta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "level0.module1/w": torch.randn(33, 17, generator=g) * torch.logspace(-6, -2, 33)[:, None],  # rows of very different size
        "level0.module1/b": torch.randn(1000, generator=g) * torch.logspace(-6, -2, 1000),  # a vector: one row, one scale
        "embeddings/b": torch.randn(7, generator=g) * 1e-3,  # odd length: int4 pads half a byte
        "embeddings/zero": torch.zeros(4, 3),
        "x/scalar": torch.tensor(0.5),
    }


def reference_rows(x: np.ndarray) -> np.ndarray:
    """The rows the format promises: a matrix's rows; a vector or a scalar is a single row."""
    return x.reshape(x.shape[0], -1) if x.ndim >= 2 else x.reshape(1, -1)


def reference_quantise(x: np.ndarray, q_max: int) -> tuple[np.ndarray, np.ndarray]:
    """(scales (rows,), x as it comes back (rows, cols)) by numpy: scale = max|row| / q_max, values rounded to
    the nearest multiple of the scale."""
    rows = reference_rows(x.astype(np.float32))
    scale = np.abs(rows).max(axis=1) / np.float32(q_max)
    safe = np.where(scale > 0, scale, np.float32(1))
    back = np.clip(np.round(rows / safe[:, None]), -q_max, q_max) * scale[:, None]
    return scale, back


def stored_scales(data: bytes) -> dict[str, torch.Tensor]:
    """Every tensor's stored scales, read from the file's per-module zstd frames (format 3: a module's scales
    concatenated in the order its metadata lists the names, one per row: a 2-D tensor's first dimension)."""
    scales = {}
    for frame in load_safetensors(data).values():
        payload = zstandard.ZstdDecompressor().decompress(frame.numpy().tobytes())
        meta = json.loads(safe_open_metadata(payload)["dipaco"])
        flat, start = load_safetensors(payload)["scale"], 0
        for name, shape in zip(meta["names"], meta["shapes"], strict=True):
            rows = shape[0] if len(shape) >= 2 and shape[0] > 0 else 1
            scales[name], start = flat[start:start + rows], start + rows
        assert start == flat.numel()
    return scales


def safe_open_metadata(payload: bytes) -> dict:
    size = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8:8 + size])["__metadata__"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_each_row_has_one_scale_and_the_error_is_within_half_its_step(method):
    delta = _delta()
    q_max = Q_MAX[method]
    data, stats = compress(delta, method=method, level=1)
    back, _ = decompress(data, method=method)
    scales = stored_scales(data)
    assert back.keys() == delta.keys() == scales.keys()
    assert {name: s.numel() for name, s in scales.items()} == {
        "level0.module1/w": 33, "level0.module1/b": 1, "embeddings/b": 1, "embeddings/zero": 4, "x/scalar": 1}
    for name, x in delta.items():
        assert back[name].dtype == torch.float32 and back[name].shape == x.shape
        x = x.numpy()
        rows = reference_rows(x)
        bound = np.abs(rows).max(axis=1, keepdims=True) / q_max / 2  # half a quantisation step, per row
        err = np.abs(reference_rows(back[name].numpy()) - rows)
        assert np.all(err <= bound * (1 + 1e-6)), name
        scale, expected = reference_quantise(x, q_max)
        np.testing.assert_allclose(scales[name].numpy(), scale, rtol=1e-6, atol=0, err_msg=name)
        np.testing.assert_allclose(reference_rows(back[name].numpy()), expected, rtol=1e-6, atol=0, err_msg=name)
    # one scale for the whole vector: its small elements round to zero (they would not with a scale each)
    assert torch.count_nonzero(back["level0.module1/b"][:100]) == 0
    assert torch.count_nonzero(back["embeddings/zero"]) == 0
    assert stats["bytes"] == len(data) and stats["raw_bytes"] == sum(4 * t.numel() for t in delta.values())


def test_none_is_exact():
    delta = _delta()
    back, _ = decompress(compress(delta, method="none")[0], method="none")
    for name in delta:
        torch.testing.assert_close(back[name], delta[name], rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(256, 256), (65536,)])
def test_int4_is_smaller_than_int8_is_smaller_than_float32(shape):
    big = {"w": torch.randn(shape, generator=torch.Generator().manual_seed(0))}
    sizes = {m: compress(big, method=m)[1]["bytes"] for m in ("none", "int8", "int4")}
    assert sizes["int4"] < sizes["int8"] < sizes["none"]
    assert sizes["int8"] < 0.3 * sizes["none"] and sizes["int4"] < 0.16 * sizes["none"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_compressed_bytes_are_reproducible(method):
    assert len({compress(_delta(), method=method)[0] for _ in range(8)}) == 1


def test_int4_packs_two_values_per_byte():
    q = torch.tensor([-7, 7, 0, 3, -1], dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.numel() == 3
    assert packed[0].item() == (-7 + 8) | ((7 + 8) << 4)
    assert torch.equal(unpack_int4(packed, 5), q)


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_the_byte_counter_equals_the_compressed_bytes_on_disk(tmp_path, method):
    store = ModuleStore(str(tmp_path / "store"))
    task = replace(Task.open(path=1, base=2, step_offset=0, inner_from=None), attempt=2)  # round 3
    meta = ResultMeta(path=1, round=3, base=2, attempt=2, tokens=10, train_loss=2.5, losses=(3.0, 2.0),
                      val_loss_start=3.5, seconds=1.5, bytes_down_modules=0, bytes_down_inner=0,
                      inner_state_local=False, data_parallel_ranks=1)
    delta = _delta()
    expected, _ = compress(delta, method=method, level=1)
    before = store.bytes_written
    written, stats = write_result(store, task, delta, meta, compression=method, level=1)
    folder = tmp_path / "store" / "results" / "round-000003"
    data_file, json_file = folder / written.file, folder / "path-0001.a2.json"
    assert stats["bytes"] == written.bytes == len(expected) == data_file.stat().st_size
    assert store.bytes_written - before == data_file.stat().st_size + json_file.stat().st_size
    before = store.bytes_read
    back, _ = read_result(store, round=3, path=1, attempt=2)
    assert store.bytes_read - before == data_file.stat().st_size + json_file.stat().st_size
    ref, _ = decompress(expected, method=method)
    for name in delta:
        torch.testing.assert_close(back[name], ref[name], rtol=0, atol=0)


def _meta(task: Task) -> ResultMeta:
    return ResultMeta(path=task.path, round=task.round, base=task.base, attempt=task.attempt, tokens=10, train_loss=2.5,
                      losses=(2.5,), val_loss_start=3.0, seconds=1.0, bytes_down_modules=0, bytes_down_inner=0,
                      inner_state_local=False, data_parallel_ranks=1)


@pytest.mark.parametrize("method", ["none", "int8", "int4"])
def test_one_module_is_read_alone_and_decodes_to_the_same_floats(tmp_path, method):
    store = ModuleStore(str(tmp_path / "store"))
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    delta = _delta()
    meta, _ = write_result(store, task, delta, _meta(task), compression=method, level=1)
    whole, _ = read_result(store, round=1, path=0, attempt=0)
    reader = ResultReader(store, meta)
    assert sorted(reader.index.spans) == ["embeddings", "level0.module1", "x"]
    for module in reader.index.spans:
        before = store.bytes_read
        part = reader.module(module)
        start, end = reader.index.spans[module]
        assert store.bytes_read - before == end - start < meta.bytes  # only this module's bytes
        expected = {k.partition("/")[2]: v for k, v in whole.items() if k.startswith(f"{module}/")}
        assert part.keys() == expected.keys()
        for name, tensor in part.items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, expected[name]), (module, name)
    if method != "none":  # the same quantisation as one tensor on its own: the format changes bytes, not values
        q, scale = quantize_rows(delta["level0.module1/w"], bits=int(method[3:]))
        assert torch.equal(reader.module("level0.module1")["w"], dequantize_rows(q.float(), scale, [33, 17]))
    with pytest.raises(StoreError, match="has no module 'level9.module0'"):
        reader.module("level9.module0")


def test_a_compressed_result_of_the_old_single_frame_format_is_refused_naming_the_file(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    meta, _ = write_result(store, task, _delta(), _meta(task), compression="int8", level=1)
    data_file = tmp_path / "store" / "results" / "round-000001" / meta.file
    data_file.write_bytes(zstandard.ZstdCompressor().compress(data_file.read_bytes()))  # one frame around it all
    with pytest.raises(StoreError, match=r"path-0000\.int8\.safetensors"):
        ResultReader(store, meta)
