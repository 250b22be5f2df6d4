"""The batch prefetcher: the same batches in the same order, exactly as many as asked, errors raised
where they happened, and no thread left behind."""

import numpy as np
import pytest
import torch

from dipaco.optim.prefetch import Prefetcher

CPU = torch.device("cpu")


def _source(n: int, *, fail_at: int | None = None, reads: list | None = None):
    rng = np.random.default_rng(0)
    for i in range(n):
        if i == fail_at:
            raise OSError(f"shard unreadable at batch {i}")
        if reads is not None:
            reads.append(i)
        yield rng.integers(0, 100, size=(2, 5)).astype(np.int64 if i % 2 else np.uint16)


def test_prefetched_batches_are_the_source_batches_in_order_as_int64_tensors():
    reads: list[int] = []
    prefetcher = Prefetcher(_source(10, reads=reads), count=6, device=CPU, depth=2)
    with prefetcher as ahead:
        got = list(ahead)
    expected = [torch.as_tensor(b.astype(np.int64)) for b in _source(6)]
    assert len(got) == 6 and all(g.dtype == torch.long for g in got)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert reads == list(range(6))  # never reads beyond the batches asked for
    assert not prefetcher._thread.is_alive()


def test_a_read_error_is_raised_in_the_training_thread_at_its_batch():
    got = []
    with pytest.raises(OSError, match="batch 3"):
        with Prefetcher(_source(10, fail_at=3), count=6, device=CPU) as ahead:
            for batch in ahead:
                got.append(batch)
    assert len(got) == 3


def test_leaving_early_stops_the_reading_thread():
    prefetcher = Prefetcher(_source(1000), count=1000, device=CPU, depth=2)
    with prefetcher as ahead:
        next(ahead)
    assert not prefetcher._thread.is_alive()
