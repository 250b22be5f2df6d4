"""The checked body of a POST /v1/completions (OpenAI's legacy completions API): every field this server
does, and a refusal naming the field for every other one, so nothing a client asks for is ignored.

    request = parse_completion_request(b'{"prompt": "In the beginning", "max_tokens": 8, "top_p": 0.9}')
    request.prompts, request.max_tokens, request.top_p      # (['In the beginning'], 8, 0.9)

Done: `prompt` (a string, a list of strings, a list of token ids or a list of such lists: one choice
each), `model`, `max_tokens` (default 16; 0 only with `echo`), `temperature` (0 greedy), `top_p`, `seed`,
`stop`, `stream` (+ `stream_options.include_usage`), `logprobs` (0-20) and `echo`, `user` (recorded
nowhere: it changes no output). Accepted only at their neutral value: `n` 1, `best_of` 1,
`presence_penalty` 0, `frequency_penalty` 0, `logit_bias` empty, `suffix` empty. Any other field is a 400.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

MAX_LOGPROBS = 20
NEUTRAL = {"n": (1,), "best_of": (1,), "presence_penalty": (0,), "frequency_penalty": (0,),
           "logit_bias": ({},), "suffix": ("",)}  # fields done only at these values (null also accepted)
DONE = {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
        "logprobs", "echo", "user"}


class RequestError(ValueError):
    """A request the server refuses: HTTP `status`, the field at fault (`param`), an OpenAI error `code`."""

    def __init__(self, message: str, *, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def payload(self) -> dict[str, Any]:
        """OpenAI's error shape."""
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class CompletionRequest:
    """A checked /v1/completions request (field docs: the module docstring)."""

    prompts: list[str | list[int]]
    model: str | None = None
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None
    echo: bool = False


def parse_completion_request(body: bytes) -> CompletionRequest:
    """The checked request in a /v1/completions body; a `RequestError` names the first field at fault."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the body is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object with at least a 'prompt'")
    _refuse_unsupported(data)
    echo, stream = _flag(data, "echo"), _flag(data, "stream")
    logprobs = None if data.get("logprobs") is None else _number(data, "logprobs", int, 0, minimum=0)
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise RequestError(f"'logprobs' must be at most {MAX_LOGPROBS}, got {logprobs}", param="logprobs")
    for field, value in (("logprobs", logprobs is not None), ("echo", echo)):
        if stream and value:
            raise RequestError(f"'{field}' is not done with 'stream': true; ask without streaming", param=field)
    top_p = _number(data, "top_p", float, 1.0, minimum=0.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {model!r}", param="model")
    return CompletionRequest(
        prompts=_prompts(data.get("prompt")), model=model,
        max_tokens=_number(data, "max_tokens", int, 16, minimum=0 if echo else 1),
        temperature=_number(data, "temperature", float, 1.0, minimum=0.0), top_p=top_p,
        seed=_number(data, "seed", int, 0, minimum=0), stop=_stop(data.get("stop")), stream=stream,
        include_usage=_stream_options(data.get("stream_options"), stream), logprobs=logprobs, echo=echo)


def _refuse_unsupported(data: dict[str, Any]) -> None:
    for field, value in data.items():
        if field in NEUTRAL:
            if value is not None and value not in NEUTRAL[field]:
                raise RequestError(f"'{field}' = {value!r} is not supported by dipaco serve "
                                   f"(only {NEUTRAL[field][0]!r})", param=field)
        elif field not in DONE:
            raise RequestError(f"'{field}' is not a /v1/completions field dipaco serve does "
                               f"(it does {sorted(DONE | set(NEUTRAL))})", param=field)


def _prompts(prompt: Any) -> list[str | list[int]]:
    """One prompt per choice: text, or token ids (a list of ints, or a list of such lists)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_id(t) for t in prompt)):
        prompts = [prompt]
    else:
        prompts = prompt
    ok = isinstance(prompts, list) and prompts and all(
        (isinstance(p, str) and p) or (isinstance(p, list) and p and all(_is_id(t) for t in p)) for p in prompts)
    if not ok:
        raise RequestError("'prompt' must be a non-empty string, a list of them, a list of token ids or a list "
                           "of such lists", param="prompt")
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _flag(data: dict[str, Any], field: str) -> bool:
    value = data.get(field, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise RequestError(f"'{field}' must be true or false, got {value!r}", param=field)
    return value


def _number(data: dict[str, Any], field: str, kind: type, default: float, *, minimum: float) -> Any:
    """`data[field]` as `kind` (int or float), finite and >= `minimum`; `default` when absent or null."""
    value = data.get(field)
    if value is None:
        return kind(default)
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or (kind is int and not float(value).is_integer()):
        raise RequestError(f"'{field}' must be {'an integer' if kind is int else 'a finite number'}, got {value!r}",
                           param=field)
    if value < minimum:
        raise RequestError(f"'{field}' must be >= {minimum}, got {value!r}", param=field)
    return kind(value)


def _stop(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of them", param="stop")
    return tuple(stops)


def _stream_options(options: Any, stream: bool) -> bool:
    """`stream_options.include_usage` (a last chunk with the usage); only with `stream`."""
    if options is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only for 'stream': true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"} \
            or not isinstance(options.get("include_usage", False), bool):
        raise RequestError(f"'stream_options' does only {{'include_usage': true|false}}, got {options!r}",
                           param="stream_options")
    return bool(options.get("include_usage", False))
