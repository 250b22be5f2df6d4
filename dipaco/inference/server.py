"""`dipaco serve`'s HTTP side: an exported mixture behind OpenAI's completions API, on FastAPI and uvicorn
(h11: HTTP/1.1 keep-alive, request framing and bad `Content-Length` handled by a maintained stack).

    dipaco serve out/demo --port 8000                        # or: make serve EXPORT=out/demo
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "In the beginning", "max_tokens": 20, "temperature": 0}'
    lm_eval --model local-completions --model_args base_url=http://localhost:8000/v1/completions,model=demo,...

- POST /v1/completions: the fields of `completion_request` (anything else refused by name), answered by
  `completions.Completions` (each prompt routed to one path; `logprobs`, `echo`, `stop`, `top_p`,
  `stream` as server-sent events ending `data: [DONE]`). A body over `max_body_bytes` is a 413.
- GET /v1/models (and /v1/models/{id}): the one model, with `created` (the export's time); GET /health.
- POST /v1/chat/completions: a 404 saying that this is a base model without a chat template.
- Every error is OpenAI's JSON shape `{"error": {"message", "type", "param", "code"}}`; a `model` other
  than the served name is a 404 (`model_not_found`).

Requests are taken in parallel and wait for one lock around the mixture (`Completions`).
`BackgroundServer` runs the app on a thread (tests, notebooks).
"""

from __future__ import annotations

import logging
import threading
import time
from http import HTTPStatus
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from dipaco.inference.completion_request import RequestError, parse_completion_request
from dipaco.inference.completions import Completions
from dipaco.inference.mixture import Mixture

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


def build_app(mixture: Mixture, *, name: str | None = None, max_body_bytes: int = MAX_BODY_BYTES) -> FastAPI:
    """The FastAPI app serving `mixture` under the model name `name` (default: the export's directory name)."""
    engine = Completions(mixture, name=name or mixture.directory.name)
    app = FastAPI(title="dipaco serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    _error_handlers(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        parsed = parse_completion_request(await read_body(request, max_body_bytes))
        engine.check_model(parsed.model)
        prompts = await run_in_threadpool(engine.prepare, parsed)
        if parsed.stream:
            return StreamingResponse(engine.stream(parsed, prompts), media_type="text/event-stream")
        return JSONResponse(await run_in_threadpool(engine.complete, parsed, prompts))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        raise RequestError(f"{engine.name} is a base language model without a chat template: dipaco serve has no "
                           "/v1/chat/completions; send the text to POST /v1/completions",
                           status=HTTPStatus.NOT_FOUND, code="unsupported_endpoint")

    @app.get("/v1/models")
    async def models() -> Any:
        return engine.models()

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        engine.check_model(model)
        return engine.models()["data"][0]

    @app.get("/health")
    async def health() -> Any:
        return {"status": "ok", "loaded_paths": mixture.paths.loaded}

    return app


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes before reading more (what is left unread is
    discarded by the server, so the connection stays usable)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise RequestError(f"the body has {declared} bytes; at most {limit}", param=None,
                           status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise RequestError(f"the body has more than {limit} bytes", status=HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
    return bytes(body)


def _error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's JSON error shape."""

    @app.exception_handler(RequestError)
    async def refused(request: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(err.payload(), status_code=err.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        message = (f"no such endpoint: {request.method} {request.url.path} (this server has POST /v1/completions, "
                   "GET /v1/models, GET /health)") if err.status_code == 404 else str(err.detail)
        error = RequestError(message, status=HTTPStatus(err.status_code))
        return JSONResponse(error.payload(), status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def failed(request: Request, err: Exception) -> JSONResponse:
        log.error("dipaco serve: %s %s failed", request.method, request.url.path, exc_info=err)
        error = RequestError(f"{type(err).__name__}: {err}", status=HTTPStatus.INTERNAL_SERVER_ERROR)
        return JSONResponse(error.payload(), status_code=500)


def serve(app: FastAPI, *, host: str, port: int, log_level: str = "info") -> None:
    """Serve `app` on `host:port` until interrupted (uvicorn)."""
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


class BackgroundServer:
    """`app` served by uvicorn on a thread: `with BackgroundServer(app) as server: server.server_address`
    (port 0: a free one)."""

    def __init__(self, app: FastAPI, *, host: str = "127.0.0.1", port: int = 0):
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True, name="dipaco-serve")
        self.server_address: tuple[str, int] = (host, port)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start on {self.server_address}")
            time.sleep(0.02)
        self.server_address = self.server.servers[0].sockets[0].getsockname()[:2]
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
