"""Find the line of a local corpus file that `datasets` failed on, for an error a person can act on.

    first_bad_line(["docs.jsonl.zst"], "json", "text")   # "docs.jsonl.zst line 3: not valid JSON (...)" or None

`routing.corpus.load_corpus` calls it only when loading failed, so a good corpus is read once. It
streams each file (compressed ones through fsspec, as `datasets` opens them) and stops at the first
problem: an empty file, bytes that are not UTF-8 (with the byte), a line that is not a JSON object,
or a text field that is neither a string nor null. Before loading, `first_bad_line(..., max_lines=1)`
checks each file's first line only: pyarrow's JSON reader (datasets 4, pyarrow 21) crashes the
process with a segmentation fault on a JSON lines file whose first line is `null`.
"""

from __future__ import annotations

import json

import fsspec


def first_bad_line(files: list[str], builder: str, text_field: str, *, max_lines: int | None = None) -> str | None:
    """The first problem in `files` read as `builder` ("json" / "text"), naming the file and the line;
    with `max_lines`, only the first that many non-blank lines of each file are read."""
    if builder not in ("json", "text"):
        return None  # parquet is checked by its own reader
    for file in files:
        with fsspec.open(file, "rb", compression="infer") as f:
            empty = True
            checked = 0
            for number, raw in enumerate(_lines(f), start=1):
                empty = False
                if max_lines is not None and checked >= max_lines:
                    break
                checked += bool(raw.strip())
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    byte = raw[err.start : err.start + 1]
                    return (f"corpus file {file} line {number}: byte {byte!r} at column {err.start + 1} is not "
                            f"UTF-8 (convert the file, e.g. `iconv -f latin1 -t utf-8`)")
                if builder == "json" and line.strip():
                    problem = _json_problem(line, text_field)
                    if problem:
                        return f"corpus file {file} line {number}: {problem}"
            if empty:
                return f"corpus file {file} is empty"
    return None


def _lines(f, chunk: int = 1 << 20):
    """The lines of a binary stream, ending newline kept (a zstd stream has no readline)."""
    pending = b""
    while block := f.read(chunk):
        pending += block
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


def _json_problem(line: str, text_field: str) -> str | None:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno}); each line must be one JSON object"
    if not isinstance(obj, dict):
        return f"JSON {_json_type(obj)}, not an object like {{\"{text_field}\": \"...\"}}"
    value = obj.get(text_field)
    if value is not None and not isinstance(value, str):
        return f"field {text_field!r} is a JSON {_json_type(value)}, not a string"
    return None


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return {dict: "object", list: "array", str: "string", int: "number", float: "number"}.get(type(value), "value")
