"""Running the GPU check's commands (`bench/gpu_check.py`): each in the repository root, offline, in its own
session with its output in a log file; a command that fails or runs past its time is `Failed` with the
log's last lines."""

import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
log = logging.getLogger("gpu_check")


class Failed(Exception):
    """The check ran and failed; the message says how."""


def tail(log_file: Path, lines: int = 3) -> str:
    text = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()]
    return " | ".join(text[-lines:])[-400:]


def stop(proc: subprocess.Popen) -> None:
    """Kill what is left of `proc`'s process group (it was started in its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def environment(threads: int = 0) -> dict[str, str]:
    """Offline (the bundled corpus needs no network); `threads` > 0 pins each process's torch threads."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    if threads:
        env |= {"DIPACO_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)}
    return env


def start(cmd: list[str], log_file: Path, *, threads: int = 0) -> subprocess.Popen:
    log_file.parent.mkdir(parents=True, exist_ok=True)
    log.info("%s  (log: %s)", shlex.join(cmd), log_file)
    with log_file.open("w") as out:
        return subprocess.Popen(cmd, cwd=ROOT, env=environment(threads), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def run_command(cmd: list[str], *, log_file: Path, timeout: float) -> None:
    """Run `cmd` in the repository root with its output in `log_file`; Failed, with the log's last
    lines, when it exits non-zero or runs past `timeout` seconds."""
    proc = start(cmd, log_file)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise Failed(f"timed out after {timeout:.0f}s; log {log_file}") from None
    finally:
        stop(proc)
    if code:
        raise Failed(f"exit status {code}; log {log_file}: {tail(log_file)}")


def dipaco(*args: str) -> list[str]:
    return [sys.executable, "-m", "dipaco", *args]
