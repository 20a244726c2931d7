"""The server's torch threads (``serve.threads``): chosen on purpose, not left to torch.

torch's default gives every process a thread per core, so the ranks of a torchrun job on
one host each take every core, and its inter-op pool adds threads of its own. ``auto``
gives each rank its share of the cores the process may use (its CPU affinity), one
inter-op thread, and honours an ``OMP_NUM_THREADS`` the user set. Leaving a core to the
HTTP loop and the clients was measured and lost: on 2 cores with 1, 4 and 16 SDK clients
on the same machine, one thread did 0.74-0.90x the rounds/s of two on a 384-wide model
and no better on the bundled tiny one (``scripts/bench/service.py --parts threads``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

log = logging.getLogger("veoptim.service")


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, where the OS reports one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def server_threads(setting: int, env: Mapping[str, str], cores: int) -> tuple[int, str]:
    """(intra-op threads, why) for ``serve.threads`` = ``setting`` (0: auto)."""
    if setting > 0:
        return setting, "serve.threads"
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    ranks = max(1, int(env.get("LOCAL_WORLD_SIZE", "1") or 1))
    return max(1, cores // ranks), f"auto: {cores} usable cores, {ranks} rank(s) on this host"


def apply_server_threads(setting: int) -> int:
    """Set torch's intra-op threads (and one inter-op thread) for this server process;
    the number set. Call before the model is built (inter-op threads are fixed once used)."""
    import torch

    threads, why = server_threads(setting, os.environ, usable_cores())
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # the pool already ran (a forked test server): its size stays
        log.debug("inter-op threads already fixed at %d", torch.get_num_interop_threads())
    log.info("torch threads: %d intra-op (%s)", threads, why)
    return threads
