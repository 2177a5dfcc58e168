"""scripts/compare_policies.py end to end on real Meta-World, a real Zarr store and tiny real policies: the same
demonstrations, one base per variant (the variant's fields merged into the policy node), every variant on the same
held-out trials, paired tables; a re-run resumes; bad variants fail before any work."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.compare_policies import DEFAULT_VARIANTS, variant_policies

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
       "RAY_AUTH_MODE": "disabled"}


def test_variants_merge_over_the_policy_node():
    policy = {"action_patch": 4, "condition_layers": 0, "dim": 96, "aed": {"enabled": True, "group_size": 4}}
    out = variant_policies(policy, {"a": {"action_patch": 1, "aed": {"enabled": False}}, "b": {}})
    assert out["a"] == {"action_patch": 1, "condition_layers": 0, "dim": 96, "aed": {"enabled": False, "group_size": 4}}
    assert out["b"] == policy and policy["action_patch"] == 4  # the composed node is not modified
    assert variant_policies(policy, DEFAULT_VARIANTS)["earlier_form"]["condition_layers"] is None
    with pytest.raises(SystemExit, match="compare.variants.bad: expected a mapping"):
        variant_policies(policy, {"bad": 3})
    with pytest.raises(SystemExit, match="at least one"):
        variant_policies(policy, {})


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_compare_policies_tiny_end_to_end(tmp_path):
    out = tmp_path / "cmp"
    args = [f"hydra.run.dir={out}", "task.tasks=[reach-v3]", "task.max_episode_steps=60",
            "robot.train_units=[0,1]", "robot.demo_units=[0,1]", "robot.heldout_units=[100,101]",
            "job.demos_per_task=2", "job.val_demos_per_task=1", "job.base_steps=10", "train.save_every=5",
            "train.batch_size=16", "train.wandb.enabled=false", "train.progress=false", "eval.trials_per_task=4",
            "eval.videos=0", "policy.dim=32", "policy.n_layers=2", "policy.n_heads=2", "policy.state_hidden=32",
            "policy.aed.tokenizer_vocab_size=128",
            "compare.variants={p1: {action_patch: 1, condition_layers: null}, p4c0: {action_patch: 4, condition_layers: 0}}",
            "compare.baseline=p1"]
    proc = subprocess.run([sys.executable, "scripts/compare_policies.py", *args], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=800, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "results.json").read_text())
    assert set(table["arms"]) == {"p1", "p4c0"} and table["meta"]["baseline"] == "p1"
    assert all(row["tasks"]["reach-v3"]["trials"] == 4 for row in table["arms"].values())
    paired = json.loads((out / "paired.json").read_text())
    assert [(p["arm"], p["baseline"]) for p in paired["pairs"]] == [("p4c0", "p1")]
    assert paired["pairs"][0]["average"]["pairs"] == 4  # the same 4 held-out trials, matched
    for name, patch in (("p1", 1), ("p4c0", 4)):  # each variant's base carries its own fields
        state = json.loads((out / "seed_0" / "job_state.json").read_text())
        cfg = json.loads((Path(state[f"variant_{name}"]["checkpoint"]) / "config.json").read_text())
        assert cfg["action_patch"] == patch and cfg["dim"] == 32
    timing = json.loads((out / "timing.json").read_text())
    assert set(timing["0"]) == {"p1", "p4c0"} and all(t["wall_s"] > 0 for t in timing["0"].values())
    # a re-run resumes: nothing is trained or evaluated again
    again = subprocess.run([sys.executable, "scripts/compare_policies.py", *args], cwd=REPO, env=ENV,
                           capture_output=True, text=True, timeout=300, check=False)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads((out / "results.json").read_text())["arms"] == table["arms"]
    bad = subprocess.run([sys.executable, "scripts/compare_policies.py", f"hydra.run.dir={tmp_path / 'bad'}",
                          "compare.baseline=nope"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120,
                         check=False)
    assert bad.returncode != 0 and "compare.baseline: expected one of the variants" in bad.stdout + bad.stderr
    assert not (tmp_path / "bad" / "seed_0").exists()
