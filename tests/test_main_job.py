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
    assert set(table["arms"]) == {"base", "filtered_bc", "fert", "fert_no_aed", "base_no_aed"}
    for row in table["arms"].values():
        assert row["tasks"]["reach-v3"]["trials"] == 2
        lo, hi = row["average"]["ci95"]
        assert 0.0 <= lo <= row["average"]["rate"] <= hi <= 1.0
    assert "| fert |" in (out / "results.md").read_text()
    assert (out / "success_per_round.png").stat().st_size > 1000
    assert list((out / "learner_fert" / "audits").glob("retrieval_audit_round_000.json"))
    state = json.loads((out / "job_state.json").read_text())
    assert state["fert"]["learner"]["published"] == [2]           # v1 = base, v2 = FERT round 0
    stale = state["fert"]["staleness"]   # versions behind the newest at commit: reported, and bounded by 1 here
    assert stale["episodes"] == state["fert"]["fleet_episodes"] and stale["max"] <= 1
    assert sum(stale["counts"].values()) == stale["episodes"] and "fleet staleness" in proc.stdout
    # every fleet episode was committed with the version that acted; held-out units never reached training
    from experience_dict.store import ExperienceStore

    train_eps = ExperienceStore.open(str(out / "store")).episodes()
    assert {m.unit_id for m in train_eps} <= {0, 1}
    assert {m.policy_version for m in train_eps if not m.is_demo} <= {1, 2}
    eval_eps = ExperienceStore.open(str(out / "eval_store")).episodes()
    assert {m.unit_id for m in eval_eps} <= {100, 101} and len(eval_eps) == 10
    assert list((out / "videos").rglob("*.mp4"))
    assert "held-out success" in proc.stdout
    # every arm ran the same held-out trials (task, unit, reset seed): compared trial by trial in paired.json
    eps = {arm: json.loads((out / "episodes" / f"{arm}.json").read_text()) for arm in table["arms"]}
    trials = {arm: sorted((e["task"], e["unit_id"], e["seed"]) for e in v) for arm, v in eps.items()}
    assert len({tuple(t) for t in trials.values()}) == 1 and len(trials["fert"]) == 2
    paired = json.loads((out / "paired.json").read_text())
    assert [(r["arm"], r["baseline"]) for r in paired["pairs"]][:2] == [("fert", "base"), ("fert", "filtered_bc")]
    assert all(r["average"]["pairs"] == 2 for r in paired["pairs"])
    assert "fert − base" in (out / "paired.md").read_text() and "trial-by-trial" in proc.stdout
    # the fleet-size sweep: FERT per size from the demonstrations-only store, each on the held-out units
    sweep = json.loads((out / "fleet_size.json").read_text())
    assert set(sweep["arms"]) == {"fert_n1", "fert_n2"}
    assert all(row["average"]["trials"] == 2 for row in sweep["arms"].values())
    assert (out / "success_vs_fleet_size.png").stat().st_size > 1000
    n1 = ExperienceStore.open(str(out / "sweep" / "n1" / "store")).episodes(is_demo=False)
    n2 = ExperienceStore.open(str(out / "sweep" / "n2" / "store")).episodes(is_demo=False)
    # exactly sweep_episodes_per_unit (1) episodes per unit per round (1 round), with the base version
    assert [(m.unit_id, m.policy_version) for m in n1] == [(0, 1)]
    assert sorted((m.unit_id, m.policy_version) for m in n2) == [(0, 1), (1, 1)]
    assert json.loads((out / "fleet_size_paired.json").read_text())["pairs"][0]["arm"] == "fert_n2"
    assert not ExperienceStore.open(str(out / "sweep" / "demo_store")).episodes(is_demo=False)
    assert state["sweep_n2"]["per_version"] and (out / "sweep" / "n2" / "registry").is_dir()

    # scripts/eval.py: any checkpoints on any units and tasks, same table, paired against a baseline, videos
    ev = tmp_path / "eval"
    ckpts = {"base": state["base"]["checkpoint"],
             "fert": str(Path(table["meta"]["checkpoints"]["fert"]).parent)}   # a step dir is resolved too
    arg = "eval.checkpoints={" + ", ".join(f"{k}: '{v}'" for k, v in ckpts.items()) + "}"
    proc = subprocess.run([sys.executable, "scripts/eval.py", f"hydra.run.dir={ev}", arg, "eval.baseline=base",
                           "eval.trials_per_task=3", "eval.units=[101]", "task.tasks=[reach-v3]",
                           "task.max_episode_steps=80", "fleet.num_cpus=2", "eval.videos=1", "eval.video_episodes=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    et = json.loads((ev / "results.json").read_text())
    assert set(et["arms"]) == {"base", "fert"} and et["meta"]["units"] == [101]
    assert all(row["tasks"]["reach-v3"]["trials"] == 3 for row in et["arms"].values())
    assert json.loads((ev / "paired.json").read_text())["pairs"][0]["average"]["pairs"] == 3
    assert list((ev / "videos" / "fert").glob("*.mp4")) and "| fert |" in (ev / "results.md").read_text()
    bad = subprocess.run([sys.executable, "scripts/eval.py", f"hydra.run.dir={tmp_path / 'bad'}",
                          f"eval.checkpoint={tmp_path / 'nope'}"], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "is not a checkpoint directory" in bad.stderr + bad.stdout
