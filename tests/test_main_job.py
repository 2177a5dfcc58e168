"""The main job end to end on real Meta-World, real Zarr, real Ray and a tiny real policy: demos, base
policies, fleet rounds with failure retries and FERT learners, comparison arms, two seeds, held-out evaluation,
tables bootstrapped over seeds, plot, audits, the fleet-size sweep and scripts/eval.py; and the default
protocol: compounding rounds with the critic's distillation, the learning curve and the ONNX export's arm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_main_job_tiny_end_to_end(tmp_path):
    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "task.tasks=[reach-v3]", "task.max_episode_steps=80",
            "robot.train_units=[0,1]", "robot.demo_units=[0,1]", "robot.heldout_units=[100,101]", "fleet.num_cpus=2",
            "job.seeds=[0,1]",
            "job.demos_per_task=3", "job.base_steps=10", "fleet.units=2", "job.fleet_episodes_per_unit=3",
            "job.videos=1", "job.video_episodes=2", "eval.trials_per_task=2",
            "fert.rounds=1", "learner.updates_per_version=5", "learner.batch_size=16",
            "fert.critic.updates=5", "fert.critic.hidden=16", "fert.critic.members=2", "fert.critic.candidates=2",
            "learner.validate_trials_per_task=2", "job.val_demos_per_task=1", "train.save_every=5",
            "train.batch_size=16", "train.wandb.enabled=false", "train.progress=false",
            "policy.dim=32", "policy.n_layers=1", "policy.n_heads=2", "policy.state_hidden=32",
            "policy.aed.tokenizer_vocab_size=128", "job.fleet_sizes=[1,2]", "job.sweep_episodes_per_unit=1",
            # the earlier protocol (experiments 1-25): one long fine-tuning run, the Ray fleet, the full arm set
            "learner.round_init=continue", "job.fleet_backend=ray", "job.curve_trials_per_task=0",
            "learner.failure_replay=true", "job.base_select=success", "job.base_select_trials_per_task=1",
            ("job.arms=[base,demos_bc,filtered_bc,filtered_bc_retries,fert,fert_finetuned,fert_no_critic,base_critic,"
             "fert_no_aed,base_no_aed]")]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "scripts/run.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "results.json").read_text())
    arms = {"base", "demos_bc", "filtered_bc", "filtered_bc_retries", "fert", "fert_finetuned", "fert_no_critic",
            "base_critic",
            "fert_no_aed", "base_no_aed"}
    assert set(table["arms"]) == arms and table["meta"]["seeds"] == [0, 1]
    for row in table["arms"].values():
        assert row["tasks"]["reach-v3"]["trials"] == 4                      # 2 trials x 2 seeds
        lo, hi = row["average"]["ci95"]
        assert 0.0 <= lo <= row["average"]["rate"] <= hi <= 1.0
    assert "| fert |" in (out / "results.md").read_text() and "Wilson" in (out / "results.md").read_text()
    assert (out / "arms.png").stat().st_size > 1000
    assert "[stage 1/" in proc.stdout and "train base (seed 0)" not in proc.stdout   # progress off here
    assert "resumes at round" not in proc.stdout + proc.stderr
    from experience_dict.store import ExperienceStore
    from fleet.fert.contexts import retry_of

    for s in (0, 1):
        sd = out / f"seed_{s}"
        state = json.loads((sd / "job_state.json").read_text())
        assert list((sd / "learner_fert" / "audits").glob("retrieval_audit_round_000.json"))
        rnd = state["round_0"]
        assert rnd["episodes"] == 6 and rnd["learners"]["fert"]["version"] == 2
        # the offline arms trained in a background process beside the last round's learner (job.overlap_offline_arms)
        assert all(state[a].get("background") for a in ("demos_bc", "filtered_bc", "filtered_bc_retries"))
        # the validation gate ran (2 trials per task cannot show a significant loss: published), and the
        # base was picked by its validation loss on the held-out demonstrations
        assert rnd["learners"]["fert"]["validation"]["accepted"] is True
        # ... choosing between the fine-tuned weights and the current ones, each with the round's new critic
        val = rnd["learners"]["fert"]["validation"]
        assert set(val["rates"]) == {"finetuned", "critic_only"}
        assert rnd["learners"]["fert"]["published_candidate"] == val["chosen"]
        assert val["rates"][val["chosen"]] == max(val["rates"].values())
        assert [p["step"] for p in state["base"]["val_curve"]] == [5, 10]
        # job.base_select=success: both saved checkpoints played the same training-unit plan; the base is the one
        # with the most successes (ties: the later)
        sc = state["base"]["success_curve"]
        assert [p["step"] for p in sc] == [5, 10] and all(p["trials"] == 1 for p in sc)
        best = max(sc, key=lambda p: (p["successes"], p["step"]))
        assert state["base"]["best_step"] == best["step"] and state["base"]["checkpoint"] == best["checkpoint"]
        assert rnd["retries"]["failures"] == 6 - rnd["successes"]
        # failure replay: the round's new weights replayed exactly the failed fleet trials
        fr = rnd["learners"]["fert"]["failure_replay"]
        assert fr["failures"] == len(rnd["failed_trials"]) == 6 - rnd["successes"]
        assert 0 <= fr["solved"] <= fr["failures"] and sum(n for _, n in fr["per_task"].values()) == fr["failures"]
        # the round's success critic learned from every training-unit episode (successes and failures), and
        # the critic arms are FERT's weights without it and the base's weights with it
        assert rnd["learners"]["fert"]["critic"]["episodes"] >= 6
        from policies.critic import CRITIC_FILES

        assert all((sd / "base_critic" / f).is_file() for f in CRITIC_FILES)
        assert not any((sd / "fert_no_critic" / f).exists() for f in CRITIC_FILES)
        ft = table["meta"]["checkpoints"][str(s)]["fert_finetuned"]
        assert all((Path(ft) / f).is_file() for f in CRITIC_FILES) and "learner_fert" in ft
        # the fleet ran the fixed plan with the base (v1); retries re-ran failed trials on training units only
        train_eps = ExperienceStore.open(str(sd / "store")).episodes()
        assert {m.unit_id for m in train_eps} <= {0, 1}
        fleet = [m for m in train_eps if not m.is_demo and not retry_of(m)]
        retries = [m for m in train_eps if retry_of(m)]
        assert len(fleet) == 6 and {m.policy_version for m in fleet} == {1}
        assert len(retries) == rnd["retries"]["retries"]
        by_id = {m.episode_id: m for m in fleet}
        for m in retries:
            src = by_id[retry_of(m)]
            assert not src.success and (m.unit_id, m.seed, m.task) == (src.unit_id, src.seed, src.task)
        eval_eps = ExperienceStore.open(str(sd / "eval_store")).episodes()
        reused = {a for a in arms
                  if json.loads((sd / "episodes" / f"{a}.json").read_text())[0].get("same_checkpoint_as")}
        assert {m.unit_id for m in eval_eps} <= {100, 101} and len(eval_eps) == 2 * (len(arms) - len(reused))
        assert {"fert", "fert_finetuned"} & reused or rnd["learners"]["fert"]["published_candidate"] != "finetuned"
        # every arm ran the same held-out trials (task, unit, reset seed): compared trial by trial
        eps = {arm: json.loads((sd / "episodes" / f"{arm}.json").read_text()) for arm in arms}
        trials = {arm: sorted((e["task"], e["unit_id"], e["seed"]) for e in v) for arm, v in eps.items()}
        assert len({tuple(t) for t in trials.values()}) == 1 and len(trials["fert"]) == 2
    # replayed by the version that failed them (the base, v1), every failed fleet trial fails again: a trial is
    # a function of (task, unit, reset seed, weights), so failure_replay counts only what an update changed
    from fleet.experiment.protocol import failure_replay

    sd0 = out / "seed_0"
    st0 = json.loads((sd0 / "job_state.json").read_text())
    c0 = json.loads((sd0 / "config.json").read_text())
    failed = st0["round_0"]["failed_trials"]
    if failed:
        again = failure_replay(c0, st0["base"]["checkpoint"], failed, str(tmp_path / "replay_store"), [100, 101])
        assert again["failures"] == len(failed) and again["solved"] == 0
    # the same plan on both seeds' held-out evaluation; different fleet trials per seed
    s0 = json.loads((out / "seed_0" / "episodes" / "base.json").read_text())
    s1 = json.loads((out / "seed_1" / "episodes" / "base.json").read_text())
    assert [(e["unit_id"], e["seed"]) for e in s0] == [(e["unit_id"], e["seed"]) for e in s1]
    paired = json.loads((out / "paired.json").read_text())
    assert [(r["arm"], r["baseline"]) for r in paired["pairs"]][:3] == [
        ("fert", "base"), ("fert", "filtered_bc"), ("fert", "filtered_bc_retries")]
    assert all(r["average"]["pairs"] == 4 and r["average"]["seeds"] == 2 for r in paired["pairs"])
    assert "fert − base" in (out / "paired.md").read_text() and "resamples the seeds" in proc.stdout
    # the fleet-size sweep: the main loop per size from the seed's demonstrations, fert (K = 1) and filtered BC +
    # retries of each size on the held-out units
    sweep = json.loads((out / "fleet_size.json").read_text())
    assert set(sweep["arms"]) == {"base", "fert_n1", "fert_n2", "filtered_bc_retries_n1", "filtered_bc_retries_n2"}
    assert all(row["average"]["trials"] == 2 for row in sweep["arms"].values())
    assert (out / "success_vs_fleet_size.png").stat().st_size > 1000
    sd = out / "seed_0"
    n1 = ExperienceStore.open(str(sd / "sweep" / "n1" / "store"))
    n2 = ExperienceStore.open(str(sd / "sweep" / "n2" / "store"))
    # exactly sweep_episodes_per_unit (1) episodes per unit per round (1 round), with the base version, after the
    # seed's own demonstrations
    assert [(m.unit_id, m.policy_version) for m in n1.episodes(is_demo=False) if not retry_of(m)] == [(0, 1)]
    assert sorted((m.unit_id, m.policy_version) for m in n2.episodes(is_demo=False) if not retry_of(m)) == [
        (0, 1), (1, 1)]
    assert len(n1.episodes(is_demo=True)) == len(ExperienceStore.open(str(sd / "store")).episodes(is_demo=True))
    pairs = [(p["arm"], p["baseline"]) for p in json.loads((out / "fleet_size_paired.json").read_text())["pairs"]]
    assert ("fert_n2", "fert_n1") in pairs and ("fert_n2", "filtered_bc_retries_n2") in pairs
    n2_state = json.loads((sd / "sweep" / "n2" / "job_state.json").read_text())
    assert n2_state["round_0"]["episodes"] == 2 and (sd / "sweep" / "n2" / "registry").is_dir()
    state = json.loads((sd / "job_state.json").read_text())
    assert list((out / "videos").rglob("*.mp4"))
    # an unknown arm is refused before any work
    bad = subprocess.run([sys.executable, "scripts/run.py", f"hydra.run.dir={tmp_path / 'badarm'}",
                          "job.arms=[base,ferd]"], cwd=REPO, env=env, capture_output=True, text=True, check=False)
    assert bad.returncode != 0 and "unknown arms ['ferd']" in bad.stderr + bad.stdout
    assert not (tmp_path / "badarm" / "seed_0").exists()
    # no arm starts from base_no_aed: that base is not trained (nor counted in the stage estimate)
    only = tmp_path / "only_base"
    small = [a for a in args if not a.startswith(("hydra.run.dir", "job.seeds", "job.fleet_sizes"))]
    proc = subprocess.run([sys.executable, "scripts/run.py", f"hydra.run.dir={only}", *small, "job.seeds=[0]",
                           "job.arms=[base,demos_bc]"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "train base_no_aed" not in proc.stdout and not (only / "seed_0" / "base_no_aed").exists()
    assert set(json.loads((only / "results.json").read_text())["arms"]) == {"base", "demos_bc"}
    assert "[stage 1/5]" in proc.stdout     # demos, base, fleet round, demos_bc, evaluation

    # scripts/ablate.py: a variant fine-tuned on the frozen seed-0 store, evaluated paired against the base
    ab = tmp_path / "ablate"
    proc = subprocess.run([sys.executable, "scripts/ablate.py", f"hydra.run.dir={ab}", f"ablate.run_dir={sd}",
                           "ablate.arms=[fert_no_gate]", "learner.updates_per_version=3", "learner.batch_size=16",
                           "learner.wise_alpha=0.5", "learner.round_init=continue", "fert.rounds=1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    at = json.loads((ab / "ablate.json").read_text())
    assert set(at["arms"]) == {"base", "fert_no_gate"} and at["meta"]["fert"]["fert_no_gate"]["gate"]["enabled"] is False
    assert json.loads((ab / "ablate_paired.json").read_text())["pairs"][0]["average"]["pairs"] == 2
    # learner.wise_alpha: the arm's policy is its fine-tuned weights interpolated halfway toward the base
    from safetensors.torch import load_file

    wise = Path((ab / "seed_0" / "fert_no_gate" / "checkpoint.txt").read_text())
    assert wise.parent.name == "wise"
    w, b0 = load_file(str(wise / "model.safetensors")), load_file(str(Path(state["base"]["checkpoint"]) / "model.safetensors"))
    tuned = load_file(str(ab / "seed_0" / "fert_no_gate" / "train" / "checkpoints" / "0000003" / "pretrained_model"
                          / "model.safetensors"))
    k = next(k for k in w if w[k].is_floating_point() and not bool((tuned[k] == b0[k]).all()))
    assert bool(((w[k] - (b0[k] + tuned[k]) / 2).abs() < 1e-5).all())

    # scripts/eval.py: any checkpoints on any units and tasks, same table, paired against a baseline, videos
    ev = tmp_path / "eval"
    from policies.aed_diffusion.training import last_checkpoint

    # the fert arm is the learner's newest published version, fetched from the registry; the fine-tuned
    # candidate is by default the round's raw fine-tuned weights (learner.wise_alpha: null), a training step
    assert Path(table["meta"]["checkpoints"]["0"]["fert"]).parent.name == "arms"
    tuned_ckpt = Path(table["meta"]["checkpoints"]["0"]["fert_finetuned"])
    assert tuned_ckpt.name == "pretrained_model" and tuned_ckpt.parent.parent.name == "checkpoints"
    ckpts = {"base": state["base"]["checkpoint"],   # a training step dir is resolved to its pretrained_model too
             "fert": str(last_checkpoint(out / "seed_0" / "learner_fert" / "train"))}
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


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_default_job_compounds_rounds_with_a_learning_curve_and_the_export_arm(tmp_path):
    """The default protocol (learner.round_init: published): the batched fleet acts with the newest version, each
    round starts from it, distils the round's critic into the weights and is gated on the policies alone; the
    learning curve holds every published version on the held-out plan (K = 1 and with its critic); fert is the
    newest weights alone, fert_critic the same version with its critic, fert_onnx its export run by ONNX."""
    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "task.tasks=[reach-v3]", "task.max_episode_steps=150",
            "robot.train_units=[0,1]", "robot.demo_units=[0,1]", "robot.heldout_units=[100,101]",
            "job.demos_per_task=3", "job.base_steps=10", "fleet.units=2", "job.fleet_episodes_per_unit=3",
            "job.videos=0", "eval.trials_per_task=3", "job.curve_trials_per_task=3", "fert.rounds=2",
            "learner.updates_per_version=5", "learner.batch_size=16", "fert.critic.updates=5", "fert.critic.hidden=16",
            "fert.critic.members=2", "fert.critic.candidates=2", "fert.distill.states_per_task=16",
            "learner.validate_trials_per_task=2", "job.val_demos_per_task=1", "train.save_every=5",
            "train.batch_size=16", "train.wandb.enabled=false", "train.progress=false",
            "policy.dim=32", "policy.n_layers=1", "policy.n_heads=2", "policy.state_hidden=32",
            "policy.aed.tokenizer_vocab_size=128",
            "job.arms=[base,filtered_bc_retries,fert,fert_critic,fert_onnx,fert_no_distill]"]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "scripts/run.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1100, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = json.loads((out / "results.json").read_text())
    assert set(table["arms"]) == {"base", "filtered_bc_retries", "fert", "fert_critic", "fert_onnx", "fert_no_distill"}
    # an in-loop ablation is credited like fert, its weights alone (K = 1): its learner's critic is not shipped
    from policies.critic import CRITIC_FILES

    abl = Path(table["meta"]["checkpoints"]["0"]["fert_no_distill"])
    assert (abl / "model.safetensors").exists() and not any((abl / f).exists() for f in CRITIC_FILES)
    # the learning curve: the base and both published versions, the same 3 held-out trials each, printed as it grew
    curve = table["learning_curve"]["0"]
    assert [p["version"] for p in curve] == [1, 2, 3] and [p["round"] for p in curve] == [-1, 0, 1]
    assert all(p["trials"] == 3 and 0.0 <= p["heldout"] <= 1.0 for p in curve)
    assert curve[0]["heldout_critic"] is None and all(p["heldout_critic"] is not None for p in curve[1:])
    # round 0's versions were evaluated in the background while round 1 worked (collected, then v3 here)
    assert proc.stdout.count("learning curve (seed 0") == 2
    # the gate's plan is the same every round: round 1's current version (round 0's accepted candidate) is not
    # played again
    vdir = out / "seed_0" / "validation" / "episodes"
    reused = json.loads((vdir / "round_1_current.json").read_text())
    assert reused[0]["same_checkpoint_as"] == "round_0_finetuned"
    assert not (out / "seed_0" / "validation" / "round_0").exists()
    # the final arms reuse the curve's episodes: fert is the newest version alone, fert_critic with its critic
    eps = {a: json.loads((out / "seed_0" / "episodes" / f"{a}.json").read_text()) for a in table["arms"]}
    assert eps["fert"][0]["same_checkpoint_as"] == "curve_v3" and eps["fert_critic"][0]["same_checkpoint_as"] == "curve_v3_critic"
    assert eps["base"][0]["same_checkpoint_as"] == "curve_v1"
    assert table["arms"]["fert"]["average"]["successes"] == curve[-1]["successes"]
    # fert_onnx: the export of fert's weights, its ONNX graph at batch 1, on the same trials
    from policies.critic import CRITIC_FILES

    exp = Path(table["meta"]["checkpoints"]["0"]["fert_onnx"])
    meta = json.loads((exp / "export.json").read_text())
    assert meta["onnx"][0]["batch_size"] == 1 and not any((exp / f).exists() for f in CRITIC_FILES)
    assert [(e["unit_id"], e["seed"]) for e in eps["fert_onnx"]] == [(e["unit_id"], e["seed"]) for e in eps["fert"]]
    state = json.loads((out / "seed_0" / "job_state.json").read_text())
    for r in (0, 1):
        rnd = state[f"round_{r}"]
        lr = rnd["learners"]["fert"]
        assert rnd["backend"] == "vector" and rnd["version"] == r + 1 and set(rnd["times"]) == {"fleet_s", "retries_s"}
        assert lr["validation"]["policy_alone"] is True and lr["version"] == r + 2
        assert lr["mix"]["distill"]["states"] == 16 and "replay:reach-v3" in lr["mix"]["slots"]
        assert {"critic_s", "candidates_s", "distill_s", "train_s", "validation_s"} <= set(lr["times"])
        assert rnd["round_s"] >= rnd["wall_s"] + lr["times"]["train_s"] and f"round {r} wall time" in proc.stdout
    assert (out / "arms.png").stat().st_size > 1000
    # what stdout said is in the run's log too, and the learning curve in results.md (issue 52, item 11)
    log = (out / "run.log").read_text()
    assert "=== [stage" in log and "learning curve (seed 0" in log and "| fert |" in log
    md = (out / "results.md").read_text()
    assert "learning curve (seed 0" in md and "v3" in md
    # the same learning run asynchronously (scripts/async_run.py): from this seed's demos and base, the learner in its
    # own process beside a fleet that never waits; every version on the same held-out trials, with staleness
    arun = tmp_path / "async"
    proc = subprocess.run([sys.executable, "scripts/async_run.py", f"hydra.run.dir={arun}",
                           f"async_run.from_dir={out / 'seed_0'}", "async_run.wave=2", "async_run.min_new_episodes=3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((arun / "async.json").read_text())
    acurve = rep["learning_curve"]
    assert [p["version"] for p in acurve] == [1, 2, 3] and acurve[0]["successes"] == curve[0]["successes"]
    assert acurve[0]["t_s"] == 0.0 and acurve[0]["fleet_episodes"] == 0 and all(p["trials"] == 3 for p in acurve)
    assert 0 < acurve[1]["t_s"] < acurve[2]["t_s"] and 0 < acurve[1]["fleet_episodes"] <= acurve[2]["fleet_episodes"]
    assert rep["learner"]["round"] == 2 and rep["fleet_episodes"] == rep["staleness"]["episodes"] > 0
    assert sum(w["trials"] for w in rep["waves"]) == rep["fleet_episodes"] and all(w["trials"] <= 2 for w in rep["waves"])
    assert {w["version"] for w in rep["waves"]} >= {1}
    # the final comparison pairs the same held-out trials as the synchronous job's arms
    pairs = {(p["arm"], p["baseline"]) for p in rep["paired"]["pairs"]}
    assert {("fert", "base"), ("fert", "fert_sync"), ("fert_critic", "fert_critic_sync")} <= pairs
    assert rep["table"]["arms"]["base"]["average"]["trials"] == 3 and (arun / "async_curve.png").stat().st_size > 1000
    from experience_dict.store import ExperienceStore

    demos = ExperienceStore.open(str(arun / "store")).episodes(is_demo=True)
    assert len(demos) == 3 and all(int(m.unit_id) in (0, 1) for m in demos)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_a_mixed_fleet_with_cameras_end_to_end(tmp_path):
    """The default loop with a mixed fleet that sees through a camera: Meta-World's Sawyer and the SO-100 twin
    write one store (each episode at its own rate, with its embodiment), one policy reads proprioception, the
    embodiment one-hot and a 32 x 32 camera (no object state); the success critic scores the camera through the
    policy's frozen encoder; the ONNX arm runs the image graph; scripts/compare_runs.py pairs the run's arms."""
    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "task=mixed", "task.tasks=[reach-v3,so100-reach]", "task.max_episode_steps=150",
            "task.max_episode_steps_by_embodiment={sawyer: 110}", "obs=vision", "obs.image_size=32",
            "obs.embodiment_feature=true", "policy.images=true",
            "policy.input_keys=[observation.state,observation.embodiment,observation.images.corner]",
            "robot.train_units=[0,1]", "robot.demo_units=[0,1]", "robot.heldout_units=[100,101]",
            "job.demos_per_task=2", "job.base_steps=10", "fleet.units=2", "job.fleet_episodes_per_unit=2",
            "job.videos=0", "eval.trials_per_task=2", "fert.rounds=1", "learner.updates_per_version=5",
            "learner.batch_size=8", "fert.critic.updates=5", "fert.critic.hidden=16", "fert.critic.members=2",
            "fert.critic.candidates=2", "fert.distill.states_per_task=8", "learner.validate_trials_per_task=1",
            "job.val_demos_per_task=1", "train.save_every=5", "train.batch_size=8", "train.wandb.enabled=false",
            "train.progress=false", "job.curve_trials_per_task=0", "policy.dim=32", "policy.n_layers=1",
            "policy.n_heads=2", "policy.state_hidden=32", "policy.image_channels=[8,16]",
            "policy.aed.tokenizer_vocab_size=128"]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "scripts/run.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=1100, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from experience_dict.store import ExperienceStore

    st = ExperienceStore.open(str(out / "seed_0" / "store"))
    seen = {(m.task, m.embodiment, st.episode_hz(m)) for m in st.episodes()}
    assert seen == {("reach-v3", "sawyer", 80.0), ("so100-reach", "so100", 30.0)}
    assert {"observation.embodiment", "observation.images.corner"} <= set(st.keys)
    assert max(m.length for m in st.episodes(task="reach-v3")) <= 110 < max(m.length for m in st.episodes(task="so100-reach"))
    critic = json.loads((out / "seed_0" / "registry" / "v000002" / "critic.json").read_text())
    assert critic["image_keys"] == ["observation.images.corner"]
    assert critic["state_keys"] == ["observation.state", "observation.embodiment"] and critic["state_dim"] == 4 + 2 + 16
    table = json.loads((out / "results.json").read_text())
    assert {"base", "fert", "fert_onnx"} <= set(table["arms"])
    assert all(row["tasks"][t]["trials"] == 2 for row in table["arms"].values() for t in ("reach-v3", "so100-reach"))
    cmp = subprocess.run([sys.executable, "scripts/compare_runs.py", "--run", f"a={out}", "--run", f"b={out}",
                          "--arms", "base,fert", "--pair", "a:fert-a:base", "--out", str(tmp_path / "cmp")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert cmp.returncode == 0, cmp.stderr
    paired = json.loads((tmp_path / "cmp" / "paired.json").read_text())
    same = next(p for p in paired["pairs"] if p["arm"] == "a:fert" and p["baseline"] == "b:fert")
    assert same["average"]["pairs"] == 4 and same["average"]["diff"] == 0.0   # a run against itself, trial by trial
    bad = subprocess.run([sys.executable, "scripts/compare_runs.py", "--run", f"a={out}", "--arms", "nope",
                          "--out", str(tmp_path / "cmp2")], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert bad.returncode == 2 and "no held-out episodes of arm 'nope'" in bad.stderr
