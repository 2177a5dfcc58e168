"""The deployed preset (``experiment=deployed``, issue 48) on real MuJoCo, real Zarr and a tiny real policy: recovery
goes on from the failure state and never resets the world; the success detector sees the unit's own cameras, is
saved and loaded safely, learns from labelled frames, and its labels are the only ones a learner reads."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.test_fleet import _plain, make_cfg, tiny_aed_checkpoint

REPO = Path(__file__).resolve().parents[1]


def _reach(unit=0, **task):
    from sim import make_env

    return make_env("reach-v3", unit, obs_cfg={"images": True, "cameras": ["corner", "topview"], "image_size": 32},
                    task_cfg={"max_episode_steps": 20, **task})


def test_continue_episode_goes_on_from_where_the_last_one_ended():
    env = _reach()
    with pytest.raises(RuntimeError, match="no episode to continue"):
        env.continue_episode(10)
    obs, _ = env.reset(seed=3)
    push = np.array([1.0, 0.0, 0.0, -1.0], np.float32)
    for t in range(20):
        obs, _, term, trunc, _ = env.step(push)
    assert trunc and not term
    hand = obs["observation.state"][:3].copy()
    qpos = env.mj_data.qpos.copy()
    env.continue_episode(5)
    np.testing.assert_array_equal(env.mj_data.qpos, qpos)      # nothing in the world moved back
    obs, _, _, trunc, _ = env.step(push)
    assert np.linalg.norm(obs["observation.state"][:3] - hand) < 0.03 and not trunc
    for _ in range(4):
        *_, trunc, _ = env.step(push)
    assert trunc and env.max_episode_steps == 5
    with pytest.raises(ValueError, match="max_steps >= 1"):
        env.continue_episode(0)
    env.reset(seed=3)
    assert env.max_episode_steps == 20        # a reset restores the configured length


def test_the_simulators_success_does_not_end_an_episode_when_told_so():
    from sim import make_env, make_expert

    ends = {}
    for stop in (True, False):
        env = make_env("reach-v3", 0, task_cfg={"max_episode_steps": 120, "steps_after_success": 2,
                                                "stop_on_success": stop})
        expert = make_expert(env)
        obs, _ = env.reset(seed=1)
        ok, t = False, 0
        while True:
            obs, _, term, trunc, info = env.step(expert.act(obs))
            ok, t = ok or info["success"], t + 1
            if term or trunc:
                break
        assert ok
        ends[stop] = (t, term)
    assert ends[True][1] and ends[True][0] < 120
    assert ends[False] == (120, False)


def test_frame_grabber_renders_each_units_own_camera():
    from sim.gl import FrameGrabber

    g = FrameGrabber(32, 32)
    for unit in (0, 5):   # units differ in camera pose, lights and colours; one shared renderer draws both
        env = _reach(unit)
        obs, _ = env.reset(seed=2)
        f = g.frames(env, ["corner", "topview"])
        assert f.shape == (2, 32, 32, 3) and f.dtype == np.uint8
        np.testing.assert_array_equal(f[0], obs["observation.images.corner"])
        np.testing.assert_array_equal(f[1], obs["observation.images.topview"])
    g.close()


def test_success_detector_round_trip_and_refusals(tmp_path):
    from policies.success_detector import DetectorSpec, SuccessDetector

    torch.manual_seed(0)
    det = SuccessDetector(DetectorSpec(tasks=["reach-v3", "push-v3"], cameras=["corner"], image_size=32,
                                       threshold=0.4))
    frames = torch.randint(0, 255, (3, 1, 32, 32, 3), dtype=torch.uint8)
    state, task = torch.randn(3, 4), torch.tensor([0, 1, 0])
    det.save(tmp_path / "d")
    back = SuccessDetector.load(tmp_path / "d")
    assert back.spec.threshold == 0.4 and not any(p.suffix == ".pkl" for p in (tmp_path / "d").iterdir())
    torch.testing.assert_close(back.probability(frames, state, task), det.probability(frames, state, task))
    with pytest.raises(ValueError, match="expected frames"):
        det(torch.zeros(3, 2, 32, 32, 3, dtype=torch.uint8), state, task)
    with pytest.raises(KeyError, match="not among its tasks"):
        det.task_index("door-open-v3")
    wider = SuccessDetector(DetectorSpec(tasks=["reach-v3", "push-v3"], cameras=["corner"], image_size=32, width=8))
    wider.save(tmp_path / "w")
    meta = json.loads((tmp_path / "d" / "detector.json").read_text())
    (tmp_path / "w" / "detector.json").write_text(json.dumps(meta))   # a spec that does not fit the weights
    with pytest.raises(ValueError, match="expected shape"):
        SuccessDetector.load(tmp_path / "w")
    with pytest.raises(FileNotFoundError, match="holds no success detector"):
        SuccessDetector.load(tmp_path)


def test_fit_from_records_learns_a_visible_success_and_picks_its_threshold(tmp_path):
    """Synthetic labelled episodes: a success shows a bright patch in the camera from its success moment on; the
    detector fitted on them judges held-out labelled episodes correctly."""
    from fleet.labels import fit_from_records, load_records, save_record
    from policies.success_detector import SuccessDetector

    rng = np.random.default_rng(0)
    for e in range(24):
        ok = e % 2 == 0
        first = int(rng.integers(6, 14)) if ok else None
        steps = list(range(2, 21, 2))
        frames = []
        for s in steps:
            f = rng.integers(0, 60, (1, 16, 16, 3)).astype(np.uint8)
            if ok and s >= first:
                f[0, 4:10, 4:10] = 250
            frames.append(f)
        save_record(tmp_path / "rec", f"unit-0000-{e:06d}", "reach-v3", frames,
                    [rng.normal(size=4).astype(np.float32) for _ in steps], steps, ok, first)
    assert len(load_records(tmp_path / "rec")) == 24
    labels = {"cameras": ["corner"], "image_size": 16, "every": 2, "updates": 150, "batch_size": 32, "width": 8,
              "val_share": 0.25}
    out = fit_from_records(tmp_path / "rec", labels, ["reach-v3"], tmp_path / "det", seed=0)
    assert out["episodes"] == 24 and out["validation"]["n"] == 6
    assert out["validation"]["precision"] == 1.0 and out["validation"]["recall"] == 1.0
    det = SuccessDetector.load(tmp_path / "det")
    assert det.spec.threshold == out["threshold"] and json.loads((tmp_path / "det" / "fit.json").read_text())
    with pytest.raises(ValueError, match="all failures"):
        for f in (tmp_path / "rec").glob("*.npz"):
            z = dict(np.load(f))
            z["success"] = np.array(False)
            np.savez(f, **z)
        fit_from_records(tmp_path / "rec", labels, ["reach-v3"], tmp_path / "det2")


def test_fit_from_records_reads_only_the_detectors_cameras_and_colour(tmp_path):
    """A budget recorded with more cameras and coloured clouds than the detector reads (experiment 59 fits a
    cloud-only detector on experiment 55's records, made with three cameras): the fit picks the spec's cameras by
    name and the cloud's coordinates; a camera the records lack is refused by name."""
    from fleet.labels import fit_from_records, load_records, record_inputs, save_record
    from policies.success_detector import DetectorSpec

    rng = np.random.default_rng(1)
    for e in range(24):
        ok = e % 2 == 0
        first = int(rng.integers(6, 14)) if ok else None
        steps = list(range(2, 21, 2))
        frames, clouds = [], []
        for s in steps:
            f = rng.integers(0, 60, (2, 16, 16, 3)).astype(np.uint8)   # (topview: noise, corner: the patch)
            c = np.concatenate([rng.uniform(-0.5, 0.5, (32, 3)), rng.integers(0, 256, (32, 3))], -1)
            if ok and s >= first:
                f[1, 4:10, 4:10] = 250
                c[:8, 2] = 0.9   # the success also shows in the cloud's geometry
            frames.append(f)
            clouds.append(c.astype(np.float32))
        save_record(tmp_path / "rec", f"unit-0000-{e:06d}", "reach-v3", frames,
                    [rng.normal(size=4).astype(np.float32) for _ in steps], steps, ok, first, clouds=clouds,
                    cameras=["topview", "corner"])
    base = {"image_size": 16, "every": 2, "updates": 150, "batch_size": 32, "width": 8, "val_share": 0.25}
    out = fit_from_records(tmp_path / "rec", {**base, "cameras": ["corner"]}, ["reach-v3"], tmp_path / "cam", seed=0)
    assert out["validation"]["precision"] == 1.0 and out["validation"]["recall"] == 1.0
    out = fit_from_records(tmp_path / "rec", {**base, "cameras": [], "point_cloud": True, "num_points": 32},
                           ["reach-v3"], tmp_path / "cloud", seed=0)
    assert out["validation"]["accuracy"] >= 5 / 6
    rec = load_records(tmp_path / "rec")[0]
    sel = record_inputs(rec, DetectorSpec(tasks=["reach-v3"], cameras=["corner"], image_size=16, state_dim=4,
                                          num_points=32, point_color=False))
    assert sel["frames"].shape[1:] == (1, 16, 16, 3) and np.array_equal(sel["frames"][:, 0], rec["frames"][:, 1])
    assert sel["clouds"].shape[-1] == 3 and np.array_equal(sel["clouds"], rec["clouds"][..., :3])
    assert np.array_equal(record_inputs(sel, DetectorSpec(tasks=["reach-v3"], cameras=["corner"], image_size=16,
                                                          state_dim=4))["frames"], sel["frames"])   # idempotent
    with pytest.raises(ValueError, match=r"not \['gripperPOV'\]"):
        fit_from_records(tmp_path / "rec", {**base, "cameras": ["gripperPOV"]}, ["reach-v3"], tmp_path / "no")
    with pytest.raises(ValueError, match="clouds of 32 points"):
        fit_from_records(tmp_path / "rec", {**base, "cameras": [], "point_cloud": True, "num_points": 64},
                         ["reach-v3"], tmp_path / "no2")


def _constant_detector(path, fire: bool, cameras=("corner", "topview"), size=64):
    """A real detector whose verdict is fixed by its output bias (always fires, or never)."""
    from policies.success_detector import DetectorSpec, SuccessDetector

    det = SuccessDetector(DetectorSpec(tasks=["reach-v3"], cameras=list(cameras), image_size=size))
    with torch.no_grad():
        det.head[-1].weight.zero_()
        det.head[-1].bias.fill_(20.0 if fire else -20.0)
    return det.save(path)


def test_recovery_goes_on_from_the_failure_state_and_never_resets(tmp_path, monkeypatch):
    """A failed trial is followed at once by recovery attempts in the same world: the env is reset once per planned
    trial and never for a recovery; each recovery starts where the episode before it ended, and is committed with
    its chain (retry_of), attempt, exploration, label and the simulator's verdict (extra.oracle)."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet
    from fleet.labels import Acting
    from sim.metaworld_env import MetaWorldEnv

    resets = []
    orig = MetaWorldEnv.reset

    def counting_reset(self, *a, **kw):
        resets.append(kw.get("seed"))
        return orig(self, *a, **kw)

    monkeypatch.setattr(MetaWorldEnv, "reset", counting_reset)
    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=15"))
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 40 + u} for u in (0, 1)]
    acting = Acting("sim", {}, recovery={"start": "recovery", "attempts": 2, "recovery_steps": 10,
                                         "action_noise_std": 0.3})
    url = str(tmp_path / "store")
    with VectorFleet(c, str(ckpt), url, batch_size=2, processes=1, acting=acting) as vf:
        eps = vf.run(plan=plan, progress=False).episodes
    assert sorted(resets) == [40, 41]                 # one reset per planned trial, none for a recovery
    failed = [e for e in eps if not e["success"]]
    assert failed and all(e["recoveries"] for e in failed)
    reader = ExperienceStore.open(url)
    metas = {m.episode_id: m for m in reader.episodes()}
    for e in failed:
        prev = e["episode_id"]
        for k, r in enumerate(e["recoveries"]):
            m = metas[r["episode_id"]]
            assert m.extra["retry_of"] == prev and m.extra["attempt"] == k and m.extra["recovery"] is True
            assert m.extra["exploration"]["action_noise_std"] == pytest.approx(0.3 * 1.3 ** k)
            assert m.extra["label"]["source"] == "sim" and "success" in m.extra["oracle"] and m.length <= 10
            before = reader.load_episode(prev, keys=["observation.state", "action"])
            after = reader.load_episode(m.episode_id, keys=["observation.state"])
            # the recovery's first frame is one step on from the last frame of the episode it follows
            assert np.linalg.norm(after["observation.state"][0, :3] - before["observation.state"][-1, :3]) < 0.03
            prev = m.episode_id
        assert len(e["recoveries"]) == 2 or e["recoveries"][-1]["success"]


def test_the_detectors_labels_are_the_only_labels_the_learner_reads(tmp_path):
    """A detector that always fires labels every episode a success and ends it ``steps_after_success`` steps after
    its first judgement, whatever the simulator says; the critic's training targets follow those labels; no learner
    module reads the simulator's verdict (``extra.oracle``)."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet
    from fleet.fert.critic_fit import critic_arrays
    from fleet.labels import Acting, label_audit

    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=40",
                        "task.steps_after_success=3"))
    labels = {"cameras": ["corner", "topview"], "image_size": 64, "every": 5}
    det = _constant_detector(tmp_path / "det", fire=True)
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 7 + u} for u in (0, 1, 2)]
    url = str(tmp_path / "store")
    with VectorFleet(c, str(ckpt), url, batch_size=3, processes=1) as vf:
        eps = vf.run(plan=plan, progress=False, acting=Acting("detector", labels, detector_dir=str(det))).episodes
    reader = ExperienceStore.open(url)
    metas = reader.episodes()
    assert len(metas) == 3 and all(m.success and m.length == 5 + 3 for m in metas)
    assert all(m.extra["label"] == {"source": "detector", "fired_at": 5, "p_max": 1.0, "threshold": 0.5}
               for m in metas)
    assert all(m.termination == "terminated" for m in metas)
    oracle = [m.extra["oracle"]["success"] for m in metas]
    audit = label_audit(metas)["overall"]
    assert audit["n"] == 3 and audit["fp"] == oracle.count(False) and [e["oracle_success"] for e in eps] == oracle
    rows = critic_arrays(reader, metas, ["observation.state"], 4, 3, 0.99)
    assert (rows["target"][rows["episode"] == 0] > 0).all()   # a success by its label, whatever the simulator said
    # no learner-side module reads the simulator's verdict
    learner_side = [*(REPO / "fleet" / "fert").glob("*.py"), *(REPO / "policies").rglob("*.py"),
                    *(REPO / "experience_dict").rglob("*.py"), REPO / "fleet" / "experiment" / "arms.py",
                    REPO / "fleet" / "experiment" / "offline.py", REPO / "fleet" / "experiment" / "bases.py"]
    assert not [p.name for p in learner_side if "oracle" in p.read_text()]


def test_labels_too_close_to_the_threshold_are_left_out_of_the_learners_data(tmp_path):
    """``labels.trust_margin``: a detector that fires at p = 0.6 against its threshold of 0.5 labels every episode a
    success; a learner whose margin is 0.2 reads none of them (neither successes nor failures), one with 0.05 reads
    all, and demonstrations and the person's labels are always read."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet, collect_demos
    from fleet.labels import Acting, TrustedLabels, learner_reader, trusted_label

    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=30",
                        "task.steps_after_success=3"))
    labels = {"cameras": ["corner", "topview"], "image_size": 64, "every": 5}
    det = _constant_detector(tmp_path / "det", fire=True)
    from policies.success_detector import SuccessDetector

    d = SuccessDetector.load(det)
    with torch.no_grad():
        d.head[-1].bias.fill_(float(np.log(0.6 / 0.4)))     # p = 0.6 whatever it sees
    det = d.save(tmp_path / "det06")
    url = str(tmp_path / "store")
    collect_demos(_plain(make_cfg(tmp_path, "task.tasks=[reach-v3]")), [0], 1, 0.0, 0, url, progress=False)
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 7 + u} for u in (0, 1)]
    with VectorFleet(c, str(ckpt), url, batch_size=2, processes=1) as vf:
        vf.run(plan=plan, progress=False, acting=Acting("detector", labels, detector_dir=str(det)))
    fleet = ExperienceStore.open(url).episodes(is_demo=False)
    assert len(fleet) == 2 and all(m.success and m.extra["label"]["p_max"] == pytest.approx(0.6, abs=1e-3)
                                   for m in fleet)
    strict = learner_reader(url, {"trust_margin": 0.2})
    assert isinstance(strict, TrustedLabels)
    assert strict.episodes(is_demo=False) == [] and len(strict.episodes(is_demo=True)) == 1
    assert strict.episodes(success=True) == strict.episodes(is_demo=True)
    loose = learner_reader(url, {"trust_margin": 0.05})
    assert len(loose.episodes(is_demo=False, success=True)) == 2 and loose.keys == strict.keys
    assert not isinstance(learner_reader(url, None), TrustedLabels)          # the default reads every label
    m = fleet[0]
    human = dataclasses.replace(m, extra={**m.extra, "label": {"source": "human", "p_max": 0.0}})
    assert trusted_label(human, 0.3)
    old = dataclasses.replace(m, extra={**m.extra, "label": {"source": "detector", "p_max": 0.6}})
    with pytest.raises(ValueError, match="names no threshold"):
        trusted_label(old, 0.1)


def test_fleet_acting_labels_round_zero_by_a_person_first_then_by_the_detector(tmp_path):
    from omegaconf import OmegaConf

    from fleet.experiment.rounds import fleet_acting

    def plain(cfg):
        return {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("task", "fert", "labels")}

    c = plain(make_cfg(tmp_path, "experiment=deployed", "labels.budget_episodes=3"))
    plan = [{"task": "reach-v3", "unit_id": u, "seed": u} for u in range(8)]
    parts = fleet_acting(c, 0, plan, plan[1:], tmp_path / "seed_0")
    (human, a), (rest, b) = parts
    assert [t["unit_id"] for t in human] == [1, 2] and a.source == "human" and a.recovery is None
    assert [t["unit_id"] for t in rest] == [3, 4, 5, 6, 7] and b.source == "detector" and b.recovery["attempts"] == 2
    with pytest.raises(ValueError, match="no fitted detector"):
        fleet_acting(c, 1, plan, plan, tmp_path / "seed_0")
    _constant_detector(tmp_path / "seed_0" / "detector", fire=False)
    (only, d), = fleet_acting(c, 1, plan, plan, tmp_path / "seed_0")
    assert only == plan and d.source == "detector"
    default = plain(make_cfg(tmp_path))
    assert fleet_acting(default, 0, plan, plan, None) == [(plan, None)]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_deployed_preset_end_to_end(tmp_path):
    """``experiment=deployed`` on a tiny real job: the labelled budget recorded and the detector fitted in round 0,
    every later fleet episode labelled by the detector, failures followed by recoveries (never replayed from their
    reset seed), the held-out label audit; the evaluation keeps the simulator's labels."""
    from experience_dict.store import ExperienceStore

    out = tmp_path / "run"
    args = [f"hydra.run.dir={out}", "experiment=deployed", "task.tasks=[reach-v3]", "task.max_episode_steps=60",
            "robot.train_units=[0,1]", "robot.demo_units=[0,1]", "robot.heldout_units=[100,101]",
            "job.demos_per_task=3", "job.base_steps=10", "fleet.units=2", "job.fleet_episodes_per_unit=4",
            "job.videos=0", "eval.trials_per_task=2", "job.curve_trials_per_task=0", "fert.rounds=2",
            "learner.updates_per_version=5", "learner.batch_size=16", "fert.critic.updates=5",
            "fert.critic.hidden=16", "fert.critic.members=2", "fert.critic.candidates=2",
            "fert.distill.states_per_task=16", "learner.validate_trials_per_task=2", "job.val_demos_per_task=1",
            "train.save_every=5", "train.batch_size=16", "train.wandb.enabled=false", "train.progress=false",
            "policy.dim=32", "policy.n_layers=1", "policy.n_heads=2", "policy.state_hidden=32",
            "policy.aed.tokenizer_vocab_size=128", "labels.budget_episodes=5", "labels.updates=20",
            "labels.audit_trials_per_task=2", "fert.retry.recovery_steps=30",
            "job.arms=[base,filtered_bc_retries,fert,fert_no_retrieval]"]
    env = {**os.environ, "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"), "WANDB_MODE": "disabled",
           "RAY_AUTH_MODE": "disabled"}
    proc = subprocess.run([sys.executable, "scripts/run.py", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=880, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sd = out / "seed_0"
    records = sorted((sd / "detector" / "records").glob("*.npz"))
    assert (sd / "detector" / "detector.json").is_file() and 1 <= len(records) <= 5
    reader = ExperienceStore.open(str(sd / "store"))
    fleet = reader.episodes(is_demo=False)
    human = [m for m in fleet if m.extra["label"]["source"] == "human"]
    assert len(human) == len(records) and {m.episode_id for m in human} == {p.stem for p in records}
    assert all(m.extra["label"]["source"] in ("human", "detector") for m in fleet)
    for m in fleet:   # a recovery goes on from the failure it follows: never the same reset seed replayed alone
        if m.extra.get("retry_of"):
            assert m.extra.get("recovery") is True
    state = json.loads((sd / "job_state.json").read_text())
    assert state["round_0"]["labels"]["audit"]["overall"]["n"] > 0 and "recovered" in state["round_0"]["retries"]
    assert state["label_audit"]["overall"]["n"] == 4 and "success detector on held-out units" in proc.stdout
    assert set(json.loads((out / "results.json").read_text())["arms"]) == {"base", "filtered_bc_retries", "fert",
                                                                          "fert_no_retrieval"}


def test_fleet_size_sweep_holds_the_episodes_per_unit_fixed(tmp_path):
    """Every fleet size of the sweep runs the main loop's fixed plan with the same episodes per unit per round, in
    its own store and registry, without the per-round curve."""
    from fleet.experiment.protocol import fleet_plan
    from fleet.experiment.sweep import check_fleet_sizes, size_config

    c = {"seed": 0, "train": {"seed": 0}, "store": {"url": "x"}, "fleet": {"units": 16, "registry_url": "r"},
         "job": {"fleet_episodes_per_unit": 15, "curve_trials_per_task": 50}}
    tasks = ["reach-v3", "button-press-topdown-v3", "window-open-v3"]
    for n in (4, 16, 64):
        cn = size_config(c, tmp_path / f"n{n}", n, 15)
        assert cn["fleet"]["units"] == n and cn["job"]["curve_trials_per_task"] == 0
        assert cn["store"]["url"] == str(tmp_path / f"n{n}" / "store")
        plan = fleet_plan(tasks, list(range(n)), cn["job"]["fleet_episodes_per_unit"], 0, 0)
        per_unit = {u: sum(t["unit_id"] == u for t in plan) for u in range(n)}
        assert set(per_unit.values()) == {15} and len(plan) == 15 * n
        assert {t["task"] for t in plan} == set(tasks)
    with pytest.raises(ValueError, match="outside"):
        check_fleet_sizes([4, 64], list(range(16)))


def test_labelled_budget_episodes_can_run_their_whole_time_budget(tmp_path):
    """``labels.budget_full_length``: a labelled episode is not ended by the simulator's success; it runs to
    ``task.max_episode_steps`` and its detector frames are recorded to the end (the person's mark stays the first
    success)."""
    from fleet.experiment.protocol import VectorFleet
    from fleet.labels import Acting, load_records

    assert Acting("human", {}).stop_on_success and not Acting("human", {"budget_full_length": True}).stop_on_success
    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=12"))
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 40 + u} for u in (0, 1)]
    acting = Acting("human", {"budget_full_length": True, "record_every": 3}, record_dir=str(tmp_path / "rec"))
    with VectorFleet(c, str(ckpt), str(tmp_path / "store"), batch_size=2, processes=1, acting=acting) as vf:
        eps = vf.run(plan=plan, progress=False).episodes
    assert [e["length"] for e in eps] == [12, 12]
    recs = load_records(tmp_path / "rec")
    assert len(recs) == 2 and all(list(r["step"]) == [3, 6, 9, 12] for r in recs)
    # each frame carries the person's per-frame mark (the simulator's success at that step), for frame_label=now
    assert all(r["done_now"].dtype == bool and r["done_now"].shape == (4,) for r in recs)


def test_a_labelled_episode_run_past_its_success_is_stored_as_the_success_would_have_ended_it(tmp_path, monkeypatch):
    """With ``labels.budget_full_length`` the detector's frames go on to the time budget, but the store gets the
    episode cut where the simulator's success would have ended it (``first_success + steps_after_success``): the
    learner's data is the same as without the option."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet
    from fleet.labels import Acting, load_records
    from sim.metaworld_env import MetaWorldEnv

    orig = MetaWorldEnv.step

    def succeeds_from_step_4(self, action):        # a real env whose success is forced from its 4th step on
        obs, r, term, trunc, info = orig(self, action)
        return obs, r, term, trunc, {**info, "success": self._t >= 4}

    monkeypatch.setattr(MetaWorldEnv, "step", succeeds_from_step_4)
    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=12", "task.steps_after_success=2"))
    plan = [{"task": "reach-v3", "unit_id": 0, "seed": 40}]
    acting = Acting("human", {"budget_full_length": True, "record_every": 3}, record_dir=str(tmp_path / "rec"))
    with VectorFleet(c, str(ckpt), str(tmp_path / "store"), batch_size=1, processes=1, acting=acting) as vf:
        eps = vf.run(plan=plan, progress=False).episodes
    assert eps[0]["success"] and eps[0]["length"] == 6 and eps[0]["termination"] == "terminated"
    (m,) = ExperienceStore.open(str(tmp_path / "store")).episodes()
    assert m.length == 6 and m.extra["oracle"]["first_success"] == 4
    (rec,) = load_records(tmp_path / "rec")
    assert list(rec["step"]) == [3, 6, 9, 12] and list(rec["done_now"]) == [False, True, True, True]


def test_frame_label_now_learns_a_success_that_is_a_moment(tmp_path):
    """``labels.frame_label=now``: a success that shows only while it lasts (reach passes through its goal) is
    learned from the per-frame marks; ``ever`` labels the frames after it as done, ``now`` does not."""
    from fleet.labels import fit_from_records, frame_labels, load_records, save_record

    rng = np.random.default_rng(1)
    steps = list(range(2, 31, 2))
    for e in range(24):
        ok = e % 2 == 0
        first = int(rng.integers(3, 8)) * 2 if ok else None
        now = [ok and first <= s < first + 6 for s in steps]
        frames = []
        for s, d in zip(steps, now):
            f = rng.integers(0, 60, (1, 16, 16, 3)).astype(np.uint8)
            if d:
                f[0, 4:10, 4:10] = 250
            frames.append(f)
        save_record(tmp_path / "rec", f"unit-0000-{e:06d}", "reach-v3", frames,
                    [rng.normal(size=4).astype(np.float32) for _ in steps], steps, ok, first, done_now=now)
    rec = load_records(tmp_path / "rec")[0]
    assert frame_labels(rec, "now").sum() == 3 and frame_labels(rec, "ever").sum() > 3
    with pytest.raises(ValueError, match="frame_label"):
        frame_labels(rec, "sometimes")
    labels = {"cameras": ["corner"], "image_size": 16, "every": 2, "updates": 150, "batch_size": 32, "width": 8,
              "val_share": 0.25, "frame_label": "now"}
    out = fit_from_records(tmp_path / "rec", labels, ["reach-v3"], tmp_path / "det", seed=0)
    assert out["validation"]["precision"] == 1.0 and out["validation"]["recall"] == 1.0
    z = dict(np.load(next((tmp_path / "rec").glob("*.npz"))))
    del z["done_now"]
    np.savez(tmp_path / "old.npz", **z)
    with pytest.raises(ValueError, match="no per-frame marks"):
        frame_labels({"episode_id": "old", **dict(np.load(tmp_path / "old.npz"))}, "now")


def test_detector_study_script_judges_held_out_folds(tmp_path):
    """``scripts/detector_study.py`` on synthetic labelled records (a success shows a bright patch in every camera
    while it lasts): every held-out episode judged, results per rule and task, traces saved, reruns skip."""
    from fleet.labels import save_record

    rng = np.random.default_rng(2)
    steps = list(range(2, 21, 2))
    for e in range(18):
        ok = e % 2 == 0
        first = 8 if ok else None
        now = [ok and s >= first for s in steps]
        frames = []
        for d in now:
            f = rng.integers(0, 60, (3, 64, 64, 3)).astype(np.uint8)
            if d:
                f[:, 20:40, 20:40] = 250
            frames.append(f)
        clouds = [np.concatenate([rng.uniform(-0.3, 0.3, (16, 3)), np.full((16, 3), 250.0 if d else 20.0)], 1)
                  for d in now]   # with colour (labels.point_color): (N, 6), the points red while it lasts
        save_record(tmp_path / "rec", f"unit-0000-{e:06d}", "reach-v3", frames,
                    [rng.normal(size=4).astype(np.float32) for _ in steps], steps, ok, first, done_now=now,
                    clouds=clouds)
    cmd = [sys.executable, "scripts/detector_study.py", "--records", str(tmp_path / "rec"), "--out",
           str(tmp_path / "dev.json"), "--variant", "all64", "--variant", "pc_rgb", "--updates", "60",
           "--every", "2"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads((tmp_path / "dev.json").read_text())
    assert set(out) == {"all64:now", "pc_rgb:now"}
    assert set(out["all64:now"]) == {"any", "k3", "last", "any_pt", "k3_pt", "last_pt"}
    assert out["all64:now"]["last"]["all"]["n"] == 18 and out["all64:now"]["last"]["all"]["accuracy"] >= 0.8
    assert out["pc_rgb:now"]["last"]["all"]["n"] == 18 and out["pc_rgb:now"]["last"]["all"]["accuracy"] >= 0.8
    assert len(np.load(tmp_path / "dev_all64_now.npz").files) == 18
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, check=False)
    assert again.returncode == 0 and "fold" not in again.stdout


def test_history_and_per_task_thresholds_reach_the_fleets_detector(tmp_path, monkeypatch):
    """A detector with a proprioception history (``labels.history``) gets, at each judged step t of a real fleet
    episode, the states stored at ``history_steps(t)`` (the same steps the labelled budget's records give it) and
    fires by its task's own threshold."""
    from experience_dict.store import ExperienceStore
    from fleet.experiment.protocol import VectorFleet
    from fleet.labels import Acting, OnlineLabeller
    from policies.success_detector import DetectorSpec, SuccessDetector, history_steps

    det = SuccessDetector(DetectorSpec(tasks=["reach-v3"], cameras=["corner"], image_size=64, history=3,
                                       history_every=2, task_thresholds=[0.99]))
    with torch.no_grad():
        det.head[-1].weight.zero_()
        det.head[-1].bias.fill_(2.0)          # p = 0.88: above the one threshold (0.5), below reach's own (0.99)
    det.save(tmp_path / "det")
    seen = []
    orig = OnlineLabeller.judge

    def spy(self, frames, states, tasks, clouds=None, history=None):
        seen.append((states.copy(), history.copy()))
        return orig(self, frames, states, tasks, clouds, history)

    monkeypatch.setattr(OnlineLabeller, "judge", spy)
    ckpt = tiny_aed_checkpoint(tmp_path / "a", seed=0, perturb=0.3)
    c = _plain(make_cfg(tmp_path, "task.tasks=[reach-v3]", "task.max_episode_steps=20"))
    labels = {"cameras": ["corner"], "image_size": 64, "every": 5, "history": 3, "history_every": 2}
    url = str(tmp_path / "store")
    with VectorFleet(c, str(ckpt), url, batch_size=1, processes=1) as vf:
        vf.run(plan=[{"task": "reach-v3", "unit_id": 0, "seed": 3}], progress=False,
               acting=Acting("detector", labels, detector_dir=str(tmp_path / "det")))
    (m,) = ExperienceStore.open(url).episodes()
    assert not m.success and m.extra["label"]["p_max"] == pytest.approx(0.8808, abs=1e-3)   # 0.99 not crossed
    states = ExperienceStore.open(url).load_episode(m.episode_id, keys=["observation.state"])["observation.state"]
    assert len(seen) == 4                                       # judged at steps 5, 10, 15, 20
    for k, (now, hist) in enumerate(seen[:3]):
        t = 5 * (k + 1)
        np.testing.assert_array_equal(now[0], states[t])        # the state after step t
        np.testing.assert_array_equal(hist[0], states[history_steps(t, 3, 2, 2)])
    assert history_steps(5, 3, 2, 2) == [3, 2, 2]               # clamped to the budget's first recorded step


def test_record_history_and_per_task_thresholds_on_the_labelled_budget(tmp_path):
    """``record_history`` gives each record frame the states 2, 4, ... steps back (clamped to the first), refuses a
    spacing the records do not hold; ``choose_thresholds`` gives each task its own cut where one cannot serve both;
    a success seen only in the hand's motion is learned with a history and not without."""
    from fleet.labels import choose_thresholds, fit_from_records, load_records, record_history, save_record
    from policies.success_detector import DetectorSpec

    rec = {"episode_id": "e", "step": np.array([2, 4, 6, 8]), "state": np.arange(8, dtype=np.float32).reshape(4, 2)}
    h = record_history(rec, 2, 2)
    assert h.shape == (4, 2, 2) and h[3, :, 0].tolist() == [4.0, 2.0] and h[0, :, 0].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="holds no frame at step"):
        record_history(rec, 1, 3)
    p = np.array([0.9, 0.85, 0.7, 0.65, 0.3, 0.35, 0.1, 0.12])
    truth = np.array([1, 1, 0, 0, 1, 1, 0, 0], bool)
    tasks = ["a"] * 4 + ["b"] * 4
    one, per = choose_thresholds(p, truth), choose_thresholds(p, truth, tasks)
    assert sum((p > one["threshold"]) == truth) < 8
    assert per["tasks"]["a"] > 0.65 and 0.12 < per["tasks"]["b"] < 0.3
    with pytest.raises(ValueError, match="task_thresholds"):
        DetectorSpec(tasks=["a", "b"], cameras=["corner"], task_thresholds=[0.5])
    # the hand drifts slowly from a random start and darts +2 in x exactly when the task is done (a moment): where
    # the hand is says little, its change since 2 steps ago says it all
    rng = np.random.default_rng(3)
    steps = list(range(2, 31, 2))
    for e in range(30):
        ok = e % 2 == 0
        first = int(rng.integers(4, 10)) * 2 if ok else None
        x = rng.uniform(-5, 5) + np.cumsum(rng.normal(0, 0.1, len(steps)))
        now = [bool(ok and s == first) for s in steps]
        for i, d in enumerate(now):
            if d:
                x[i] += 2.0
        states = [np.array([x[i], 0.0, 0.0, 0.0], np.float32) for i in range(len(steps))]
        frames = [np.zeros((1, 16, 16, 3), np.uint8) for _ in steps]      # the camera sees nothing of it
        save_record(tmp_path / "rec", f"unit-0000-{e:06d}", "reach-v3", frames, states, steps, ok, first,
                    done_now=now)
    assert len(load_records(tmp_path / "rec")) == 30
    labels = {"cameras": ["corner"], "image_size": 16, "every": 2, "updates": 300, "batch_size": 64, "width": 8,
              "val_share": 0.3, "frame_label": "now", "per_task_threshold": True}
    without = fit_from_records(tmp_path / "rec", labels, ["reach-v3"], tmp_path / "d0", seed=0)
    with_h = fit_from_records(tmp_path / "rec", {**labels, "history": 2}, ["reach-v3"], tmp_path / "d1", seed=0)
    assert with_h["validation"]["accuracy"] == 1.0 and without["validation"]["accuracy"] < 1.0
    assert set(with_h["task_thresholds"]) == {"reach-v3"}
