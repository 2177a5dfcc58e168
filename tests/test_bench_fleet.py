"""scripts/bench_fleet.py +bench.round=true on a tiny fleet: the env alone and the batched fleet (the policy alone and
with a critic) measured in one run, written as JSON with the ratios."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_bench_round_writes_fleet_rates_against_the_env_alone(tmp_path):
    out = tmp_path / "round.json"
    p = subprocess.run([sys.executable, "scripts/bench_fleet.py", "+bench.round=true", "+bench.round_episodes=2",
                        "+bench.round_env_episodes=2", f"+bench.round_out={out}", "fleet.units=2",
                        "task.max_episode_steps=20", "eval.processes=1", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
                       env={**os.environ, "WANDB_MODE": "disabled", "RAY_AUTH_MODE": "disabled"})
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["units"] == 2 and rep["episodes"] == 4 and rep["env_alone_steps_per_s"] > 0
    assert set(rep["fleet"]) == {"policy_alone", "with_critic_k8"}      # fert.critic.candidates: 8
    for row in rep["fleet"].values():
        assert row["episodes"] == 2 and row["steps_per_s"] > 0
        assert abs(row["vs_env_alone"] - row["steps_per_s"] / rep["env_alone_steps_per_s"]) < 1e-9
