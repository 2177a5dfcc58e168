"""The main job end to end on real Meta-World, real Zarr, real Ray and a tiny real policy: demos, base
policies, fleet + asynchronous FERT learner, comparison arms, held-out evaluation, table, plot, audits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_main_job_tiny_end_to_end(tmp_path):
    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "task.tasks=[reach-v3]", "task.max_episode_steps=80",
            "robot.train_units=[0,1]", "robot.heldout_units=[100,101]", "fleet.num_cpus=2",
            "job.demos_per_task=3", "job.base_steps=10", "job.fleet_units=2", "job.tail_episodes=1",
            "job.videos=1", "job.video_episodes=2", "eval.trials_per_task=2",
            "fert.rounds=1", "learner.updates_per_version=5", "learner.min_new_episodes=1", "learner.batch_size=16",
            "train.batch_size=16", "train.wandb.enabled=false", "train.progress=false",
            "policy.dim=32", "policy.n_layers=1", "policy.n_heads=2", "policy.state_hidden=32",
            "policy.aed.tokenizer_vocab_size=128", "job.fleet_sizes=[1,2]", "job.sweep_episodes_per_unit=1"]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "scripts/run.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "results.json").read_text())
    assert set(table["arms"]) == {"base", "filtered_bc", "fert", "fert_no_aed"}
    for row in table["arms"].values():
        assert row["tasks"]["reach-v3"]["trials"] == 2
        lo, hi = row["average"]["ci95"]
        assert 0.0 <= lo <= row["average"]["rate"] <= hi <= 1.0
    assert "| fert |" in (out / "results.md").read_text()
    assert (out / "success_per_round.png").stat().st_size > 1000
    assert list((out / "learner_fert" / "audits").glob("retrieval_audit_round_000.json"))
    state = json.loads((out / "job_state.json").read_text())
    assert state["fert"]["learner"]["published"] == [2]           # v1 = base, v2 = FERT round 0
    # every fleet episode was committed with the version that acted; held-out units never reached training
    from experience_dict.store import ExperienceStore

    train_eps = ExperienceStore.open(str(out / "store")).episodes()
    assert {m.unit_id for m in train_eps} <= {0, 1}
    assert {m.policy_version for m in train_eps if not m.is_demo} <= {1, 2}
    eval_eps = ExperienceStore.open(str(out / "eval_store")).episodes()
    assert {m.unit_id for m in eval_eps} <= {100, 101} and len(eval_eps) == 8
    assert list((out / "videos").rglob("*.mp4"))
    assert "held-out success" in proc.stdout
    # the fleet-size sweep: FERT per size from the demonstrations-only store, each on the held-out units
    sweep = json.loads((out / "fleet_size.json").read_text())
    assert set(sweep["arms"]) == {"fert_n1", "fert_n2"}
    assert all(row["average"]["trials"] == 2 for row in sweep["arms"].values())
    assert (out / "success_vs_fleet_size.png").stat().st_size > 1000
    n1 = ExperienceStore.open(str(out / "sweep" / "n1" / "store")).episodes(is_demo=False)
    assert n1 and {m.unit_id for m in n1} == {0}
    assert not ExperienceStore.open(str(out / "sweep" / "demo_store")).episodes(is_demo=False)
    assert state["sweep_n2"]["per_version"] and (out / "sweep" / "n2" / "registry").is_dir()
