"""The thread budget (policies/threads.py): the CPUs a process may use, its share, and OpenMP's passive wait."""

import os

import pytest
import torch

from policies.threads import apply_thread_budget, available_cpus, passive_wait, threads_for


def test_thread_budget_follows_the_cpus_this_process_may_use():
    cpus = available_cpus()
    assert 1.0 <= cpus <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert cpus <= len(os.sched_getaffinity(0))
    assert threads_for(1.0) == max(int(cpus), 1) and threads_for(1e-6) == 1
    before = torch.get_num_threads()
    try:
        assert apply_thread_budget(None, share=1.0) == threads_for(1.0) == torch.get_num_threads()
        assert apply_thread_budget(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="share"):
        threads_for(0.0)
    with pytest.raises(ValueError, match="threads"):
        apply_thread_budget(0)


def test_passive_wait_keeps_a_value_the_environment_gives(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    passive_wait()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
