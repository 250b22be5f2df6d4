"""`dipaco serve` (`dipaco.inference.server`): a real HTTP server on a free port in a thread, a POST to
/v1/completions answered with what `Mixture.complete` gives for the same prompt, bad requests refused
with a 4xx JSON error naming the field, paths loaded lazily and at most `max_loaded` kept.

The mixture is conftest's `tiny_mixture`, the tiny run's export."""

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

import dipaco
from dipaco.cli import build_parser, dispatch
from dipaco.inference.server import CompletionServer


@pytest.fixture(scope="module")
def exported(tiny_mixture):
    return tiny_mixture  # read only


@pytest.fixture(scope="module")
def server(exported):
    """The server on a free port of the loopback interface, serving in a thread for the module."""
    server = CompletionServer(dipaco.load(exported, max_loaded=1), ("127.0.0.1", 0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def request(server, path: str, payload=None, *, raw: bytes | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON answer) of a GET (`payload` None) or a POST of `payload` as JSON (or `raw` bytes)."""
    host, port = server.server_address[:2]
    data = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
    http = urllib.request.Request(f"http://{host}:{port}{path}", data=data,
                                  headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(http, timeout=60) as answer:
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
    ({"prompt": "In the beginning", "stream": True}, "stream"),
    ({"prompt": "In the beginning", "n": 2}, "n"),
    ({"prompt": "word " * 200}, "prompt"),  # longer than a path reads
])
def test_a_bad_request_is_a_400_naming_the_field(server, payload, field):
    status, answer = request(server, "/v1/completions", payload)
    assert status == 400 and answer["error"]["param"] == field, answer
    assert answer["error"]["type"] == "invalid_request_error"


def test_malformed_bodies_and_unknown_endpoints_get_json_errors(server):
    assert request(server, "/v1/completions", raw=b"{not json")[0] == 400
    assert request(server, "/v1/completions", raw=b"[1, 2]")[0] == 400
    assert request(server, "/v1/chat", {"prompt": "hi"})[0] == 404
    assert request(server, "/nowhere")[0] == 404
    status, models = request(server, "/v1/models")
    assert status == 200 and models["data"][0]["dipaco_paths"] == [0, 1, 2, 3]
    assert request(server, "/health")[1]["status"] == "ok"


def test_dipaco_serve_runs_with_the_options_it_is_given(exported, capsys, monkeypatch):
    """`dipaco serve DIR --port 0 --route likelihood --max-loaded 1` through the command line's parser and
    dispatch: it listens on a free port, answers as the mixture routed by likelihood does and keeps one path."""
    from dipaco.stages import serve

    started = []

    class Recorded(CompletionServer):  # the real server, remembered so the test can reach and stop it
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(serve, "CompletionServer", Recorded)
    args = build_parser().parse_args(["serve", str(exported), "--port", "0", "--route", "likelihood",
                                      "--max-loaded", "1", "--device", "cpu"])
    thread = threading.Thread(target=dispatch, args=(args,), daemon=True)
    thread.start()
    for _ in range(600):
        if started or not thread.is_alive():
            break
        time.sleep(0.05)
    server = started[0]
    try:
        assert server.server_address[1] != 0 and f":{server.server_address[1]}/v1/completions" in capsys.readouterr().out
        prompt = "def fibonacci(n):"
        answer = request(server, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "temperature": 0})[1]
        expected = dipaco.load(exported, route="likelihood").complete(prompt, max_new_tokens=4)
        assert (answer["choices"][0]["text"], answer["choices"][0]["dipaco_path"]) == (expected.continuation,
                                                                                       expected.path)
        assert server.mixture.route == "likelihood" and len(server.mixture.paths.loaded) == 1
    finally:
        server.shutdown()
        thread.join(timeout=10)
