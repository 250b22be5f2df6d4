"""moto's standalone S3 server on a free loopback port, for the tests that run the store on S3
(tests/test_s3_store.py, tests/test_crash_safety.py): reached through s3fs exactly as AWS would be, with the
endpoint and credentials in the environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).

    with moto_server() as env:   # conftest's session fixture `s3_env`; skips, with the reason, only when
        ...                      # the server cannot start

Its conditional PUTs are made atomic (`atomic_conditional_puts`): moto checks If-None-Match / If-Match,
then writes, and two concurrent requests can both pass the check; S3 decides them as one step.
"""

import contextlib
import functools
import logging
import os
import socket
import threading
from collections.abc import Iterator

import pytest

BUCKET = "dipaco-test"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def atomic_conditional_puts() -> None:
    """Serialise moto's PutObject handling (once per process), as S3 serialises conditional writes of a key."""
    from moto.s3.responses import S3Response

    put = S3Response.put_object
    if getattr(put, "dipaco_atomic", False):
        return
    lock = threading.Lock()

    @functools.wraps(put)
    def locked(self, *args, **kwargs):
        with lock:
            return put(self, *args, **kwargs)

    locked.dipaco_atomic = True
    S3Response.put_object = locked


@contextlib.contextmanager
def moto_server() -> Iterator[dict[str, str]]:
    """A running moto S3 server with the bucket `BUCKET`; yields the environment variables that reach it
    (set in os.environ meanwhile)."""
    import s3fs  # both in the test extra (`make install`)
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    atomic_conditional_puts()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    try:
        server.start()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    except Exception as err:  # the server's own start-up errors
        reason = f"moto's S3 server could not start on 127.0.0.1:{port}: {err}"
        print(reason)
        pytest.skip(reason)
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    s3fs.S3FileSystem.clear_instance_cache()
    with contextlib.suppress(FileExistsError):  # moto's buckets live in this process: an earlier server's stay
        s3fs.S3FileSystem().mkdir(BUCKET)
    try:
        yield env
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
