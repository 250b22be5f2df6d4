"""The store's lease keeps a second coordinator out: one holder at a time, named when refused, taken over
when expired, forced or left by a dead process, and fenced by conditional writes so that of coordinators
racing for it one wins and a deposed one can no longer write (issue 13, item 2; issue 29, item 8)."""

import os
import subprocess
import sys
import threading

import pytest

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


def test_an_expired_or_forced_lease_is_taken_over_and_the_deposed_coordinator_cannot_commit(tmp_path):
    store = ModuleStore(str(tmp_path / "store"))
    now = [1000.0]
    first = Lease.acquire(store, timeout=60, host="node-a", pid=4242, wall=lambda: now[0])
    now[0] += 61  # not renewed for the whole timeout
    second = Lease.acquire(store, timeout=60, host="node-b", pid=7, wall=lambda: now[0])
    assert second.token == first.token + 1
    with pytest.raises(LeaseLost, match=r"\(token 1\) lost the lease .* to node-b pid 7"):
        first.check()
    with pytest.raises(LeaseLost):
        first.renew()
    third = Lease.acquire(store, timeout=60, host="node-c", pid=9, wall=lambda: now[0], force=True)
    assert third.token == 3
    second.release()  # not its lease any more: nothing removed
    assert read_holder(store).host == "node-c"


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
    """A lease taken over while its holder was between its check and its renewal: the renewal's write is
    refused (If-Match on S3, the lock here), and the new holder keeps the lease; and a takeover that read a
    lease renewed before it wrote is refused in turn."""
    now = [1000.0]
    a = Lease.acquire(store_of(), timeout=60, host="node-a", pid=1, wall=lambda: now[0])
    now[0] += 61  # a is not renewed for a whole timeout: b takes over
    b = Lease.acquire(store_of(), timeout=60, host="node-b", pid=2, wall=lambda: now[0])
    a.check = lambda: None  # a's last check passed just before b took over
    with pytest.raises(LeaseLost, match=r"\(token 1\) lost the lease .* to node-b pid 2"):
        a.renew()
    b.check()
    assert read_holder(store_of()).host == "node-b"
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
