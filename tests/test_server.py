"""`dipaco serve` (`dipaco.inference.server`, FastAPI on uvicorn): a real HTTP server on a free port in a
thread, a POST to /v1/completions answered with what `Mixture.complete` gives for the same prompt,
`logprobs` with `echo` equal to the project's scorer under the routed path, streaming, concurrent
requests, one keep-alive connection surviving a 404, a 413 and a bad `Content-Length`, bad requests and
unsupported fields refused with a 4xx JSON error naming the field, paths kept loaded when they fit; (slow)
lm-evaluation-harness's `local-completions` against `dipaco serve` scoring as the `dipaco` model type.

The mixture is conftest's `tiny_mixture`, the tiny run's export."""

import http.client
import json
import logging
import threading
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch

import dipaco
from dipaco.cli import main
from dipaco.eval.scoring import token_losses_and_greedy
from dipaco.inference import path_memory
from dipaco.inference.completion_request import parse_completion_request
from dipaco.inference.server import BackgroundServer, build_app


@pytest.fixture(scope="module")
def exported(tiny_mixture):
    return tiny_mixture  # read only


@pytest.fixture(scope="module")
def server(exported):
    """The server on a free port of the loopback interface, serving in a thread for the module."""
    with BackgroundServer(build_app(dipaco.load(exported, max_loaded=1))) as server:
        server.mixture = server.app.state.engine.mixture
        yield server


def request(server, path: str, payload=None, *, raw: bytes | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of a GET (`payload` None) or a POST of `payload` as JSON (or `raw` bytes)."""
    host, port = server.server_address[:2]
    data = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
    asked = urllib.request.Request(f"http://{host}:{port}{path}", data=data,
                                   headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(asked, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_completion_equals_the_mixtures_own_routed_generation(server, exported):
    mixture = dipaco.load(exported)
    prompts = ["In the beginning God created", "def fibonacci(n):", "=head2 Constant subroutines"]
    status, answer = request(server, "/v1/completions", {"prompt": prompts, "max_tokens": 6, "temperature": 0})
    assert status == 200 and answer["object"] == "text_completion" and answer["model"] == "mixture"
    expected = [mixture.complete(p, max_new_tokens=6) for p in prompts]
    assert len({e.path for e in expected}) > 1, "the prompts should reach several paths"
    assert [c["text"] for c in answer["choices"]] == [e.continuation for e in expected]
    assert [c["dipaco_path"] for c in answer["choices"]] == [e.path for e in expected]
    assert answer["usage"]["completion_tokens"] == sum(len(e.tokens) for e in expected)
    assert len(server.mixture.paths.loaded) == 1  # max_loaded=1: the last routed path alone stays
    sampled = {"prompt": prompts[0], "max_tokens": 6, "temperature": 0.8, "seed": 3}
    assert request(server, "/v1/completions", sampled)[1]["choices"][0]["text"] == \
        mixture.complete(prompts[0], max_new_tokens=6, temperature=0.8, seed=3).continuation
    nucleus = {**sampled, "temperature": 1.5, "top_p": 1e-9}  # the nucleus holds the most likely token alone
    assert request(server, "/v1/completions", nucleus)[1]["choices"][0]["text"] == expected[0].continuation
    stop = expected[0].continuation[2:4]  # cut before the first place this occurs
    cut = request(server, "/v1/completions", {"prompt": prompts[0], "max_tokens": 6, "temperature": 0, "stop": stop})
    first = cut[1]["choices"][0]
    assert first["finish_reason"] == "stop"
    assert first["text"] == expected[0].continuation[: expected[0].continuation.index(stop)]


@pytest.mark.parametrize("payload, field", [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": ["ok", 3]}, "prompt"),
    ({"prompt": "In the beginning", "max_tokens": "4"}, "max_tokens"),
    ({"prompt": "In the beginning", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "In the beginning", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "In the beginning", "temperature": -1}, "temperature"),
    ({"prompt": "In the beginning", "seed": -2}, "seed"),
    ({"prompt": "In the beginning", "stop": [1]}, "stop"),
    ({"prompt": "In the beginning", "n": 2}, "n"),
    ({"prompt": "word " * 200}, "prompt"),  # longer than a path reads
    ({"prompt": "In the beginning", "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"prompt": "In the beginning", "presence_penalty": -1}, "presence_penalty"),
    ({"prompt": "In the beginning", "best_of": 3}, "best_of"),
    ({"prompt": "In the beginning", "logit_bias": {"5": 10}}, "logit_bias"),
    ({"prompt": "In the beginning", "suffix": "end"}, "suffix"),
    ({"prompt": "In the beginning", "top_k": 5}, "top_k"),  # not an OpenAI field: never ignored
    ({"prompt": "In the beginning", "top_p": 0}, "top_p"),
    ({"prompt": "In the beginning", "top_p": 1.5}, "top_p"),
    ({"prompt": "In the beginning", "logprobs": 50}, "logprobs"),
    ({"prompt": "In the beginning", "stream": True, "logprobs": 1}, "logprobs"),
    ({"prompt": "In the beginning", "stream": True, "echo": True}, "echo"),
    ({"prompt": "In the beginning", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "In the beginning", "echo": "yes"}, "echo"),
    ({"prompt": "In the beginning", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
    ({"prompt": [1, 2, 10 ** 9]}, "prompt"),  # a token id past the vocabulary
])
def test_a_bad_request_is_a_400_naming_the_field(server, payload, field):
    status, answer = request(server, "/v1/completions", payload)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_malformed_bodies_and_unknown_endpoints_get_json_errors(server, exported):
    assert request(server, "/v1/completions", raw=b"{not json")[0] == 400
    assert request(server, "/v1/completions", raw=b"[1, 2]")[0] == 400
    assert request(server, "/v1/chat", {"prompt": "hi"})[0] == 404
    assert request(server, "/nowhere")[0] == 404
    status, chat = request(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 404 and chat["error"]["code"] == "unsupported_endpoint" and "/v1/completions" in \
        chat["error"]["message"]
    status, models = request(server, "/v1/models")
    assert status == 200 and models["data"][0]["dipaco_paths"] == [0, 1, 2, 3]
    assert models["data"][0]["id"] == "mixture" and models["data"][0]["created"] == int(exported.stat().st_mtime)
    assert request(server, "/health")[1]["status"] == "ok"


def test_an_unknown_model_is_a_404_and_the_served_one_answers(server):
    status, answer = request(server, "/v1/completions", {"prompt": "In the beginning", "model": "gpt-4"})
    assert status == 404 and answer["error"]["param"] == "model" and answer["error"]["code"] == "model_not_found"
    assert request(server, "/v1/models/gpt-4")[0] == 404
    assert request(server, "/v1/models/mixture") == (200, request(server, "/v1/models")[1]["data"][0])
    assert request(server, "/v1/completions", {"prompt": "In the beginning", "model": "mixture",
                                               "max_tokens": 1})[0] == 200


def test_one_keep_alive_connection_survives_a_404_a_413_and_a_bad_content_length(server):
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    valid = json.dumps({"prompt": "In the beginning", "max_tokens": 2, "temperature": 0})

    def post(path: str, body: bytes | str) -> tuple[int, bytes]:
        connection.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        answer = connection.getresponse()
        return answer.status, answer.read()

    connection.connect()
    socket = connection.sock
    assert post("/v1/chat/completions", json.dumps({"messages": []}))[0] == 404  # a body the server did not want
    assert post("/v1/completions", valid)[0] == 200
    status, body = post("/v1/completions", b"x" * (3 << 20))  # past the 1 MiB limit
    assert status == 413 and json.loads(body)["error"]["message"].startswith("the body has")
    assert post("/v1/completions", valid)[0] == 200
    assert connection.sock is socket, "the 404 and the 413 kept the connection open"
    connection.putrequest("POST", "/v1/completions")
    connection.putheader("Content-Length", "12abc")
    connection.endheaders(b"{}")
    answer = connection.getresponse()
    assert answer.status == 400 and answer.getheader("Connection") == "close"  # the body's end is unknown
    answer.read()
    status, body = post("/v1/completions", valid)  # the same client opens the next connection itself
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] == "length"
    connection.close()


def test_echoed_logprobs_equal_the_projects_scorer_under_the_routed_path(server, exported):
    mixture = dipaco.load(exported)
    prompts = ["In the beginning God created the heaven", "def fibonacci(n): return n", "=head2 Constant sub"]
    ids = mixture.encode(prompts)
    token_prompt = [int(t) for t in ids[1]]
    status, answer = request(server, "/v1/completions", {"prompt": [prompts[0], token_prompt, prompts[2]],
                                                         "max_tokens": 0, "echo": True, "logprobs": 2})
    assert status == 200
    paths = mixture.route_tokens(ids)
    texts = [prompts[0], mixture.tokenizer.decode(token_prompt), prompts[2]]  # a text prompt is echoed as given
    for choice, tokens, path, text in zip(answer["choices"], ids, paths, texts, strict=True):
        logprobs = choice["logprobs"]
        assert choice["dipaco_path"] == path and choice["text"] == text
        (losses,), (greedy,) = token_losses_and_greedy(mixture.model(int(path)), [tokens], batch_size=1,
                                                       device=torch.device("cpu"), precision="fp32")
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        np.testing.assert_allclose(logprobs["token_logprobs"][1:], -losses[1:], rtol=0, atol=1e-5)
        assert len(logprobs["tokens"]) == len(tokens) and "".join(logprobs["tokens"]) == choice["text"]
        best = [token == max(top.values()) for token, top in zip(logprobs["token_logprobs"][1:],
                                                                 logprobs["top_logprobs"][1:], strict=True)]
        assert best == greedy[1:].tolist() and all(len(top) <= 2 for top in logprobs["top_logprobs"][1:])
    # max_tokens 1 (what lm_eval's local-completions asks): the prompt's logprobs, then the generated token's
    status, one = request(server, "/v1/completions", {"prompt": token_prompt, "max_tokens": 1, "temperature": 0,
                                                      "echo": True, "logprobs": 1})
    assert one["choices"][0]["logprobs"]["token_logprobs"][:-1] == answer["choices"][1]["logprobs"]["token_logprobs"]
    assert len(one["choices"][0]["logprobs"]["tokens"]) == len(token_prompt) + 1


def stream(server, payload: dict) -> list[str]:
    """The `data:` lines of a streamed answer."""
    connection = http.client.HTTPConnection(*server.server_address, timeout=60)
    connection.request("POST", "/v1/completions", body=json.dumps({**payload, "stream": True}))
    answer = connection.getresponse()
    assert answer.status == 200 and answer.getheader("Content-Type").startswith("text/event-stream")
    lines = [line for line in answer.read().decode().split("\n") if line]
    connection.close()
    assert all(line.startswith("data: ") for line in lines), lines
    return [line[len("data: "):] for line in lines]


def test_streaming_sends_chunks_then_done_and_equals_the_whole_answer(server, exported):
    mixture = dipaco.load(exported)
    prompts = ["In the beginning God created", "def fibonacci(n):"]
    events = stream(server, {"prompt": prompts, "max_tokens": 6, "temperature": 0,
                             "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    expected = [mixture.complete(p, max_new_tokens=6) for p in prompts]
    for index, completion in enumerate(expected):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
        assert len(mine) > 2 and all(c["finish_reason"] is None for c in mine[:-1])
        assert "".join(c["text"] for c in mine) == completion.continuation
        assert mine[-1]["finish_reason"] in ("stop", "length") and mine[-1]["dipaco_path"] == completion.path
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        sum(len(e.tokens) for e in expected)
    stop = expected[0].continuation[1:3]
    cut = [json.loads(e)["choices"][0] for e in stream(server, {"prompt": prompts[0], "max_tokens": 6,
                                                                  "temperature": 0, "stop": stop})[:-1]]
    assert "".join(c["text"] for c in cut) == expected[0].continuation[: expected[0].continuation.index(stop)]
    assert cut[-1]["finish_reason"] == "stop"


def test_two_concurrent_requests_both_succeed(server, exported):
    mixture = dipaco.load(exported)
    prompts = ["In the beginning God created", "=head2 Constant subroutines"]
    answers: dict[int, tuple[int, dict]] = {}

    def ask(index: int) -> None:
        answers[index] = request(server, "/v1/completions", {"prompt": prompts[index], "max_tokens": 8,
                                                             "temperature": 0})

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    for index, prompt in enumerate(prompts):
        status, answer = answers[index]
        assert status == 200 and answer["choices"][0]["text"] == mixture.complete(prompt, max_new_tokens=8).continuation


def test_all_paths_stay_loaded_when_they_fit_else_as_many_as_fit_with_a_warning(exported, monkeypatch, caplog):
    mixture = dipaco.load(exported, route="likelihood")
    assert path_memory.keep_loaded(mixture) is None and mixture.paths.loaded == [0, 1, 2, 3]
    engine = build_app(mixture).state.engine
    for prompt in ["In the beginning God created", "def fibonacci(n):", "=head2 Constant", "And God said"]:
        asked = parse_completion_request(json.dumps({"prompt": prompt, "max_tokens": 2}).encode())
        engine.complete(asked, engine.prepare(asked))
    assert mixture.paths.loads == 4, "likelihood routing read every path for each request: each loaded once"
    one = path_memory.model_bytes(mixture.model(0))
    small = dipaco.load(exported, route="likelihood")
    monkeypatch.setattr(path_memory, "available_bytes", lambda device: int(one * 2.5 / path_memory.HEADROOM))
    with caplog.at_level(logging.WARNING, logger="dipaco.inference.path_memory"):
        assert path_memory.keep_loaded(small) == 3  # the loaded one and 2 more
    assert "every request reloads paths" in caplog.text and small.paths.max_loaded == 3


def test_dipaco_serve_refuses_by_name_without_its_http_stack(exported, monkeypatch, caplog):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else real(name, *a))
    assert main(["serve", str(exported), "--port", "0"]) == 1
    assert "uvicorn" in caplog.text and "pip install 'dipaco[serve]'" in caplog.text


def test_dipaco_serve_runs_with_the_options_it_is_given(exported, monkeypatch, capsys):
    """`dipaco serve DIR --port 0 --route likelihood --max-loaded 1` through the command line: the app it builds
    answers as the mixture routed by likelihood does and keeps one path loaded (uvicorn's blocking `serve` is
    replaced by the same app on a background server, so the test can reach it and stop it)."""
    from dipaco.inference import server as server_module

    built = []
    monkeypatch.setattr(server_module, "serve", lambda app, **where: built.append((app, where)))
    assert main(["serve", str(exported), "--port", "0", "--route", "likelihood", "--max-loaded", "1",
                 "--device", "cpu"]) in (0, None)
    ((app, where),) = built
    assert where["port"] == 0 and "likelihood routing" in capsys.readouterr().out
    mixture = app.state.engine.mixture
    with BackgroundServer(app) as running:
        prompt = "def fibonacci(n):"
        answer = request(running, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
    expected = dipaco.load(exported, route="likelihood").complete(prompt, max_new_tokens=4)
    assert (answer["choices"][0]["text"], answer["choices"][0]["dipaco_path"]) == (expected.continuation, expected.path)
    assert mixture.route == "likelihood" and len(mixture.paths.loaded) == 1


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("route", ["router", "likelihood"])
def test_lm_evals_local_completions_against_dipaco_serve_scores_as_the_dipaco_model_type(exported, route):
    import subprocess
    import sys
    import time

    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    from dipaco.inference.harness import MixtureLM

    port = free_port()
    served = subprocess.Popen([sys.executable, "-m", "dipaco", "serve", str(exported), "--port", str(port),
                               "--route", route, "--device", "cpu"])
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as answer:
                    if json.loads(answer.read())["loaded_paths"] == [0, 1, 2, 3]:  # all kept loaded
                        break
            except OSError:
                assert served.poll() is None and time.monotonic() < deadline, "dipaco serve did not come up"
                time.sleep(0.5)
        direct = MixtureLM(path=str(exported), route=route, batch_size=4)
        mixture = direct.mixture
        pairs = [("In the beginning God created the heaven", " and the earth."),
                 ("def fibonacci(n):\n    if n < 2:", " return n"),
                 ("The :class:`RotatingFileHandler` class, located in", " the logging module"),
                 ("And God said, Let there be light", ": and there was light."),
                 ("=head2 Constant subroutines", " are inlined"),
                 ("  17 The clouds poured out water: the skies", " sent out a sound")]
        for context, continuation in pairs:
            head, tail = direct.encode_pair(context, continuation)
            assert len(head) >= mixture.prefix_tokens and len(head) + len(tail) < mixture.max_length  # no cut
        requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        remote = LocalCompletionsAPI(base_url=f"http://127.0.0.1:{port}/v1/completions", model="mixture",
                                     tokenizer=mixture.tokenizer.name_or_path, tokenizer_backend="huggingface",
                                     max_length=mixture.max_length, num_concurrent=1, max_retries=1)
        served_scores, direct_scores = remote.loglikelihood(requests), direct.loglikelihood(requests)
        for (served_ll, served_greedy), (direct_ll, direct_greedy) in zip(served_scores, direct_scores, strict=True):
            assert served_ll == pytest.approx(direct_ll, rel=1e-5, abs=1e-5) and served_greedy == direct_greedy
        paths = direct.route([direct.encode_pair(*pair)[0] for pair in pairs])
        assert len(set(paths.tolist())) > 1, "every context went to one path: routing per request would go unchecked"
    finally:
        served.terminate()
        served.wait(timeout=30)
