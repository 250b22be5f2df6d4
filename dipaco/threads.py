"""The threads this process computes with: torch's intra- and inter-op pools, faiss's OpenMP and the BLAS and
OpenMP pools numpy, scipy and scikit-learn use, all set to one count.

    from dipaco.threads import use_threads
    use_threads(config.hardware.threads_per_island)   # 0 leaves them as they are

Every stage that computes (pretrain, route, reroute, eval, and the islands and baselines through the
launcher's `DIPACO_THREADS`, `dipaco.islands.processes`) calls it first, so stages run side by side on one
machine share its cores instead of each taking them all. torch's inter-op pool can only be sized before
its first parallel work in the process; after that it is left as it is (logged).
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def use_threads(threads: int) -> None:
    """Compute with `threads` threads from now on in this process (0: leave every pool as it is)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = leave them as they are), got {threads}")
    if not threads:
        return
    import faiss
    import torch
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError as err:  # torch allows it once, before any inter-op parallel work
        log.debug("torch's inter-op threads stay %d: %s", torch.get_num_interop_threads(), err)
    faiss.omp_set_num_threads(threads)
    threadpool_limits(limits=threads)  # numpy / scipy BLAS, scikit-learn's OpenMP (kept for the process)
    log.debug("computing with %d threads", threads)
