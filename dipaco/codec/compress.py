"""Compressed pseudo-gradients: per-row int8 / int4 quantisation or sparse top-k, then zstd (`compression.codec`).

    from dipaco.codec.compress import compress, decompress
    data, stats = compress({"embeddings/w": delta}, method="int8")   # bytes an island uploads
    tensors, _ = decompress(data, method="int8")                     # float32 again, on the coordinator
    data, stats = compress(tensors, method="topk", topk=TopK(density=0.03, bits=2, chunk=4096))

Each tensor is viewed as rows: a tensor of two or more dimensions has one row per index of its first
dimension; a vector or a scalar is one row (one scale). A row's scale is
max|x| / q_max (q_max = 127 for int8, 7 for int4) and its values are rounded to the nearest integer
multiple of the scale, so every element is off by at most scale / 2. int4 values are stored as
q + 8 in one nibble, two per byte. `none` is the plain float32 safetensors file, as before
compression existed. `topk` keeps the largest-magnitude `density` of each chunk of a tensor at `bits`
bits each (`dipaco.codec.sparse`, whose docstring defines the format). Decompression always yields
float32, and the coordinator accumulates in float32.

Tensors are named "module/param". A compressed file (format 3) is a safetensors file with one uint8
entry per module: a zstd frame (level `compression.zstd_level`) of a safetensors blob with that module's
parts (`PARTS`: int8 / int4 values and float32 scales; top-k gaps, codes, lo and step), each part its tensors'
pieces concatenated in the order of the tensors' names, sorted; the blob's metadata lists the names and
shapes (for `topk` also its density, bits and chunk, so a reader needs no settings), from which a reader
cuts each part back into the tensors' pieces (`part_sizes`). So one module can be read and decoded
without the rest, as the coordinator's outer step does (it streams module by module):

    index = read_index(head, method="int8")            # head: the file's first header_size(...) bytes
    start, end = index.spans["embeddings"]             # the byte range to read from the file
    params = decode_module(index, "embeddings", data[start:end])   # {"w": float32 tensor}

A frame is decompressed as a stream: its header first (`declared_tensors` reads only that), then at most
the bytes the tensors it declares take, so a frame of zeros claiming a huge size allocates nothing;
`decompress(..., shapes=...)` also refuses a frame that declares other shapes than expected.
(Format 1 held the whole result in one zstd frame, format 2 an entry per tensor and part, whose header
cost 15% of a top-k frame; readers refuse both by name.)

Run `python -m dipaco.codec.compress` to print the sizes and errors for a random pseudo-gradient.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import torch
import zstandard
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from dipaco.codec.registry import NAMES
from dipaco.codec.sparse import TopK, decode_tensor, encode_tensor

METHODS = NAMES  # the codecs this module encodes and decodes (`dipaco.codec.registry`)
Q_MAX = {"int8": 127, "int4": 7}


def quantize_rows(x: torch.Tensor, *, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` (any shape) → (integers in [−q_max, q_max] as int8, shape (rows, cols); float32 scales (rows,))."""
    q_max = Q_MAX[f"int{bits}"]
    rows = x.detach().float().reshape(x.shape[0] if x.dim() >= 2 and x.shape[0] > 0 else 1, -1)  # a vector is one row
    scale = rows.abs().amax(dim=1) / q_max
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(rows / safe[:, None]).clamp_(-q_max, q_max).to(torch.int8)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, shape: list[int]) -> torch.Tensor:
    return (q.float() * scale[:, None]).reshape(shape)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [−7, 7] → uint8, two per byte (low nibble first); an odd count is padded."""
    flat = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, torch.full((1,), 8, dtype=torch.uint8)])
    return flat[0::2] | (flat[1::2] << 4)


def unpack_int4(packed: torch.Tensor, numel: int) -> torch.Tensor:
    low = (packed & 0x0F).to(torch.int16) - 8
    high = (packed >> 4).to(torch.int16) - 8
    return torch.stack([low, high], dim=1).reshape(-1)[:numel].to(torch.int8)


FORMAT = 3  # of compressed files: one zstd frame per module, a part's pieces concatenated (module docstring)
PARTS = {"int8": ("q", "scale"), "int4": ("q", "scale"), "topk": ("gaps", "codes", "lo", "step")}
FLOAT_PARTS = ("scale", "lo", "step")  # float32; the other parts are bytes
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}


def module_of(name: str) -> str:
    """The module a tensor name "module/param" belongs to."""
    return name.partition("/")[0]


def compress(tensors: dict[str, torch.Tensor], *, method: str, level: int = 1,
             topk: TopK | None = None) -> tuple[bytes, dict]:
    """Serialise a pseudo-gradient `{"module/param": tensor}`; returns (bytes to send, stats). `topk`: the
    sparsification, required by (and only by) method "topk"."""
    if method not in METHODS:
        raise ValueError(f"compression method must be one of {METHODS}, got {method!r}")
    if (method == "topk") != (topk is not None):
        raise ValueError(f"compression method {method!r} " + ("needs" if topk is None else "takes no") + " top-k settings")
    raw_bytes = sum(t.numel() * 4 for t in tensors.values())
    if method == "none":
        data = save_safetensors({k: v.detach().float().contiguous() for k, v in tensors.items()})
        return data, {"method": method, "raw_bytes": raw_bytes, "bytes": len(data), "ratio": raw_bytes / max(1, len(data))}
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        modules.setdefault(module_of(name), {})[name] = tensor
    frames = {module: torch.frombuffer(bytearray(_compress_module(part, method=method, level=level, topk=topk)),
                                       dtype=torch.uint8)
              for module, part in modules.items()}
    data = save_safetensors(frames, metadata={"dipaco": json.dumps({"method": method, "format": FORMAT})})
    return data, {"method": method, "raw_bytes": raw_bytes, "bytes": len(data), "ratio": raw_bytes / max(1, len(data))}


def _compress_module(tensors: dict[str, torch.Tensor], *, method: str, level: int, topk: TopK | None) -> bytes:
    """One module's tensors → one zstd frame of a safetensors blob of its parts (module docstring)."""
    names = sorted(tensors)
    pieces: dict[str, list[torch.Tensor]] = {part: [] for part in PARTS[method]}
    for name in names:
        if topk is not None:
            encoded = encode_tensor(tensors[name], topk)
        else:
            q, scale = quantize_rows(tensors[name], bits=8 if method == "int8" else 4)
            encoded = {"q": q if method == "int8" else pack_int4(q), "scale": scale}
        for part, value in encoded.items():
            pieces[part].append(value.reshape(-1))
    blob = {part: torch.cat(values) if values else torch.zeros(0, dtype=torch.float32 if part in FLOAT_PARTS
                                                                  else torch.uint8)
            for part, values in pieces.items()}
    meta = ({"method": method, "names": names, "shapes": [list(tensors[n].shape) for n in names]}
            | ({"topk": topk.to_json()} if topk is not None else {}))
    # one metadata key: safetensors writes a header map in arbitrary order, and the bytes must be reproducible
    payload = save_safetensors({k: v.contiguous() for k, v in blob.items()}, metadata={"dipaco": json.dumps(meta)})
    return zstandard.ZstdCompressor(level=level).compress(payload)


def _decompress_module(frame: bytes, *, method: str,
                       shapes: dict[str, list[int]] | None = None) -> dict[str, torch.Tensor]:
    """A frame of `_compress_module` → `{"module/param": float32 tensor}`. Decompression stops at the bytes the
    tensors its header declares take (with `shapes`, `{"module/param": shape}`, only those shapes are accepted,
    before any tensor is decompressed): a frame cannot make its reader allocate more than that."""
    with zstandard.ZstdDecompressor().stream_reader(frame) as reader:
        head, meta = _frame_header(reader, method=method)
        declared = _declared(meta)
        if shapes is not None:
            _check_shapes(declared, shapes)
        spec = _topk_spec(meta) if method == "topk" else None
        _read_at_most(reader, _data_bytes(declared, method=method, topk=spec), out=head)  # appended to the header
    payload = bytes(head)  # safetensors reads bytes: one copy, as zstd's own decompress made
    del head
    blob = load_safetensors(payload)
    del payload
    out = {}
    for name, parts in _split(blob, declared, method=method, topk=spec).items():
        shape = declared[name]
        if spec is not None:
            out[name] = decode_tensor(parts, shape=shape, spec=spec, name=name)
            continue
        numel, rows = math.prod(shape), parts["scale"].numel()
        q = parts["q"].view(torch.int8) if method == "int8" else unpack_int4(parts["q"], numel)
        out[name] = dequantize_rows(q.reshape(rows, numel // rows if rows else 0), parts["scale"], shape)
    return out


def part_sizes(shape: list[int], *, method: str, topk: TopK | None) -> dict[str, int]:
    """The elements of each part (`PARTS[method]`) a tensor of `shape` takes in a frame."""
    numel = math.prod(shape)
    if topk is not None:
        segments = topk.segments(numel)
        chunks, kept = sum(s[0] for s in segments), sum(s[0] * s[2] for s in segments)
        return {"gaps": 2 * kept, "codes": -(-kept * topk.bits // 8), "lo": chunks, "step": chunks}
    rows = shape[0] if len(shape) >= 2 and shape[0] > 0 else 1
    return {"q": numel if method == "int8" else (numel + 1) // 2, "scale": rows}


def _split(blob: dict[str, torch.Tensor], declared: dict[str, list[int]], *, method: str,
           topk: TopK | None) -> dict[str, dict[str, torch.Tensor]]:
    """A frame's parts cut into each declared tensor's pieces (ValueError when a part's length is not theirs)."""
    if set(blob) != set(PARTS[method]):
        raise ValueError(f"a {method} frame holds parts {sorted(blob)}, not {sorted(PARTS[method])}")
    sizes = {name: part_sizes(shape, method=method, topk=topk) for name, shape in declared.items()}
    out: dict[str, dict[str, torch.Tensor]] = {name: {} for name in declared}
    for part, values in blob.items():
        flat = values.reshape(-1)
        wanted = sum(s[part] for s in sizes.values())
        if flat.numel() != wanted:
            raise ValueError(f"part {part!r} holds {flat.numel()} elements, its tensors take {wanted}")
        start = 0
        for name in declared:
            out[name][part] = flat[start:start + sizes[name][part]]
            start += sizes[name][part]
    return out


# --- a frame's header, read before its tensors -----------------------------------------------------
MAX_FRAME_HEADER = 16 << 20  # bytes a module frame's safetensors header may take (names, shapes, offsets)
READ_CHUNK = 64 << 20  # bytes decompressed per read: memory grows with what a frame holds, not what it claims


def _frame_header(reader, *, method: str) -> tuple[bytearray, dict]:
    """The first bytes a frame decompresses to, its safetensors header, and the metadata in it."""
    head = _read_exactly(reader, 8)
    size = int.from_bytes(head, "little")
    if size > MAX_FRAME_HEADER:
        raise ValueError(f"a module frame's header claims {size} bytes, more than the {MAX_FRAME_HEADER} allowed")
    head += _read_exactly(reader, size)
    meta = json.loads(json.loads(bytes(head[8:])).get("__metadata__", {}).get("dipaco", "{}"))
    if meta.get("method") != method:
        raise ValueError(f"pseudo-gradient was compressed with {meta.get('method')!r}, not {method!r}")
    return head, meta


def _declared(meta: dict) -> dict[str, list[int]]:
    """`{"module/param": shape}` a frame's metadata declares, in its order (ValueError when the names are not
    distinct strings or a shape is not a list of sizes)."""
    names, shapes = meta.get("names"), meta.get("shapes")
    if not (isinstance(names, list) and isinstance(shapes, list) and len(names) == len(shapes)):
        raise ValueError(f"a module frame declares names {str(names)[:80]} and shapes {str(shapes)[:80]}, "
                         "not two lists of one length")
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError(f"a module frame's names {names[:6]} are not distinct strings")
    for name, shape in zip(names, shapes, strict=True):
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise ValueError(f"{name}: shape {shape!r} is not a list of sizes")
    return dict(zip(names, shapes, strict=True))


def _check_shapes(declared: dict[str, list[int]], shapes: dict[str, list[int]]) -> None:
    """Refuse a frame that does not declare exactly `shapes`, naming the tensor and both shapes."""
    for name, shape in declared.items():
        if name not in shapes:
            raise ValueError(f"{name}: declared with shape {shape}, but no such tensor is expected")
        if list(shape) != list(shapes[name]):
            raise ValueError(f"{name}: declared shape {shape}, expected {list(shapes[name])}")
    missing = sorted(set(shapes) - set(declared))
    if missing:
        raise ValueError(f"{missing[0]}: expected with shape {list(shapes[missing[0]])}, not in the frame")


def _topk_spec(meta: dict) -> TopK:
    settings = meta.get("topk")
    if not isinstance(settings, dict):
        raise ValueError(f"a topk frame's settings are {settings!r}, not an object")
    return TopK(**{k: settings.get(k) for k in ("density", "bits", "chunk")})


def _data_bytes(shapes: dict[str, list[int]], *, method: str, topk: TopK | None) -> int:
    """The bytes of the parts after a frame's header that encode tensors of `shapes` with `method`."""
    total = 0
    for shape in shapes.values():
        total += sum(n * (4 if part in FLOAT_PARTS else 1)
                     for part, n in part_sizes(shape, method=method, topk=topk).items())
    return total


def _read_exactly(reader, size: int) -> bytearray:
    out = _read_at_most(reader, size, stop=True)
    if len(out) < size:
        raise ValueError(f"a module frame ends after {len(out)} of the {size} bytes of its header")
    return out


def _read_at_most(reader, size: int, *, stop: bool = False, out: bytearray | None = None) -> bytearray:
    """Up to `size` bytes from a zstd stream reader, appended to `out` (a new bytearray by default); a
    ValueError when more follow (unless `stop`: the rest is left unread)."""
    out = bytearray() if out is None else out
    start = len(out)
    want = size if stop else size + 1  # one byte past the limit tells a frame that holds more
    while len(out) - start < want:
        chunk = reader.read(min(READ_CHUNK, want - (len(out) - start)))
        if not chunk:
            break
        out += chunk
    if len(out) - start > size:
        raise ValueError(f"a module frame decompresses to more than the {size} bytes its tensors take")
    return out


def decompress(data: bytes, *, method: str,
               shapes: dict[str, list[int]] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Bytes from `compress` → (`{name: float32 tensor}`, stats): the whole pseudo-gradient at once. With
    `shapes` (`{"module/param": shape}`) a compressed file must hold exactly those tensors, each module's frame
    checked before it is decompressed (a `none` file: compare `declared_tensors` first)."""
    if method == "none":
        return {k: v.float() for k, v in load_safetensors(data).items()}, {"method": method, "bytes": len(data)}
    index = read_index(data[: header_size(data[:8])], method=method)
    if shapes is not None:
        _check_modules(index, {module_of(name) for name in shapes})
    out: dict[str, torch.Tensor] = {}
    for module, (start, end) in index.spans.items():
        part = None if shapes is None else {k: v for k, v in shapes.items() if module_of(k) == module}
        out.update(_module_tensors(module, _decompress_module(data[start:end], method=method, shapes=part)))
    return out, {"method": method, "bytes": len(data)}


def declared_tensors(data: bytes, index: Index) -> dict[str, tuple[torch.dtype, list[int]]]:
    """`{"module/param": (dtype, shape)}` a file from `compress` declares, nothing decoded: a `none` file's
    from its index, a compressed file's from each module frame's header (float32: what it decodes to)."""
    if index.method == "none":
        return {name: (dtype, shape) for name, (dtype, shape, _, _) in index.tensors.items()}
    out = {}
    for module, (start, end) in index.spans.items():
        with zstandard.ZstdDecompressor().stream_reader(data[start:end]) as reader:
            _, meta = _frame_header(reader, method=index.method)
        out |= {name: (torch.float32, shape) for name, shape in _module_tensors(module, _declared(meta)).items()}
    return out


def _module_tensors(module: str, tensors: dict) -> dict:
    """`tensors` ("module/param" -> anything), refused when one is not of `module` (its frame holds only its own)."""
    stray = [name for name in tensors if module_of(name) != module]
    if stray:
        raise ValueError(f"module {module!r}'s frame holds {stray[0]!r}, a tensor of another module")
    return tensors


def _check_modules(index: Index, modules: set[str]) -> None:
    missing, unexpected = sorted(modules - set(index.spans)), sorted(set(index.spans) - modules)
    if missing or unexpected:
        raise ValueError(f"the file's modules are not the expected ones (missing {missing[:3]}, unexpected {unexpected[:3]})")


# --- one module at a time --------------------------------------------------------------------------
def header_size(first8: bytes) -> int:
    """The bytes before a safetensors file's tensor data (8 + its JSON header), from its first 8 bytes."""
    if len(first8) < 8:
        raise ValueError(f"a safetensors file starts with 8 bytes of header length, got {len(first8)} bytes")
    return 8 + int.from_bytes(first8[:8], "little")


@dataclass(frozen=True)
class Index:
    """Where each module's bytes lie in a file from `compress`, read from its safetensors header."""

    method: str
    spans: dict[str, tuple[int, int]]  # module -> [start, end) in the file
    tensors: dict[str, tuple[torch.dtype, list[int], int, int]]  # `none` only: "module/param" -> dtype, shape, [start, end)


def read_index(head: bytes, *, method: str) -> Index:
    """The index of a file from `compress` given its first `header_size` bytes (no tensor data needed)."""
    if method not in METHODS:
        raise ValueError(f"compression method must be one of {METHODS}, got {method!r}")
    header = _header(head)
    base = header_size(head)
    entries = {name: e for name, e in header.items() if name != "__metadata__"}
    if method != "none":
        meta = json.loads(header.get("__metadata__", {}).get("dipaco", "{}"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"compressed pseudo-gradient format {meta.get('format')!r}; this dipaco reads format {FORMAT}")
        if meta.get("method") != method:
            raise ValueError(f"pseudo-gradient was compressed with {meta.get('method')!r}, not {method!r}")
        spans = {module: (base + e["data_offsets"][0], base + e["data_offsets"][1]) for module, e in entries.items()}
        return Index(method=method, spans=spans, tensors={})
    tensors, spans = {}, {}
    for name, e in entries.items():
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"tensor {name!r} has dtype {e['dtype']}, not one of {sorted(_DTYPES)}")
        start, end = base + e["data_offsets"][0], base + e["data_offsets"][1]
        tensors[name] = (_DTYPES[e["dtype"]], e["shape"], start, end)
        first, last = spans.get(module_of(name), (start, end))
        spans[module_of(name)] = (min(first, start), max(last, end))
    # safetensors orders tensors of one dtype by name, so a module's tensors are contiguous and its span
    # holds nothing else; were they not, the span would only read more bytes than needed
    return Index(method=method, spans=spans, tensors=tensors)


def decode_module(index: Index, module: str, chunk: bytes) -> dict[str, torch.Tensor]:
    """`{param: float32 tensor}` of one module from `chunk`, the file's bytes in `index.spans[module]`."""
    start, end = index.spans[module]
    if len(chunk) != end - start:
        raise ValueError(f"module {module!r} spans {end - start} bytes, got {len(chunk)}")
    prefix = f"{module}/"
    if index.method != "none":
        tensors = _module_tensors(module, _decompress_module(chunk, method=index.method))
        return {k.removeprefix(prefix): v for k, v in tensors.items()}
    view = memoryview(chunk)
    out = {}
    for name, (dtype, shape, first, last) in index.tensors.items():
        if module_of(name) == module:
            data = bytearray(view[first - start : last - start])  # a writable copy for torch.frombuffer
            tensor = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            out[name.removeprefix(prefix)] = tensor.reshape(shape).float()
    return out


def _header(data: bytes) -> dict:
    return json.loads(data[8 : header_size(data[:8])])


if __name__ == "__main__":
    torch.manual_seed(0)
    delta = {"m/w": torch.randn(1024, 1024) * 1e-3, "m/b": torch.randn(1024) * 1e-4}  # a 4 MiB module
    settings = [(m, None) for m in METHODS if m != "topk"]
    settings += [("topk", TopK(density=d, bits=b, chunk=4096)) for d in (0.1, 0.03, 0.01) for b in (8, 4, 2)]
    for m, spec in settings:
        data, stats = compress(delta, method=m, topk=spec)
        back, _ = decompress(data, method=m)
        err = max((back[k] - delta[k]).abs().max().item() for k in delta)
        relative = math.sqrt(sum(float((back[k] - delta[k]).square().sum()) for k in delta)
                             / sum(float(delta[k].square().sum()) for k in delta))
        label = m if spec is None else f"topk {spec.density:g} {spec.bits}b"
        print(f"{label:14s} {stats['bytes']:8d} bytes  {stats['ratio']:6.1f}x smaller  max error {err:.2e}  "
              f"relative error {relative:.3f}")
