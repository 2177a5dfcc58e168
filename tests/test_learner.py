"""The asynchronous FERT learner: rounds publish versions; a learner SIGKILLed mid-training resumes and
publishes the next version, never a repeat. Real Meta-World episodes in a real Zarr store, a tiny real policy."""

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from experience_dict.store import ExperienceStore
from fleet.fert.learner import FertLearner
from fleet.registry import CheckpointRegistry
from policies.aed_diffusion import AEDDiffusionConfig
from policies.aed_diffusion.training import train_policy

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TASK_CFG = {"name": "t", "suite": "metaworld", "tasks": ["reach-v3"], "max_episode_steps": 120, "steps_after_success": 5}
ROBOT_CFG = {"embodiment": "sawyer", "fleet_seed": 0, "train_units": [0, 1], "heldout_units": [100],
             "variation": {"camera_pos_mm": 0.0, "camera_rot_deg": 0.0, "light": 0.0, "color": 0.0, "mass_scale": 0.0,
                           "friction_scale": 0.0, "action_gain": 0.1, "action_latency_max": 0, "obs_noise_std": 0.0}}
OBS_CFG = {"images": False, "cameras": ["corner"], "image_size": 64}
TINY = {"dim": 32, "n_layers": 1, "n_heads": 2, "state_hidden": 32, "horizon": 8, "n_action_steps": 4,
        "action_patch": 1, "condition_layers": None,  # the one-token-a-step denoiser these tests were written on
        "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2, "tokenizer_vocab_size": 128},
        "mt_loss": {"weight": 0.005}}


def _rollout(env, writer, act, unit, seed, version, is_demo):
    obs, _ = env.reset(seed=seed)
    writer.begin_episode(unit_id=unit, embodiment="sawyer", task="reach-v3", policy_version=version, seed=seed,
                         is_demo=is_demo)
    success, done = False, False
    while not done:
        a = act(obs)
        nxt, r, term, trunc, info = env.step(a)
        writer.add_step(obs, a, float(r), info["progress"])
        success |= bool(info["success"])
        obs, done = nxt, term or trunc
    writer.commit(success=success)
    return success


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """Store with expert demos, fleet successes and random-policy failures; a tiny base policy; registry v1."""
    from sim import make_env, make_expert

    root = tmp_path_factory.mktemp("learner")
    url = str(root / "store")
    store = None
    rng = np.random.default_rng(0)
    for unit in (0, 1):
        env = make_env("reach-v3", unit_id=unit, robot_cfg=ROBOT_CFG, obs_cfg=OBS_CFG, task_cfg=TASK_CFG)
        if store is None:
            spec = env.spec_dict()
            store = ExperienceStore.create_or_open(url, spec=spec, control_hz=spec["control_hz"])
        w = store.writer(f"unit-{unit:04d}")
        expert = make_expert(env, noise_std=0.05, seed=unit)
        for i in range(2):  # demonstrations
            expert.reset(seed=10 * unit + i)
            assert _rollout(env, w, expert.act, unit, 10 * unit + i + 1, -1, True)
        _rollout(env, w, expert.act, unit, 100 + unit, 1, False)  # a fleet success
        for i in range(2):  # fleet failures: a random policy
            _rollout(env, w, lambda o: rng.uniform(-1, 1, 4).astype(np.float32), unit, 200 + 10 * unit + i, 1, False)
        w.close()
        env.close()
    reader = ExperienceStore.open(url)
    demos = reader.episodes(is_demo=True)
    shapes = {k: list(v["shape"]) for k, v in reader.features.items() if k.startswith("observation.")}
    cfg = AEDDiffusionConfig.from_dict({**TINY, "input_shapes": shapes})
    base = train_policy({"steps": 4, "batch_size": 16, "progress": False, "save_every": 4,
                         "wandb": {"enabled": False}}, root / "base",
                        policy_cfg=cfg, reader=reader, episodes=demos, device="cpu")
    reg_url = str(root / "registry")
    CheckpointRegistry(reg_url).publish(base["checkpoint"], metadata={"run_id": "base", "round": -1})
    return {"root": root, "store": url, "registry": reg_url, "base": str(base["checkpoint"])}


def learner_cfg(updates: int) -> dict:
    return {"robot": ROBOT_CFG,
            # the retrieval these tests were written on, stated: absolute key, no progress gate, one step per
            # retrieved entry, no critic (a missing fert key takes FertConfig's: relative, gate on, 16 steps,
            # the critic on)
            "fert": {"window": 4, "top_k": 4, "replay_ratio": 0.5, "max_contexts_per_task": 16, "audit": True,
                     "key": "absolute", "gate": {"enabled": False}, "segment_steps": 1, "critic": {"enabled": False}},
            "train": {"batch_size": 16, "wandb": {"enabled": False}, "log_every": 5},
            # the learner mode these tests were written on, stated (LearnerConfig's default is published)
            "learner": {"updates_per_version": updates, "min_new_episodes": 0, "max_wait_s": 0, "batch_size": 16,
                        "device": "cpu", "torch_threads": 1, "round_init": "continue"}}


def test_learner_config_is_the_one_source_of_its_defaults(tmp_path):
    """The composed config's ``learner`` is LearnerConfig's defaults (no YAML holds them); an unknown key and a
    wrong type are refused while composing, naming the key; a value out of range by the config check, and a
    caller's partial dict takes the dataclass's defaults."""
    import dataclasses

    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException
    from omegaconf import OmegaConf

    from configs.schema import ConfigError, check
    from fleet.fert.learner_config import LearnerConfig

    assert not (Path(__file__).parents[1] / "configs/learner").exists()
    with initialize_config_dir(config_dir=str(Path(__file__).parents[1] / "configs"), version_base=None):
        cfg = compose("config")
        assert OmegaConf.to_container(cfg.learner) == LearnerConfig().to_dict()
        assert OmegaConf.to_object(cfg.learner) == LearnerConfig()
        with pytest.raises(ConfigCompositionException, match="updates_per_versoin"):
            compose("config", overrides=["learner.updates_per_versoin=5"])
        with pytest.raises(ConfigCompositionException, match="lr"):
            compose("config", overrides=["learner.lr=fast"])
        bad = compose("config", overrides=["learner.updates_per_version=0", "learner.round_init=sometimes",
                                           f"store.url={tmp_path}/s"])
    with pytest.raises(ConfigError) as e:
        check(bad)
    assert "learner.updates_per_version: expected an integer >= 1, given 0" in str(e.value)
    assert "learner.round_init: expected one of ['published', 'base', 'continue'], given 'sometimes'" in str(e.value)
    part = LearnerConfig.from_dict({"updates_per_version": 7})
    assert part.updates_per_version == 7 and part.round_init == "published" and part.max_wait_s == 300.0
    with pytest.raises(ConfigError, match="unknown keys \\['lr_typo'\\]"):
        LearnerConfig.from_dict({"lr_typo": 1.0})
    src = (Path(__file__).parents[1] / "fleet/fert/learner_config.py").read_text()
    for f in dataclasses.fields(LearnerConfig):  # every field has its docstring line after it
        assert f'    {f.name}: ' in src and src.split(f'    {f.name}: ', 1)[1].split("\n", 2)[1].lstrip().startswith('"""'), f.name


def _rounds_published(registry_url: str, run_id: str) -> list[int]:
    reg = CheckpointRegistry(registry_url)
    return [reg.manifest(v)["metadata"].get("round") for v in reg.versions()
            if reg.manifest(v)["metadata"].get("run_id") == run_id]


def test_learner_rounds_publish_versions_and_audits(setup, tmp_path):
    reg_url = str(tmp_path / "registry")
    lrn = FertLearner(learner_cfg(3), setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="a")
    status = lrn.run(rounds=2)
    assert status["round"] == 2 and status["published"] == [1, 2]
    rec = status["history"][0]
    assert rec["contexts"] >= 1 and rec["retrieved"] >= rec["contexts"]  # failures found similar successes
    assert Path(rec["audit"]["json"]).is_file() and Path(rec["audit"]["png"]).is_file()
    assert status["history"][1]["step"] == 6
    # the fleet's action groups outside the AED tokenizer's fitted range, counted once per episode per round
    fleet_eps = [m for m in ExperienceStore.open(setup["store"]).episodes(is_demo=False) if int(m.unit_id) not in lrn.heldout]
    rng = rec["tokenizer_range"]
    assert rng["episodes"] == len(fleet_eps) > 0 and rng["groups"] > 0 and 0 <= rng["outside"] <= rng["groups"]
    assert status["history"][1]["tokenizer_range"]["episodes"] == 0
    assert json.loads(Path(rec["audit"]["json"]).read_text())["tokenizer_range"] == rng
    assert _rounds_published(reg_url, "a") == [0, 1]
    # every failed fleet episode got a failure onset written into the store
    reader = ExperienceStore.open(setup["store"])
    failed = reader.episodes(success=False, is_demo=False)
    assert failed and all(m.failure_onset is not None for m in failed)

    # a crash after publishing but before the round cursor was saved must not publish the round again
    state = json.loads((tmp_path / "work" / "learner_state.json").read_text())
    state["round"] = 1
    (tmp_path / "work" / "learner_state.json").write_text(json.dumps(state))
    again = FertLearner(learner_cfg(3), setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="a")
    again.run(rounds=2)
    assert _rounds_published(reg_url, "a") == [0, 1]


def test_learner_killed_mid_training_resumes_and_publishes_next_version(setup, tmp_path):
    reg_url, work = setup["registry"], tmp_path / "work"
    cfg = learner_cfg(6)
    # a learner process that SIGKILLs itself at its 9th optimizer step: mid-way through round 1 (steps 7..12),
    # after round 0 was trained (steps 1..6), checkpointed and published
    script = textwrap.dedent(f"""
        import json, os, signal, sys, torch
        sys.path.insert(0, {str(REPO)!r})
        torch.set_num_threads(1)
        calls = {{"n": 0}}
        orig = torch.optim.AdamW.step
        def step(self, *a, **k):
            calls["n"] += 1
            if calls["n"] == 9:
                os.kill(os.getpid(), signal.SIGKILL)
            return orig(self, *a, **k)
        torch.optim.AdamW.step = step
        from fleet.fert.learner import FertLearner
        cfg = json.loads({json.dumps(json.dumps(cfg))})
        FertLearner(cfg, {setup['store']!r}, {reg_url!r}, {str(work)!r}, {setup['base']!r}, run_id="k").run(3)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_MODE": "disabled"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert _rounds_published(reg_url, "k") == [0]          # round 0 published before the kill
    assert json.loads((work / "learner_state.json").read_text())["round"] == 1

    status = FertLearner(cfg, setup["store"], reg_url, str(work), setup["base"], run_id="k").run(3)
    assert status["round"] == 3
    assert _rounds_published(reg_url, "k") == [0, 1, 2]     # the next versions, no repeat of round 0
    assert [h["step"] for h in status["history"]] == [6, 12, 18]
    versions = CheckpointRegistry(reg_url).versions()
    assert versions == sorted(set(versions)) and len(versions) == 4  # base + 3 rounds


def test_learner_replays_demos_or_every_fleet_success(setup, tmp_path):
    """``fert.replay``: the demonstrations only, or filtered BC's data (demos + training-unit fleet successes)."""
    reader = ExperienceStore.open(setup["store"])
    demos = {m.episode_id for m in reader.episodes(is_demo=True)}
    fleet_ok = {m.episode_id for m in reader.episodes(success=True, is_demo=False)}
    assert demos and fleet_ok
    cfg = learner_cfg(3)
    lrn = FertLearner(cfg, setup["store"], None, str(tmp_path / "a"), setup["base"], run_id="a", publish=False)
    lrn.algorithm.setup()
    assert {m.episode_id for m in lrn.algorithm.replay_episodes()} == demos
    cfg["fert"]["replay"] = "successes"
    lrn = FertLearner(cfg, setup["store"], None, str(tmp_path / "b"), setup["base"], run_id="b", publish=False)
    lrn.algorithm.setup()
    got = lrn.algorithm.replay_episodes()
    assert {m.episode_id for m in got} == demos | fleet_ok and len(got) == len(demos | fleet_ok)
    assert all(m.success for m in got)
    cfg["robot"] = {**cfg["robot"], "heldout_units": [1]}             # held-out units' successes never replay
    lrn = FertLearner(cfg, setup["store"], None, str(tmp_path / "c"), setup["base"], run_id="c", publish=False)
    lrn.algorithm.setup()
    assert all(m.is_demo or int(m.unit_id) != 1 for m in lrn.algorithm.replay_episodes())
    with pytest.raises(ValueError, match="fert.replay"):
        lrn.algorithm.replay_episodes("everything")
    cfg["fert"]["replay"] = "everything"      # refused when the learner is made (FertConfig), before any work
    with pytest.raises(ValueError, match="fert.replay: expected one of \\['demos', 'successes'\\], given 'everything'"):
        FertLearner(cfg, setup["store"], None, str(tmp_path / "d"), setup["base"], run_id="d", publish=False)


def test_learner_ships_a_success_critic_that_the_fleet_loads(setup, tmp_path):
    """``fert.critic.enabled``: the round fits a critic on successes and failures of the training units, saves it
    beside the weights, and the published version loads with it choosing the policy's chunks."""
    from fleet.acting import load_checkpoint
    from fleet.experiment.arms import ARMS, critic_arm_checkpoint
    from policies.critic import CRITIC_FILES, CriticGuidedSampler
    from sim import make_env

    cfg = learner_cfg(2)
    cfg["task"] = TASK_CFG
    cfg["fert"]["critic"] = {"enabled": True, "candidates": 3, "members": 2, "hidden": 16, "updates": 5,
                             "batch_size": 32}
    reg_url = str(tmp_path / "registry")
    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="c")
    rec = lrn.run(rounds=1)["history"][0]["critic"]
    reader = ExperienceStore.open(setup["store"])
    train = [m for m in reader.episodes() if m.unit_id in (0, 1)]
    assert rec["episodes"] == len(train) and rec["steps"] == sum(m.length for m in train)
    assert any(not m.success for m in train) and 0 < rec["positive_share"] < 1      # failures are data too
    local = CheckpointRegistry(reg_url).fetch(None, tmp_path / "fetched")
    assert all((local / f).is_file() for f in CRITIC_FILES)
    model, version = load_checkpoint(local)
    assert version == 1 and isinstance(model.chunk_sampler, CriticGuidedSampler)
    env = make_env(task="reach-v3", unit_id=0, robot_cfg=ROBOT_CFG, obs_cfg=OBS_CFG, task_cfg=TASK_CFG)
    obs, _ = env.reset(seed=3)
    model.reset()
    for _ in range(5):
        a = model.select_action(obs)
        obs = env.step(a)[0]
    env.close()
    assert a.shape == (4,) and np.isfinite(a).all() and model.chunk_sampler.decisions == 2   # 4 steps per chunk
    # the critic arms: FERT's weights without the critic, the base with FERT's critic
    ckpt = {"fert": str(local), "fert_finetuned": str(local), "base": setup["base"]}
    bare = critic_arm_checkpoint(ARMS["fert_no_critic"], ckpt, tmp_path / "fert_no_critic")
    assert not any((tmp_path / "fert_no_critic" / f).exists() for f in CRITIC_FILES)
    assert load_checkpoint(bare)[0].chunk_sampler is None
    guided = critic_arm_checkpoint(ARMS["base_critic"], ckpt, tmp_path / "base_critic")
    assert isinstance(load_checkpoint(guided)[0].chunk_sampler, CriticGuidedSampler)


def test_gate_chooses_between_the_finetuned_and_the_critic_only_candidate(setup, tmp_path):
    """``learner.validate_critic_only``: the validator sees two candidates, the fine-tuned weights with the new
    critic and the current version's weights with the same critic; the learner publishes the one it names
    (weights and critic as built), records which, and publishes nothing when it names none."""
    from safetensors.torch import load_file

    from policies.critic import CRITIC_FILES

    cfg = learner_cfg(2)
    cfg["task"] = TASK_CFG
    cfg["learner"]["validate_critic_only"] = True
    cfg["fert"]["critic"] = {"enabled": True, "candidates": 2, "members": 2, "hidden": 16, "updates": 5,
                             "batch_size": 32}
    reg_url = str(tmp_path / "registry")
    reg = CheckpointRegistry(reg_url)
    reg.publish(setup["base"], metadata={"run_id": "base", "round": -1})
    seen, answers = [], iter(["critic_only", None])

    def validator(candidates, r):
        seen.append(dict(candidates))
        pick = next(answers)
        return pick, {"chosen": pick, "accepted": pick is not None}

    lrn = FertLearner(cfg, setup["store"], reg_url, str(tmp_path / "work"), setup["base"], run_id="fert",
                      validator=validator)
    lrn.run(rounds=2)
    assert [sorted(c) for c in seen] == [["critic_only", "finetuned"]] * 2
    h0, h1 = lrn.state["history"]
    assert h0["published_candidate"] == "critic_only" and h0["version"] == 2
    assert h1["published_candidate"] is None and h1["version"] is None and lrn.state["rejected"] == [1]
    assert reg.latest_version() == 2
    got = reg.fetch(2, tmp_path / "v2")
    finetuned, critic_only = Path(seen[0]["finetuned"]), Path(seen[0]["critic_only"])
    base_w = load_file(str(Path(setup["base"]) / "model.safetensors"))
    pub_w = load_file(str(got / "model.safetensors"))
    ft_w = load_file(str(finetuned / "model.safetensors"))
    assert all(torch.equal(base_w[k], pub_w[k]) for k in base_w)             # the current (base) weights ...
    assert any(not torch.equal(base_w[k], ft_w[k]) for k in base_w)          # ... not the fine-tuned ones
    for f in CRITIC_FILES:                                                    # ... with the round's new critic
        assert (got / f).read_bytes() == (finetuned / f).read_bytes() == (critic_only / f).read_bytes()
    # round 1's critic-only candidate starts from the version the fleet runs now (v2: the base's weights)
    cur = load_file(str(Path(seen[1]["critic_only"]) / "model.safetensors"))
    assert all(torch.equal(base_w[k], w) for k, w in cur.items())
