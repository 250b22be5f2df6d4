"""An HTTP completions endpoint for an exported mixture, in OpenAI's `/v1/completions` shape: each request
is routed by its prompt to one path, which continues it.

    dipaco serve out/demo --port 8000 --max-loaded 2        # or: make serve EXPORT=out/demo
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
         -d '{"prompt": "In the beginning", "max_tokens": 20, "temperature": 0}'

POST /v1/completions takes `prompt` (a string, or a list of strings: one choice each), `max_tokens`
(default 16), `temperature` (default 1; 0 is greedy), `seed` (default 0), `stop` (a string or a list)
and `model` (echoed); `stream` and `n` other than 1 are refused. The answer has OpenAI's fields (`id`,
`object`, `created`, `model`, `choices` with `text` and `finish_reason`, `usage`) and each choice's
`dipaco_path`. A bad request is a 400 with `{"error": {"message", "type", "param"}}` naming the field;
GET /v1/models lists the one model, GET /health answers ok.

The standard library's `ThreadingHTTPServer` takes connections in parallel; generations run one at a
time (the paths and the sampling seed are shared), each exactly `Mixture.complete`. Paths are loaded when
first routed to and at most `max_loaded` stay in memory (least recently used dropped). Likelihood routing
reads every path for each request: give it `--max-loaded` the number of paths.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from dipaco.inference.mixture import Mixture

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20
UNSUPPORTED = {"stream": (False, None), "n": (1, None), "best_of": (1, None), "echo": (False, None),
               "logprobs": (None, 0)}  # fields whose other values this server does not do


class RequestError(ValueError):
    """A request the server refuses: HTTP `status`, the field at fault (`param`) and why."""

    def __init__(self, message: str, *, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST):
        super().__init__(message)
        self.param, self.status = param, status


def parse_completion_request(body: bytes) -> dict[str, Any]:
    """The checked fields of a /v1/completions body: prompts, max_tokens, temperature, seed, stop, model."""
    try:
        data = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise RequestError(f"the body is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise RequestError("the body must be a JSON object with at least a 'prompt'")
    for field, allowed in UNSUPPORTED.items():
        if field in data and data[field] not in allowed:
            raise RequestError(f"'{field}' = {data[field]!r} is not supported by dipaco serve", param=field)
    prompt = data.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise RequestError("'prompt' must be a non-empty string or a non-empty list of them", param="prompt")
    request = {"prompts": prompts, "model": data.get("model"),
               "max_tokens": _number(data, "max_tokens", int, 16, minimum=1),
               "temperature": _number(data, "temperature", float, 1.0, minimum=0.0),
               "seed": _number(data, "seed", int, 0, minimum=0),
               "stop": _stop(data.get("stop"))}
    return request


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


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("'stop' must be a non-empty string or a list of them", param="stop")
    return stops


class CompletionServer(ThreadingHTTPServer):
    """A `ThreadingHTTPServer` that answers /v1/completions with `mixture` (generations one at a time)."""

    daemon_threads = True

    def __init__(self, mixture: Mixture, address: tuple[str, int] = ("127.0.0.1", 8000), *, name: str | None = None):
        super().__init__(address, CompletionHandler)
        self.mixture = mixture
        self.model_name = name or mixture.directory.name
        self.generation = threading.Lock()

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """The /v1/completions answer to a parsed request."""
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for index, prompt in enumerate(request["prompts"]):
            try:
                with self.generation:
                    completion = self.mixture.complete(prompt, max_new_tokens=request["max_tokens"],
                                                       temperature=request["temperature"], seed=request["seed"])
            except ValueError as err:  # an empty prompt after tokenization, one longer than a path reads
                raise RequestError(str(err), param="prompt") from err
            text, finish = _cut(completion.continuation, request["stop"])
            eos = self.mixture.tokenizer.eos_token_id
            if finish != "stop":
                finish = "stop" if len(completion.tokens) and completion.tokens[-1] == eos else "length"
            choices.append({"index": index, "text": text, "finish_reason": finish, "logprobs": None,
                            "dipaco_path": completion.path})
            prompt_tokens += completion.prompt_tokens
            completion_tokens += len(completion.tokens)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": request["model"] or self.model_name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}


def _cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    """`text` up to its first stop string, and "stop" when one was found."""
    positions = [text.index(s) for s in stops if s in text]
    return (text[: min(positions)], "stop") if positions else (text, None)


class CompletionHandler(BaseHTTPRequestHandler):
    server: CompletionServer
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 - the standard library's name
        try:
            if self.path.rstrip("/") != "/v1/completions":
                raise RequestError(f"no such endpoint: POST {self.path} (this server has POST /v1/completions)",
                                   status=HTTPStatus.NOT_FOUND)
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise RequestError(f"the body has {length} bytes; at most {MAX_BODY_BYTES}",
                                   status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
            self._answer(HTTPStatus.OK, self.server.complete(parse_completion_request(self.rfile.read(length))))
        except RequestError as err:
            self._answer(err.status, {"error": {"message": str(err), "type": "invalid_request_error",
                                                "param": err.param}})
        except Exception as err:  # noqa: BLE001 - the client gets a JSON error, the log the traceback
            log.exception("dipaco serve: a request failed")
            self._answer(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": {"message": f"{type(err).__name__}: {err}",
                                                                      "type": "server_error", "param": None}})

    def do_GET(self) -> None:  # noqa: N802
        if self.path.rstrip("/") == "/v1/models":
            self._answer(HTTPStatus.OK, {"object": "list", "data": [
                {"id": self.server.model_name, "object": "model", "owned_by": "dipaco",
                 "dipaco_paths": self.server.mixture.path_ids, "dipaco_route": self.server.mixture.route}]})
        elif self.path.rstrip("/") == "/health":
            self._answer(HTTPStatus.OK, {"status": "ok", "loaded_paths": self.server.mixture.paths.loaded})
        else:
            self._answer(HTTPStatus.NOT_FOUND, {"error": {"message": f"no such endpoint: GET {self.path}",
                                                          "type": "invalid_request_error", "param": None}})

    def _answer(self, status: HTTPStatus, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the standard library's signature
        log.info("%s %s", self.address_string(), format % args)
