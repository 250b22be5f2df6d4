"""What `dipaco serve` answers to a checked /v1/completions request (`completion_request`): each prompt
routed by its first `prefix_tokens` tokens to one path, continued by it (`continuation.continue_tokens`,
as `Mixture.complete`), cut at the first stop string, with OpenAI's `logprobs` and `echo`, whole or
streamed as server-sent events. No HTTP here (`server` is the HTTP side).

    engine = Completions(dipaco.load("out/demo"), name="demo")
    prompts = engine.prepare(request)               # tokenized and checked: a RequestError names the field
    answer = engine.complete(request, prompts)      # OpenAI's text_completion object
    for event in engine.stream(request, prompts): ...   # "data: {...}\\n\\n" chunks, then "data: [DONE]"

Correctness first: one lock around the mixture, so routing, generation, the sampling seed (torch's
global generator) and the path cache serve one request at a time; requests wait for it in parallel.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import numpy as np
from transformers.generation.streamers import BaseStreamer

from dipaco.inference.completion_request import CompletionRequest, RequestError
from dipaco.inference.continuation import continue_tokens
from dipaco.inference.logprobs import openai_logprobs, token_logprobs
from dipaco.inference.mixture import Mixture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a request: its text and token ids."""

    text: str
    ids: np.ndarray


class Completions:
    """The completions of `mixture`, served under the model name `name`."""

    def __init__(self, mixture: Mixture, *, name: str):
        self.mixture, self.name = mixture, name
        self.created = int(mixture.directory.stat().st_mtime)  # when the export was written
        self.lock = threading.Lock()

    def check_model(self, model: str | None) -> None:
        """Refuse (404) a `model` other than the one served; none means the one served."""
        if model is not None and model != self.name:
            raise RequestError(f"the model {model!r} does not exist; this server serves {self.name!r}",
                               param="model", status=HTTPStatus.NOT_FOUND, code="model_not_found")

    def models(self) -> dict[str, Any]:
        """The /v1/models answer: the one model."""
        return {"object": "list", "data": [{"id": self.name, "object": "model", "created": self.created,
                                            "owned_by": "dipaco", "dipaco_paths": self.mixture.path_ids,
                                            "dipaco_route": self.mixture.route}]}

    def prepare(self, request: CompletionRequest) -> list[Prompt]:
        """The request's prompts tokenized, each checked against what a path reads and what routing needs."""
        tokenizer, limit = self.mixture.tokenizer, self.mixture.max_length
        prompts = []
        for prompt in request.prompts:
            if isinstance(prompt, str):
                (ids,) = self.mixture.encode([prompt])
            else:
                ids = np.asarray(prompt, dtype=np.int64)
                if ids.max() >= len(tokenizer):
                    raise RequestError(f"token id {int(ids.max())} is not in the vocabulary (size {len(tokenizer)})",
                                       param="prompt")
                prompt = tokenizer.decode(ids.tolist())
            room = limit - 1 if request.max_tokens else limit
            if not 0 < len(ids) <= room:
                raise RequestError(f"the prompt has {len(ids)} tokens; a path reads 1 to {limit} tokens in all "
                                   f"(prompt and completion)", param="prompt")
            if self.mixture.route.startswith("likelihood") and len(ids) < 2:
                raise RequestError("likelihood routing needs a prompt of at least 2 tokens", param="prompt")
            prompts.append(Prompt(text=prompt, ids=ids))
        return prompts

    def complete(self, request: CompletionRequest, prompts: list[Prompt]) -> dict[str, Any]:
        """OpenAI's text_completion object: one choice per prompt."""
        choices, used = [], [0, 0]
        for index, prompt in enumerate(prompts):
            with self.lock:
                path, new = self._generate(prompt.ids, request)
                choice = self._choice(prompt, path, new, request)
            choices.append({"index": index, **choice})
            used[0], used[1] = used[0] + len(prompt.ids), used[1] + len(new)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices, "usage": _usage(*used)}

    def stream(self, request: CompletionRequest, prompts: list[Prompt]) -> Iterator[str]:
        """Server-sent events: text chunks of each choice in turn (the last with its finish reason), then the
        usage when asked for, then `data: [DONE]`. A failure mid-stream is an `error` event."""
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.name}
        used = [0, 0]
        try:
            for index, prompt in enumerate(prompts):
                for text, finish, path, generated in self._stream_one(prompt, request):
                    choice = {"index": index, "text": text, "finish_reason": finish, "logprobs": None}
                    if finish is not None:
                        choice["dipaco_path"] = path
                        used[0], used[1] = used[0] + len(prompt.ids), used[1] + generated
                    yield _event({**head, "choices": [choice]})
        except Exception as err:  # noqa: BLE001 - the status line is sent: the client gets an error event
            log.exception("dipaco serve: a streamed completion failed")
            yield _event({"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error",
                                    "param": None, "code": None}})
            return
        if request.include_usage:
            yield _event({**head, "choices": [], "usage": _usage(*used)})
        yield "data: [DONE]\n\n"

    def _generate(self, ids: np.ndarray, request: CompletionRequest, *, streamer: BaseStreamer | None = None,
                  cancel: threading.Event | None = None,
                  routed: Callable[[int], None] | None = None) -> tuple[int, np.ndarray]:
        """The path `ids` routes to (told to `routed`) and the tokens it generates (the caller holds the lock)."""
        try:
            (path,) = self.mixture.route_tokens([ids])
        except ValueError as err:
            raise RequestError(str(err), param="prompt") from err
        path = int(path)
        if routed is not None:
            routed(path)
        if not request.max_tokens:
            return path, np.zeros(0, dtype=np.int64)
        tokenizer = self.mixture.tokenizer
        stops = request.stop

        def stop_when(new: list[int]) -> bool:
            if cancel is not None and cancel.is_set():
                return True
            return bool(stops) and _cut(tokenizer.decode(new, skip_special_tokens=True), stops)[1] is not None

        new = continue_tokens(self.mixture.model(path), ids, max_length=self.mixture.max_length,
                              max_new_tokens=request.max_tokens, temperature=request.temperature, seed=request.seed,
                              top_p=request.top_p, pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id,
                              streamer=streamer, stop_when=stop_when)
        return path, new

    def _choice(self, prompt: Prompt, path: int, new: np.ndarray, request: CompletionRequest) -> dict[str, Any]:
        """One choice: its text (after the echoed prompt, when asked), finish reason, logprobs and path."""
        tokenizer = self.mixture.tokenizer
        text, finish = self._finish(new, request.stop)
        choice = {"text": prompt.text + text if request.echo else text, "finish_reason": finish, "logprobs": None,
                  "dipaco_path": path}
        if request.logprobs is not None:
            kept = _kept_tokens(tokenizer.decode, new, text) if finish == "stop" else len(new)
            ids = np.concatenate([prompt.ids, new[:kept]]).astype(np.int64)
            logprob, top_ids, top_values = token_logprobs(self.mixture.model(path), ids, top=request.logprobs,
                                                          device=self.mixture.device)
            start = 0 if request.echo else len(prompt.ids)
            choice["logprobs"] = openai_logprobs(tokenizer, ids, logprob, top_ids, top_values, start=start,
                                                 offset=0 if request.echo else len(prompt.text),
                                                 top=request.logprobs)
        return choice

    def _finish(self, new: np.ndarray, stops: tuple[str, ...]) -> tuple[str, str]:
        """The generated text up to the first stop string, and why generation ended."""
        text, found = _cut(self.mixture.tokenizer.decode(new.tolist(), skip_special_tokens=True), stops)
        if found is not None:
            return text, "stop"
        ended = len(new) and int(new[-1]) == self.mixture.tokenizer.eos_token_id
        return text, "stop" if ended else "length"

    def _stream_one(self, prompt: Prompt, request: CompletionRequest) -> Iterator[tuple[str, str | None, int, int]]:
        """(text, finish reason or None, path, tokens generated) as the tokens come; a worker thread generates
        under the lock and is stopped when the client goes away."""
        events: queue.Queue = queue.Queue()
        cancel = threading.Event()
        worker = threading.Thread(target=self._stream_worker, args=(prompt.ids, request, events, cancel),
                                  daemon=True, name="dipaco-serve-stream")
        worker.start()
        sent, new, path = "", [], -1
        try:
            while (item := events.get())[0] != "end":
                kind, value = item
                if kind == "error":
                    raise value
                if kind == "path":
                    path = value
                    continue
                new.extend(value)
                text, found = _cut(self.mixture.tokenizer.decode(new, skip_special_tokens=True), request.stop)
                ready = text if found is not None else _ready(text, request.stop)
                if len(ready) > len(sent):
                    yield ready[len(sent):], None, path, len(new)
                    sent = ready
                if found is not None:
                    cancel.set()
            text, finish = self._finish(np.asarray(new, dtype=np.int64), request.stop)
            yield text[len(sent):], finish, path, len(new)
        finally:
            cancel.set()
            worker.join()

    def _stream_worker(self, ids: np.ndarray, request: CompletionRequest, events: queue.Queue,
                       cancel: threading.Event) -> None:
        try:
            with self.lock:
                self._generate(ids, request, streamer=_QueueStreamer(events), cancel=cancel,
                               routed=lambda path: events.put(("path", path)))
        except Exception as err:  # noqa: BLE001 - handed to the request's thread, which raises it
            events.put(("error", err))
        finally:
            events.put(("end", None))


class _QueueStreamer(BaseStreamer):
    """A transformers streamer that puts each new token (after the prompt) on a queue as ("tokens", ids)."""

    def __init__(self, events: queue.Queue):
        self.events, self.prompt_seen = events, False

    def put(self, value: Any) -> None:
        if not self.prompt_seen:  # generate() first hands over the prompt
            self.prompt_seen = True
            return
        self.events.put(("tokens", [int(t) for t in value.reshape(-1).tolist()]))

    def end(self) -> None:
        pass


def _cut(text: str, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """`text` up to its first stop string, and the stop string found (None when none is)."""
    found = [(text.index(s), s) for s in stops if s in text]
    if not found:
        return text, None
    position, stop = min(found)
    return text[:position], stop


def _ready(text: str, stops: tuple[str, ...]) -> str:
    """The part of `text` safe to send: without a trailing partial character nor a tail that may begin a
    stop string."""
    text = text.rstrip("\ufffd")
    hold = 0
    for stop in stops:
        hold = max([hold] + [k for k in range(1, min(len(stop), len(text) + 1)) if text.endswith(stop[:k])])
    return text[: len(text) - hold]


def _kept_tokens(decode: Callable[[list[int]], str], new: np.ndarray, text: str) -> int:
    """How many of the tokens `new` lie within `text` (the generation cut at a stop string)."""
    for n in range(len(new), -1, -1):
        if text.startswith(decode(new[:n].tolist(), skip_special_tokens=True)):
            return n
    return 0


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"
