"""The top-k codec (`compression.codec: topk`) against an independent numpy reimplementation: each chunk's
kept entries, their 2/4/8-bit levels, the error bound (a kept value within half its chunk's step, a dropped
one exactly its own value off), the packed codes, and the refusals of a tampered file, by name."""

import json
import math

import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.codec.compress import FORMAT, compress, decompress, part_sizes
from dipaco.codec.sparse import TopK, decode_tensor, encode_tensor, pack_codes, unpack_codes
from dipaco.store.board import ResultReader, read_result_as_stored, write_encoded_result
from dipaco.store.module_store import ModuleStore, StoreError
from dipaco.store.records import ResultMeta, Task


def _delta() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "level0.module0/w": torch.randn(40, 30, generator=g) * torch.logspace(-6, -2, 40)[:, None],  # 1200: 4 chunks of 256 + 176
        "level0.module0/b": torch.randn(300, generator=g) * 1e-3,  # one full chunk and a tail of 44
        "embeddings/small": torch.randn(7, generator=g),  # shorter than a chunk: one tail chunk keeping 1
        "embeddings/scalar": torch.tensor(-0.5),
    }


SPEC = TopK(density=0.05, bits=2, chunk=256)


def reference_topk(x: np.ndarray, *, density: float, bits: int, chunk: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(decoded (numel,), kept mask (numel,), each element's chunk step (numel,)) by numpy: per chunk of
    `chunk` elements keep ceil(density n) (at least 1) of the largest |x|, magnitudes rounded to the nearest
    of 2^(bits−1) levels spanning the kept magnitudes, signs kept."""
    flat = x.reshape(-1).astype(np.float32)
    decoded, kept, steps = np.zeros_like(flat), np.zeros(flat.size, bool), np.zeros_like(flat)
    levels = 2 ** (bits - 1)
    for start in range(0, flat.size, chunk):
        part = flat[start:start + chunk]
        k = min(part.size, max(1, math.ceil(density * part.size)))
        index = np.argsort(-np.abs(part), kind="stable")[:k]
        magnitude = np.abs(part[index])
        lo, hi = magnitude.min(), magnitude.max()
        step = (hi - lo) / np.float32(levels - 1)
        level = np.clip(np.round((magnitude - lo) / step), 0, levels - 1) if step > 0 else np.zeros(k)
        decoded[start + index] = np.where(part[index] < 0, -1, 1) * (lo + level * step)
        kept[start + index] = True
        steps[start:start + part.size] = step
    return decoded, kept, steps


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_each_chunk_keeps_its_largest_entries_at_the_levels_numpy_computes(bits):
    spec = TopK(density=0.05, bits=bits, chunk=256)
    delta = _delta()
    data, stats = compress(delta, method="topk", topk=spec)
    back, _ = decompress(data, method="topk")
    assert stats["bytes"] == len(data) and set(back) == set(delta)
    for name, x in delta.items():
        want, kept, steps = reference_topk(x.numpy(), density=spec.density, bits=bits, chunk=spec.chunk)
        got = back[name].reshape(-1).numpy()
        assert back[name].shape == x.shape and back[name].dtype == torch.float32
        assert not got[~kept].any()  # nothing but the kept entries comes back
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12)
        assert kept.sum() == sum(min(n, max(1, math.ceil(spec.density * n)))
                                 for n in [min(spec.chunk, x.numel() - s) for s in range(0, x.numel(), spec.chunk)])


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_a_kept_value_is_within_half_a_step_and_a_dropped_one_is_exactly_its_own_value_off(bits):
    spec = TopK(density=0.05, bits=bits, chunk=256)
    delta = _delta()
    back, _ = decompress(compress(delta, method="topk", topk=spec)[0], method="topk")
    for name, x in delta.items():
        _, kept, steps = reference_topk(x.numpy(), density=spec.density, bits=bits, chunk=spec.chunk)
        flat, got = x.reshape(-1).numpy(), back[name].reshape(-1).numpy()
        error = np.abs(flat - got)
        assert np.all(error[kept] <= steps[kept] / 2 * (1 + 1e-5) + 1e-12)
        assert np.all(np.sign(got[kept]) == np.sign(flat[kept]))
        assert np.array_equal(flat[~kept] - got[~kept], flat[~kept])  # the residual of a dropped entry: itself, exactly


def test_two_bits_are_the_sign_and_the_chunks_smallest_or_largest_kept_magnitude():
    x = torch.tensor([0.1, -5.0, 0.2, 3.5, -4.0, 0.0, 1.0, -0.3])
    back = decode_tensor(encode_tensor(x, TopK(density=0.5, bits=2, chunk=8)), shape=[8],
                         spec=TopK(density=0.5, bits=2, chunk=8), name="x")
    # kept: -5, 3.5, -4, 1 (4 of 8); lo = 1, hi = 5: 3.5 → 5 (nearer than 1), -4 → -5, 1 → 1
    assert back.tolist() == [0.0, -5.0, 0.0, 5.0, -5.0, 0.0, 1.0, 0.0]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_codes_pack_low_bits_first_like_numpy(bits):
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 2 ** bits, size=37).astype(np.uint8)
    per = 8 // bits
    padded = np.concatenate([codes, np.zeros(-len(codes) % per, np.uint8)]).reshape(-1, per)
    want = np.bitwise_or.reduce(padded.astype(np.uint16) << (np.arange(per) * bits), axis=1).astype(np.uint8)
    packed = pack_codes(torch.from_numpy(codes), bits)
    assert packed.numpy().tolist() == want.tolist()
    assert unpack_codes(packed, len(codes), bits).numpy().tolist() == codes.tolist()


def test_the_bytes_are_reproducible_and_much_smaller_than_float32():
    g = torch.Generator().manual_seed(1)
    delta = {"m/w": torch.randn(256, 256, generator=g) * 1e-3}
    data, stats = compress(delta, method="topk", topk=TopK(density=0.03, bits=2, chunk=4096))
    assert data == compress(delta, method="topk", topk=TopK(density=0.03, bits=2, chunk=4096))[0]
    assert stats["ratio"] > 60  # 3% of the entries at 2 bits plus their offsets


def test_topk_needs_its_settings_and_other_codecs_refuse_them():
    with pytest.raises(ValueError, match="needs top-k settings"):
        compress(_delta(), method="topk")
    with pytest.raises(ValueError, match="takes no top-k settings"):
        compress(_delta(), method="int8", topk=SPEC)
    with pytest.raises(ValueError, match="bits must be one of"):
        TopK(density=0.1, bits=3, chunk=64)


# --- refusals -------------------------------------------------------------------------------------
def _tampered(delta: dict[str, torch.Tensor], name: str, change) -> bytes:
    """The topk file of `delta` with `change(parts)` applied to tensor `name`'s stored parts (a dishonest island)."""
    data, _ = compress(delta, method="topk", topk=SPEC)
    frames = load_safetensors(data)
    module = name.partition("/")[0]
    payload = zstandard.ZstdDecompressor().decompress(frames[module].numpy().tobytes())
    meta = json.loads(json.loads(payload[8:8 + int.from_bytes(payload[:8], "little")])["__metadata__"]["dipaco"])
    blob = load_safetensors(payload)  # format 3: each part, the tensors' pieces in the order of meta["names"]
    at = {p: 0 for p in blob}
    for other, shape in zip(meta["names"], meta["shapes"], strict=True):
        if other == name:
            break
        for p, n in part_sizes(shape, method="topk", topk=SPEC).items():
            at[p] += n
    sizes = part_sizes(meta["shapes"][meta["names"].index(name)], method="topk", topk=SPEC)
    parts = {p: blob[p][at[p]:at[p] + sizes[p]].clone() for p in blob}
    change(parts)
    blob = {p: torch.cat([blob[p][:at[p]], parts[p], blob[p][at[p] + sizes[p]:]]) for p in blob}
    frame = zstandard.ZstdCompressor().compress(save_safetensors(blob, metadata={"dipaco": json.dumps(meta)}))
    frames[module] = torch.frombuffer(bytearray(frame), dtype=torch.uint8)
    return save_safetensors(frames, metadata={"dipaco": json.dumps({"method": "topk", "format": FORMAT})})


def _set_gap(index: int, value: int):
    """Set the `index`-th uint16 gap (its low and high byte planes) to `value`."""
    def change(parts):
        n = parts["gaps"].numel() // 2
        parts["gaps"][index], parts["gaps"][n + index] = value & 0xFF, value >> 8
    return change


def _set_scale(value: float):
    def change(parts):
        parts["step"][1] = value
    return change


NAME = "level0.module0/w"  # 4 full chunks of 256 keeping 13 each, then 176 keeping 9
CASES = {
    "duplicate": (_set_gap(13 + 5, 0), f"{NAME}: chunk 1: duplicate index"),  # the 6th offset of chunk 1 repeats the 5th
    "out of range": (_set_gap(13 * 4 + 8, 200), f"{NAME}: chunk 4: index .* out of range .*176 elements"),
    "nan scale": (_set_scale(float("nan")), f"{NAME}: chunk 1: scale step = nan"),
    "infinite scale": (_set_scale(float("inf")), f"{NAME}: chunk 1: scale step = inf"),
    "negative scale": (_set_scale(-1.0), f"{NAME}: chunk 1: scale step = -1.0"),
    "short codes": (lambda p: p.update(codes=p["codes"][:-1]), "part 'codes' holds [0-9]+ elements, its tensors take"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_tampered_sparse_result_is_refused_naming_the_file_tensor_and_chunk(tmp_path, case):
    change, message = CASES[case]
    data = _tampered(_delta(), NAME, change)
    with pytest.raises(ValueError, match=message):
        decompress(data, method="topk")
    store = ModuleStore(f"file://{tmp_path}/store")
    task = Task.open(path=0, base=0, step_offset=0, inner_from=None)
    meta = ResultMeta(path=0, round=1, base=0, attempt=0, tokens=1, train_loss=1.0, losses=(1.0,), val_loss_start=1.0,
                      seconds=1.0, bytes_down_modules=0, bytes_down_inner=0, inner_state_local=False,
                      data_parallel_ranks=1)
    meta = write_encoded_result(store, task, data, meta, compression="topk")
    with pytest.raises(StoreError, match=rf"path-0000\.topk\.safetensors is not a valid topk pseudo-gradient: {message}"):
        read_result_as_stored(store, meta)  # what the coordinator's acceptance reads
    with pytest.raises(StoreError, match=rf"path-0000\.topk\.safetensors .*{message}"):
        ResultReader(store, meta).module("level0.module0")  # what the outer step reads
    assert ResultReader(store, meta).module("embeddings").keys() == {"small", "scalar"}  # the other module is intact


@pytest.mark.parametrize("override, message", [
    ("compression.bits=3", r"compression.bits must be one of \[2, 4, 8\], got 3"),
    ("compression.density=0", r"compression.density must be in \(0, 1\], got 0.0"),
    ("compression.chunk=100000", r"compression.chunk must be in \[64, 65536\], got 100000"),
    ("compression.codec=top1", r"compression.codec .*must be one of \['none', 'int8', 'int4', 'topk'\]"),
])
def test_the_topk_settings_are_checked_naming_the_key(override, message):
    from cli_helpers import TINY

    from dipaco.config import load_config

    with pytest.raises(ValueError, match=message):
        load_config(TINY, [override])
