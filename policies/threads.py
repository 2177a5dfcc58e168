"""How many torch threads a process of the job takes, and how its idle threads wait.

Measured on a 2-core machine (issue "Fast where it counts"; ``scripts/bench_threads.py`` measures it side by
side): training with 2 threads fell from 1,153 to 43 samples/s when the machine was shared (load ~6), while one
thread kept 693. The collapse is OpenMP's: torch's intra-op threads meet at a barrier after every parallel op,
and with the default wait policy a thread that arrives early *spins* on its core. When the machine is
oversubscribed, the thread everyone waits for is descheduled while its partners burn the CPU it needs.

The budget, used by every process of the job that runs torch (trainer, learner, fleet workers, policy server,
evaluation, runtime):

- ``OMP_WAIT_POLICY=PASSIVE`` (set by :func:`passive_wait`, which fleetmind's entry points call before torch
  loads; a value already in the environment is kept): a waiting thread sleeps, so a shared machine slows the
  job in proportion to the CPU it gets, not by an order of magnitude;
- threads: the caller's configured count, else the CPUs this process may use (affinity mask and cgroup quota,
  :func:`available_cpus`) times the process's share of the job (``share``: 1 for a trainer running alone; the
  fleet's workers, the learner and the evaluation run beside each other with 1 thread each by config).

The count is fixed for a run (never adapted to the load average): a thread count changes float reduction
order, and the same config must give the same weights on the same machine.
"""

from __future__ import annotations

import os
from pathlib import Path

WAIT_ENV = "OMP_WAIT_POLICY"


def passive_wait() -> None:
    """Make OpenMP's waiting threads sleep (``OMP_WAIT_POLICY=PASSIVE``) unless the environment says otherwise.

    Takes effect only in a process where torch (its OpenMP runtime) is not loaded yet, and in every process
    started from it afterwards (Ray workers inherit the driver's environment); call it at the top of an entry
    point, before ``import torch``."""
    os.environ.setdefault(WAIT_ENV, "PASSIVE")


def available_cpus() -> float:
    """CPUs this process may run on: the affinity mask (``os.sched_getaffinity``), capped by a cgroup v2 CPU quota
    (``/sys/fs/cgroup/cpu.max``, e.g. a container limited to 1.5 CPUs). At least 1."""
    n = float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, int(quota) / int(period))
    except (OSError, ValueError):
        pass
    return max(n, 1.0)


def threads_for(share: float = 1.0) -> int:
    """Threads for a process entitled to ``share`` (0, 1] of the available CPUs: ``floor(share x CPUs)``, >= 1.

    Raises:
        ValueError: ``share`` outside (0, 1].
    """
    if not 0.0 < float(share) <= 1.0:
        raise ValueError(f"thread share: expected a value in (0, 1], given {share}")
    return max(int(available_cpus() * float(share)), 1)


def apply_thread_budget(threads: int | None = None, share: float = 1.0) -> int:
    """``torch.set_num_threads`` with ``threads`` (a configured count) or :func:`threads_for` ``(share)``;
    returns the count set.

    Raises:
        ValueError: ``threads < 1`` or a bad ``share``.
    """
    import torch

    n = threads_for(share) if threads is None else int(threads)
    if n < 1:
        raise ValueError(f"torch threads: expected >= 1, given {threads}")
    torch.set_num_threads(n)
    return n
