"""The thread budget (policies/threads.py): the CPUs a process may use, its share, and OpenMP's passive wait."""

import os
from pathlib import Path

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


def test_progress_bars_stay_calm_in_a_log_file(tmp_path):
    """fleet.progress.calm_progress: with stderr to a file, a bar updated for ~1.5 s writes a couple of
    redraws, not ~15 a second; on a terminal nothing is set; an existing TQDM_MININTERVAL is kept."""
    import subprocess
    import sys

    from fleet.progress import calm_progress

    # {pre}: tqdm imported before calm_progress (scripts/run.py's typed config groups load modules that use it)
    code = ("import time\n{pre}from fleet.progress import calm_progress\ncalm_progress({iv})\nfrom tqdm import tqdm\n"
            "for _ in tqdm(range(150)):\n    time.sleep(0.01)\n")
    env = {k: v for k, v in os.environ.items() if k != "TQDM_MININTERVAL"}
    sizes = {}
    for pre in ("", "import tqdm.auto\n"):
        for iv in (30, 0.01):
            log = tmp_path / f"log_{iv}.txt"
            with open(log, "w") as f:
                subprocess.run([sys.executable, "-c", code.format(iv=iv, pre=pre)], stderr=f, env=env, check=True,
                               cwd=str(Path(__file__).resolve().parents[1]))
            sizes[pre, iv] = log.read_bytes().count(b"\r") + 1
        assert sizes[pre, 30] <= 3 and sizes[pre, 0.01] > 20, sizes

    class Tty:
        def isatty(self):
            return True
    os.environ.pop("TQDM_MININTERVAL", None)
    assert calm_progress(stream=Tty()) is False and "TQDM_MININTERVAL" not in os.environ
    os.environ["TQDM_MININTERVAL"] = "5"
    try:
        assert calm_progress(stream=open(os.devnull, "w")) is False and os.environ["TQDM_MININTERVAL"] == "5"
    finally:
        del os.environ["TQDM_MININTERVAL"]
