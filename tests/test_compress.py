"""Compressed pseudo-gradients: round-trip error within the bound the scales imply, exact byte counts."""

import pytest
import torch
import zstandard

from dipaco.store.board import read_result, write_result
from dipaco.store.compress import compress, decompress, pack_int4, unpack_int4
from dipaco.store.module_store import ModuleStore

Q_MAX = {"int8": 127, "int4": 7}


def _delta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "level0.module1/w": torch.randn(33, 17, generator=g) * torch.logspace(-6, -2, 33)[:, None],  # rows of very different size
        "embeddings/b": torch.randn(7, generator=g) * 1e-3,  # odd length: int4 pads half a byte
        "embeddings/zero": torch.zeros(4, 3),
        "x/scalar": torch.tensor(0.5),
    }


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_round_trip_error_is_within_half_a_quantisation_step_per_row(method):
    delta = _delta()
    data, stats = compress(delta, method=method, level=1)
    back, _ = decompress(data, method=method)
    assert back.keys() == delta.keys()
    for name, x in delta.items():
        assert back[name].dtype == torch.float32 and back[name].shape == x.shape
        rows = x.reshape(x.shape[0] if x.dim() else 1, -1)
        step = rows.abs().amax(dim=1, keepdim=True) / Q_MAX[method]  # the scale the method must use
        err = (back[name].reshape(rows.shape) - rows).abs()
        assert torch.all(err <= step / 2 * (1 + 1e-6) + 1e-12), name
    assert torch.count_nonzero(back["embeddings/zero"]) == 0
    assert stats["bytes"] == len(data) and stats["raw_bytes"] == sum(4 * t.numel() for t in delta.values())


def test_none_is_exact_and_int4_is_smaller_than_int8():
    delta = _delta()
    back, _ = decompress(compress(delta, method="none")[0], method="none")
    for name in delta:
        torch.testing.assert_close(back[name], delta[name], rtol=0, atol=0)
    big = {"w": torch.randn(256, 256)}
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
    task = {"round": 3, "path": 1, "attempt": 2}
    delta = _delta()
    expected, _ = compress(delta, method=method, level=1)
    before = store.bytes_written
    stats = write_result(store, task, delta, {"tokens": 10}, compression=method, level=1)
    meta = store.read_json("results/round-000003/path-0001.a2.json")
    data_file = tmp_path / "store" / "results" / "round-000003" / meta["file"]
    json_file = tmp_path / "store" / "results" / "round-000003" / "path-0001.a2.json"
    assert stats["bytes"] == meta["bytes"] == len(expected) == data_file.stat().st_size
    assert store.bytes_written - before == data_file.stat().st_size + json_file.stat().st_size
    if method != "none":
        zstandard.ZstdDecompressor().decompress(data_file.read_bytes())  # it is a zstd frame
    before = store.bytes_read
    back, meta = read_result(store, 3, 1, 2)
    assert store.bytes_read - before == data_file.stat().st_size + json_file.stat().st_size
    ref, _ = decompress(expected, method=method)
    for name in delta:
        torch.testing.assert_close(back[name], ref[name], rtol=0, atol=0)
