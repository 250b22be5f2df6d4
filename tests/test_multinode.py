"""A two-node island: two `torchrun --nnodes 2` invocations on this machine (c10d rendezvous on the
loopback address, gloo), one rank each, train one task together and give the pseudo-gradient one process
gives on the whole batch (the multi-node command of docs/islands.md#clusters). Four processes start
(two launchers, two ranks): 26 s alone on 2 shared cores, 74 s in the full suite at a load average of
~25, so it is marked slow like the one-node torchrun test (`make test-slow`)."""

import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from cli_helpers import ROOT
from test_coordinator import Clock, make_run

from dipaco.islands.island.training import train_task
from dipaco.store.board import read_result, result_exists
from dipaco.store.records import task_key


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_command(rank: int, *, port: int, island_args: list[str]) -> list[str]:
    """What node `rank` of a two-node island runs (docs/islands.md#clusters), on the loopback address."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", "dipaco-two-nodes", "--rdzv-conf", f"is_host={int(rank == 0)}", "--local-addr", "127.0.0.1",
            "-m", "dipaco", "--", *island_args]


@pytest.mark.slow
def test_a_two_node_torchrun_island_gives_the_one_process_pseudo_gradient(tiny_routed, tmp_path):
    clock = Clock()
    run = make_run(tiny_routed, tmp_path / "run", [])
    coordinator = run.coordinator(clock)
    coordinator.tick()
    single = train_task(run.setup, coordinator.tasks[task_key(0, 0)])  # one process over the whole batch

    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIPACO_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    island = ["island", "--config", str(run.dir.config), "--run", str(run.dir.root), "--pull", "--path", "0",
              "--name", "two-nodes", "--max-tasks", "1"]
    port = free_port()
    nodes = [subprocess.Popen(node_command(rank, port=port, island_args=island), cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for rank in (0, 1)]
    try:
        deadline = time.monotonic() + 240
        while not result_exists(run.store, round=1, path=0, attempt=0):
            for node in nodes:
                assert node.poll() is None, node.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "the two-node island did not report"
            coordinator.tick()
            time.sleep(0.2)
        outputs = [node.communicate(timeout=120)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, 9)
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    tensors, meta = read_result(run.store, round=1, path=0, attempt=0)
    assert meta.data_parallel_ranks == 2 and meta.tokens == single.meta.tokens
    assert tensors.keys() == single.pseudo_gradient.keys()
    for key, expected in single.pseudo_gradient.items():
        torch.testing.assert_close(tensors[key], expected, rtol=1e-4, atol=2e-6)
