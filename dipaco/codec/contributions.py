"""A module's version as the round's results define it (`compression.download: results`): the encoded
contributions themselves travel down, as SparseLoCo's all-gather does, not a re-encoding of their average.

    data = pack("level0.module0", [Contribution(key, file, span, method, weight, table, chunk), ...])
    committed = apply_contributions(before, data, module="level0.module0")          # v+1, coordinator and islands
    entries, base = read_entries(head)        # what an island needs to fetch only the others' bytes

Where a round's outer step is a plain weighted average (outer lr 1, no momentum, no √ rescale), version v+1 of
a module is v − Σ_i w_i Δ_i over the results that touched it, each Δ_i decoded from the bytes its island
uploaded (a module's span of its result file). The coordinator copies those spans unchanged into one file,
`updates/<version>/<module>.results.safetensors`: a safetensors file of one uint8 entry per contribution ("0",
"1", ...) whose metadata lists, per contribution, the result's task key and file, the span it came from, its
codec, its weight w_i, the sha256 of its bytes and, for a float32 result, its tensors' table. Nothing is
re-encoded, so no download residual arises. An island that uploaded one of the contributions already holds its
bytes (checked by sha256) and fetches only the others' (ranged reads). `apply_contributions` sums the
decoded contributions in the listed order into a float32 zero tensor (`add_(Δ_i, alpha=w_i)`) and subtracts
the sum, on the CPU, so every reader rebuilds v+1 bit for bit.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from safetensors.torch import save as save_safetensors

from dipaco.codec.compress import Index, decode_module, header_size
from dipaco.codec.registry import NAMES

FORMAT = "results-1"
SUFFIX = ".results.safetensors"  # the file suffix of a module's contributions in updates/<version>/
Tensors = dict[str, torch.Tensor]
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class Contribution:
    """One result's share of a module's step: where its bytes came from, how to decode them, its weight."""

    key: str  # the task key of the result
    file: str  # the result file (store name) the bytes were copied from
    start: int  # [start, end): the module's span in that file
    end: int
    method: str  # the codec the result was encoded with
    weight: float  # w_i: the module steps by − w_i Δ_i
    sha256: str  # of the bytes
    table: dict[str, list] | None = None  # float32 results only: param -> [dtype name, shape, start, end] in the bytes

    @classmethod
    def of(cls, *, key: str, file: str, span: tuple[int, int], index: Index, module: str, weight: float,
           chunk: bytes) -> Contribution:
        """The contribution of `chunk` (bytes `span` of result `file`, whose header gave `index`)."""
        table = None
        if index.method == "none":
            prefix, (start, _) = f"{module}/", span
            table = {name.removeprefix(prefix): [str(dtype).removeprefix("torch."), shape, first - start, last - start]
                     for name, (dtype, shape, first, last) in index.tensors.items() if name.startswith(prefix)}
        return cls(key=key, file=file, start=span[0], end=span[1], method=index.method, weight=weight,
                   sha256=hashlib.sha256(chunk).hexdigest(), table=table)

    def decode(self, module: str, chunk: bytes) -> Tensors:
        """`{param: float32 tensor}`: Δ_i from its bytes (a ValueError when they are not the listed ones)."""
        if len(chunk) != self.end - self.start or hashlib.sha256(chunk).hexdigest() != self.sha256:
            raise ValueError(f"contribution {self.key} to module {module!r}: its bytes are not the listed ones "
                             f"({len(chunk)} bytes, {self.end - self.start} listed)")
        tensors = {}
        if self.table is not None:
            unknown = {dtype for dtype, *_ in self.table.values()} - set(DTYPES)
            if unknown:
                raise ValueError(f"contribution {self.key} to module {module!r}: dtypes {sorted(unknown)}, not of {list(DTYPES)}")
            tensors = {f"{module}/{p}": (DTYPES[dtype], shape, first, last)
                       for p, (dtype, shape, first, last) in self.table.items()}
        index = Index(method=self.method, spans={module: (0, len(chunk))}, tensors=tensors)
        return decode_module(index, module, chunk)


def pack(module: str, contributions: list[tuple[Contribution, bytes]]) -> bytes:
    """The file of module `module`'s contributions (each with its bytes), in the order they are summed."""
    if not contributions:
        raise ValueError(f"module {module!r}: a step from the results needs at least one contribution")
    tensors = {str(i): torch.frombuffer(bytearray(chunk), dtype=torch.uint8) if chunk else torch.zeros(0, dtype=torch.uint8)
               for i, (_, chunk) in enumerate(contributions)}
    meta = {"format": FORMAT, "module": module, "contributions": [asdict(c) for c, _ in contributions]}
    return save_safetensors(tensors, metadata={"dipaco": json.dumps(meta)})


def read_entries(head: bytes, *, module: str) -> tuple[list[tuple[Contribution, int, int]], int]:
    """From a contributions file's first `header_size` bytes: each contribution with the [start, end) of its
    bytes in the file, in the order they are summed; and the header's size. A ValueError names what is wrong."""
    size = header_size(head)
    header = json.loads(head[8:size])
    meta = json.loads(header.get("__metadata__", {}).get("dipaco", "{}"))
    if meta.get("format") != FORMAT or meta.get("module") != module:
        raise ValueError(f"not a contributions file of module {module!r} (format {meta.get('format')!r}, "
                         f"module {meta.get('module')!r})")
    out = []
    for i, fields in enumerate(meta["contributions"]):
        entry = Contribution(**fields)
        if entry.method not in NAMES:
            raise ValueError(f"contribution {entry.key} to module {module!r} names codec {entry.method!r}")
        first, last = header[str(i)]["data_offsets"]
        out.append((entry, size + first, size + last))
    return out, size


def apply_contributions(before: Tensors, data: bytes, *, module: str,
                        fetch: Callable[[Contribution, int, int], bytes] | None = None) -> Tensors:
    """Version v+1 of module `module` = `before` (v, `{param: tensor}`) − Σ_i w_i Δ_i over the contributions
    `data` lists: float32, CPU, in the listed order (the coordinator and every island run this). `data` is the
    whole file, or only its header when `fetch(contribution, start, end)` gives each contribution's bytes."""
    entries, _ = read_entries(data[:header_size(data[:8])], module=module)
    total = {p: torch.zeros(t.shape, dtype=torch.float32) for p, t in sorted(before.items())}
    for entry, start, end in entries:
        delta = entry.decode(module, fetch(entry, start, end) if fetch is not None else data[start:end])
        if delta.keys() != total.keys() or any(delta[p].shape != total[p].shape for p in total):
            raise ValueError(f"contribution {entry.key} to module {module!r} has tensors "
                             f"{sorted((p, list(t.shape)) for p, t in delta.items())[:3]}, the module "
                             f"{sorted((p, list(t.shape)) for p, t in total.items())[:3]}")
        for p, acc in total.items():
            acc.add_(delta[p].float(), alpha=entry.weight)
    return {p: before[p].float().cpu() - total[p] for p in sorted(before)}
