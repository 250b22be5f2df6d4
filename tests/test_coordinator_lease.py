"""The store's lease keeps a second coordinator out: one holder at a time, named when refused, taken over
when expired, forced or left by a dead process, and fenced by conditional writes so that of coordinators
racing for it one wins and a deposed one can no longer write: its renewal and its commit are refused (issue 13,
item 2; issue 29, item 8; issue 36, item 1). The coordinators' own run through a stall: test_fenced_commit.py."""

import os
import subprocess
import sys
import threading

import pytest
import torch

from dipaco.store.errors import StoreError
from dipaco.store.lease import LEASE_FILE, Lease, LeaseHeld, LeaseLost, read_holder
from dipaco.store.module_store import ModuleStore


# --- the lease ---------------------------------------------------------------------------------------
def test_a_second_coordinator_is_refused_naming_the_holder_and_the_lease_age(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    now = [1000.0]
    Lease.acquire(store, timeout=60, host="node-a", pid=4242, wall=lambda: now[0])
    now[0] += 12
    with pytest.raises(LeaseHeld, match=r"node-a pid 4242 \(token 1, started 12s ago, renewed 12s ago\)"):
        Lease.acquire(store, timeout=60, host="node-b", pid=7, wall=lambda: now[0])
    assert read_holder(store).host == "node-a"


def versioned_store(store: ModuleStore) -> ModuleStore:
    """`store` with version 0 of one module committed (no lease: as `dipaco train` initialises it)."""
    store.write_module(0, "m", {"w": torch.zeros(3)})
    store.commit(round=0)
    return store


def stage_round_one(store: ModuleStore, value: float) -> None:
    """A coordinator's outer step for round 1: module m staged under its lease token."""
    store.write_module(1, "m", {"w": torch.full((3,), value)})


def test_an_expired_or_forced_lease_is_taken_over_and_the_deposed_coordinator_cannot_commit(tmp_path):
    url = str(tmp_path / "store")
    versioned_store(ModuleStore(url))
    now = [1000.0]
    a_store, b_store = ModuleStore(url), ModuleStore(url)  # two coordinators, each its own process
    first = Lease.acquire(a_store, timeout=60, host="node-a", pid=4242, wall=lambda: now[0])
    a_store.fence(first.token)
    stage_round_one(a_store, 1.0)  # a's outer step, before it stalls
    now[0] += 61  # not renewed for the whole timeout
    second = Lease.acquire(b_store, timeout=60, host="node-b", pid=7, wall=lambda: now[0])
    assert second.token == first.token + 1
    b_store.fence(second.token)
    with pytest.raises(LeaseLost, match=r"\(token 1\) lost the lease .* to node-b pid 7"):
        first.check()
    with pytest.raises(LeaseLost):
        first.renew()
    with pytest.raises(LeaseLost, match=r"commit of round 1 by lease token 1 was refused: .* round 0 of lease token 2"):
        a_store.commit(round=1)  # the real commit, attempted: refused
    reader = ModuleStore(url)
    assert reader.current_round() == 0
    with pytest.raises(StoreError, match="round-000001/m.safetensors does not exist"):
        reader.read_module(1, "m")  # a's staged module is under its token's name, which no commit names
    stage_round_one(b_store, 2.0)
    b_store.commit(round=1)
    torch.testing.assert_close(ModuleStore(url).read_module(1, "m")["w"], torch.full((3,), 2.0))
    with pytest.raises(LeaseLost, match="refused"):
        a_store.commit(round=1)  # still refused after b's commit: nothing of b's version changes
    torch.testing.assert_close(ModuleStore(url).read_module(1, "m")["w"], torch.full((3,), 2.0))
    third = Lease.acquire(ModuleStore(url), timeout=60, host="node-c", pid=9, wall=lambda: now[0], force=True)
    assert third.token == 3
    second.release()  # not its lease any more: nothing removed
    assert read_holder(b_store).host == "node-c"


def test_a_lease_of_a_dead_process_on_this_host_is_taken_over_at_once(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    Lease.acquire(store, timeout=600, pid=int(gone.stdout))
    assert Lease.acquire(store, timeout=600).holder.pid == os.getpid()


def test_a_second_coordinator_process_on_the_store_is_refused(tmp_path):
    """A real other process holds the lease (alive, renewing): this one's coordinator does not start."""
    store = ModuleStore(str(tmp_path / "store"))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom dipaco.store.lease import Lease\nfrom dipaco.store.module_store "
         f"import ModuleStore\nLease.acquire(ModuleStore({str(tmp_path / 'store')!r}), timeout=60)\nprint('held', "
         "flush=True)\nsys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(LeaseHeld, match=f"pid {holder.pid} .*--force"):
            Lease.acquire(store, timeout=60)
    finally:
        holder.communicate("")
    assert store.exists(LEASE_FILE)


# --- the lease's conditional writes (issue 29, item 8) -----------------------------------------------------
def after_first_read(store: ModuleStore, then) -> ModuleStore:
    """`store`, whose first `read_versioned` calls `then()` after reading (the moment between a coordinator's
    look at lease.json and its write)."""
    read, calls = store.read_versioned, []

    def hooked(relative):
        found = read(relative)
        if not calls:
            calls.append(relative)
            then()
        return found

    store.read_versioned = hooked
    return store


def race_for_the_lease(store_of, reps: int) -> list[int]:
    """`reps` times, two coordinators (threads, each with its own store object) take a fresh store's lease:
    both read lease.json before either writes (a barrier), so both try to create it. The winners of each."""
    winners = []
    for i in range(reps):
        barrier = threading.Barrier(2, timeout=30)
        stores = [after_first_read(store_of(i), barrier.wait) for _ in range(2)]
        won, refused = race(stores)
        winners.append(len(won))
        if len(won) == 1:
            assert read_holder(stores[0]).nonce == won[0].holder.nonce
            assert refused and "at the same time: node-" in refused[0]
    return winners


def race(stores: list[ModuleStore]) -> tuple[list[Lease], list[str]]:
    """Each store's coordinator takes the lease in a thread of its own: the leases won, the refusals."""
    won: list[Lease] = []
    refused: list[str] = []

    def take(k: int) -> None:
        try:
            won.append(Lease.acquire(stores[k], timeout=60, host=f"node-{k}", pid=1000 + k))
        except LeaseHeld as err:
            refused.append(str(err))

    threads = [threading.Thread(target=take, args=(k,)) for k in range(len(stores))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won, refused


def deposed_writes_are_refused(store_of) -> None:
    """A lease taken over while its holder was between its last check and its writes: its renewal and its
    commit (the real writes, conditional: If-Match on S3, the lock on a directory) are refused, the new holder
    keeps the lease and commits; and a takeover that read a lease renewed before it wrote is refused in turn."""
    now = [1000.0]
    versioned_store(store_of())
    a_store, b_store = store_of(), store_of()
    a = Lease.acquire(a_store, timeout=60, host="node-a", pid=1, wall=lambda: now[0])
    a_store.fence(a.token)
    a.check()  # a's last check passes; it stalls
    now[0] += 61  # a is not renewed for a whole timeout: b takes over
    b = Lease.acquire(b_store, timeout=60, host="node-b", pid=2, wall=lambda: now[0])
    b_store.fence(b.token)
    a_store.write_module(1, "m", {"w": torch.ones(3)})
    with pytest.raises(LeaseLost, match=r"\(token 1\) lost the lease .* to node-b pid 2"):
        a.renew()
    with pytest.raises(LeaseLost, match="commit of round 1 by lease token 1 was refused"):
        a_store.commit(round=1)
    b.check()
    b_store.write_module(1, "m", {"w": torch.full((3,), 5.0)})
    b_store.commit(round=1)
    assert read_holder(store_of()).host == "node-b"
    reader = store_of()
    assert reader.current_round() == 1 and reader.state()["lease_token"] == b.token
    torch.testing.assert_close(reader.read_module(1, "m")["w"], torch.full((3,), 5.0))
    now[0] += 30  # b renews while c reads the lease to take it over (forced): c's write is refused
    c_store = after_first_read(store_of(), b.renew)
    with pytest.raises(LeaseHeld, match="at the same time: node-b pid 2"):
        Lease.acquire(c_store, timeout=60, host="node-c", pid=3, wall=lambda: now[0], force=True)
    b.check()
    assert read_holder(store_of()).renewed_at == now[0]


def test_two_coordinators_racing_for_a_directory_store_one_wins_every_time(tmp_path):
    winners = race_for_the_lease(lambda i: ModuleStore(str(tmp_path / f"store-{i}")), reps=50)
    assert winners == [1] * 50


def test_a_deposed_coordinators_lease_write_is_refused_on_a_directory_store(tmp_path):
    deposed_writes_are_refused(lambda: ModuleStore(str(tmp_path / "store")))


def test_a_released_lease_is_free_and_its_token_goes_on(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    first = Lease.acquire(store, timeout=600, host="node-a", pid=1)
    first.release()
    assert read_holder(store) is None and store.exists(LEASE_FILE)
    with pytest.raises(LeaseLost, match=r"to node-a pid 1 \(token 1, .*\) \(released\)"):
        first.check()
    second = Lease.acquire(store, timeout=600, host="node-b", pid=2)
    assert second.token == 2
