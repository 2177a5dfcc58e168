"""Running fleetmind's (and LeRobot's) commands from an orchestrating script: one logged subprocess call.

Used by ``scripts/compare_lerobot.py`` and ``scripts/twin_vs_eval.py``.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_ENV = {"MUJOCO_GL": "egl", "WANDB_MODE": "offline", "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled"}


def run_logged(cmd: Sequence, log: Path, env: Mapping[str, str] | None = None, cwd: Path = REPO) -> float:
    """Run ``cmd`` from ``cwd`` with its stdout and stderr in ``log``; returns its wall time, seconds.

    The environment is this process's, with :data:`DEFAULT_ENV` for what it does not set (offline, EGL) and
    ``env`` over both.

    Raises:
        SystemExit: the command exited non-zero (names it, its log and the log's last 2,000 characters).
    """
    cmd = [str(c) for c in cmd]
    full_env = {**DEFAULT_ENV, **os.environ, **(env or {})}
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    print("+ " + " ".join(cmd), f"> {log}", flush=True)
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(cmd, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, env=full_env, check=False).returncode
    wall = time.perf_counter() - t0
    if rc != 0:
        raise SystemExit(f"{Path(cmd[1] if len(cmd) > 1 else cmd[0]).name} failed (exit {rc}) after {wall:.0f} s; "
                         f"its log: {log}\n{log.read_text()[-2000:]}")
    print(f"  done in {wall:.0f} s", flush=True)
    return wall
