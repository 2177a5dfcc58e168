"""The policy interface and factory: a second policy type (the MLP chunk policy) is made, trained, resumed and
loaded through ``policies.factory`` and ``train_policy``, trains from ``scripts/train.py policy=mlp_chunk``,
acts in the real fleet (Ray workers, Meta-World, Zarr) and the vectorised evaluation, and exports to the lean
runtime (``policies.export`` / ``policies.runtime``), none of which names the type."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from experience_dict.store import ExperienceStore
from policies.aed_diffusion import AEDDiffusionPolicy
from policies.aed_diffusion.training import train_policy
from policies.base import Policy
from policies.factory import POLICY_TYPES, load_policy, make_policy, policy_type
from policies.mlp_chunk import MLPChunkPolicy

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
MLP = {"type": "mlp_chunk", "input_keys": None, "action_dim": 4, "horizon": 8, "n_action_steps": 4,
       "hidden_dim": 32, "n_layers": 2}
TRAIN = {"steps": 40, "batch_size": 16, "lr": 3e-3, "warmup_steps": 0, "save_every": 20, "log_every": 5, "progress": False,
         "wandb": {"enabled": False}, "seed": 0, "num_threads": 1}


@pytest.fixture(scope="module")
def demos(tmp_path_factory):
    """A real store of scripted-expert reach demonstrations (Meta-World, 2 episodes, 60 steps each)."""
    from fleet.experiment.protocol import collect_demos

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    url = str(tmp_path_factory.mktemp("demos") / "store")
    cfg = {"robot": {"train_units": [0], "heldout_units": [100]}, "obs": {"images": False},
           "task": {"tasks": ["reach-v3"], "max_episode_steps": 60, "steps_after_success": 5},
           "store": {"url": ""}, "fleet": {"num_cpus": 2, "units": 1, "episode_timeout_s": 120, "max_restarts": 1,
                                           "max_recreates": 1, "torch_threads": 1}, "policy": {}, "seed": 0}
    collect_demos(cfg, [0], demos_per_task=2, noise_std=0.1, seed=3, store_url=url, progress=False)
    return url


def test_every_registered_type_implements_the_interface(demos):
    reader = ExperienceStore.open(demos)
    eps = reader.episodes(is_demo=True)
    tiny_aed = {"type": "aed_diffusion", "dim": 32, "n_layers": 1, "n_heads": 2, "state_hidden": 32, "horizon": 8,
                "n_action_steps": 4, "action_patch": 1, "condition_layers": None, "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2,
                                             "tokenizer_vocab_size": 128}}
    for cfg, cls in ((MLP, MLPChunkPolicy), (tiny_aed, AEDDiffusionPolicy)):
        p = make_policy(cfg, reader, eps)
        assert type(p) is cls and isinstance(p, Policy) and p.name in POLICY_TYPES
        assert "action" in p.window_spec() and p.num_parameters() > 0
    with pytest.raises(KeyError, match="unknown policy type 'transformer'"):
        make_policy({"type": "transformer"}, reader, eps)
    with pytest.raises(ValueError, match="not learned"):
        make_policy({"type": "expert"}, reader, eps)
    with pytest.raises(ValueError, match="unknown keys \\['hiden_dim'\\]"):
        make_policy({**MLP, "hiden_dim": 8}, reader, eps)
    with pytest.raises(ValueError, match="lacks \\['observation.images.corner'\\]"):
        make_policy({**MLP, "input_keys": ["observation.images.corner"]}, reader, eps)


def test_mlp_chunk_trains_resumes_and_loads_through_the_factory(demos, tmp_path):
    reader = ExperienceStore.open(demos)
    eps = reader.episodes(is_demo=True)
    out = train_policy(TRAIN, tmp_path / "run", policy_cfg=MLP, reader=reader, episodes=eps, device="cpu")
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]       # it learns the demonstrations' chunks
    ck = out["checkpoint"]
    assert policy_type(ck) == "mlp_chunk"
    p = load_policy(ck)
    assert isinstance(p, MLPChunkPolicy) and not p.training
    for k, v in load_file(str(ck / "model.safetensors")).items():
        assert torch.equal(p.state_dict()[k], v)
    # interrupted after its step-20 checkpoint and resumed: the run ends with the uninterrupted run's weights
    import shutil

    (tmp_path / "resumed" / "checkpoints").mkdir(parents=True)
    shutil.copytree(tmp_path / "run" / "checkpoints" / "0000020", tmp_path / "resumed" / "checkpoints" / "0000020")
    (tmp_path / "resumed" / "checkpoints" / "last.json").write_text(json.dumps({"step": 20, "path": "0000020"}))
    res = train_policy({**TRAIN, "resume": True}, tmp_path / "resumed", policy_cfg=MLP, reader=reader,
                       episodes=eps, device="cpu")
    a, b = load_file(str(ck / "model.safetensors")), load_file(str(res["checkpoint"] / "model.safetensors"))
    assert res["step"] == 40 and all(torch.equal(a[k], b[k]) for k in a)
    # a checkpoint of the wrong shape is refused with the tensor named
    (tmp_path / "bad").mkdir()
    cfg = json.loads((ck / "config.json").read_text())
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "hidden_dim": 16}))
    (tmp_path / "bad" / "model.safetensors").write_bytes((ck / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"tensor .net\.0\.bias. has shape \(32,\), the model expects \(16,\)"):
        load_policy(tmp_path / "bad")
    (tmp_path / "bad" / "config.json").write_text(json.dumps({**cfg, "type": "transformer"}))
    with pytest.raises(KeyError, match="transformer"):
        load_policy(tmp_path / "bad")


def test_wise_interpolation_between_two_checkpoints(demos, tmp_path):
    """``interpolate_checkpoint`` (WiSE-FT): alpha 0 / 1 give the initial / fine-tuned weights exactly, 0.5 the
    midpoint; the result loads through the factory and acts; mismatched policies and a bad alpha are refused."""
    from policies.factory import interpolate_checkpoint

    reader = ExperienceStore.open(demos)
    out = train_policy(TRAIN, tmp_path / "run", policy_cfg=MLP, reader=reader, episodes=reader.episodes(is_demo=True),
                       device="cpu")
    init, tuned = tmp_path / "run" / "checkpoints" / "0000020" / "pretrained_model", out["checkpoint"]
    a, b = load_file(str(init / "model.safetensors")), load_file(str(tuned / "model.safetensors"))
    assert any(not torch.equal(a[k], b[k]) for k in a)
    for alpha, want in ((0.0, a), (1.0, b), (0.5, {k: (a[k] + b[k]) / 2 for k in a})):
        d = interpolate_checkpoint(init, tuned, alpha, tmp_path / f"wise_{alpha}")
        got = load_file(str(d / "model.safetensors"))
        assert all(torch.allclose(got[k], want[k], atol=1e-6) for k in a)
        assert (d / "config.json").read_text() == (tuned / "config.json").read_text()
    p = load_policy(tmp_path / "wise_0.5")
    ep = reader.load_episode(reader.episodes()[0].episode_id,
                             keys=["observation.state", "observation.environment_state"])
    p.reset()
    act = p.select_action({k: torch.as_tensor(v[:1]) for k, v in ep.items()})
    assert act.shape[-1] == 4 and torch.isfinite(act).all()
    with pytest.raises(ValueError, match="alpha must be in"):
        interpolate_checkpoint(init, tuned, 1.5, tmp_path / "bad_alpha")
    other = train_policy({**TRAIN, "steps": 2, "save_every": 2}, tmp_path / "other", policy_cfg={**MLP, "hidden_dim": 16},
                         reader=reader, episodes=reader.episodes(is_demo=True), device="cpu")["checkpoint"]
    with pytest.raises(ValueError, match=r"is \(16,\) torch.float32 in .* but \(32,\)"):
        interpolate_checkpoint(other, tuned, 0.5, tmp_path / "bad_shape")
    assert not (tmp_path / "bad_shape").exists()


def test_scripts_train_takes_policy_mlp_chunk(demos, tmp_path):
    out = tmp_path / "train"
    r = subprocess.run([sys.executable, "scripts/train.py", "task=mw_quick", "task.tasks=[reach-v3]",
                        "policy=mlp_chunk", "policy.hidden_dim=32", f"store.url={demos}", "train.steps=10",
                        "train.batch_size=8", "train.save_every=10", "train.wandb.enabled=false",
                        "train.progress=false", f"train.out_dir={out}", f"hydra.run.dir={tmp_path}/hydra"],
                       cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["step"] == 10 and summary["tokenizer_fit"] is None
    assert isinstance(load_policy(summary["checkpoint"]), MLPChunkPolicy)


def test_mlp_chunk_acts_in_the_fleet_and_the_evaluation(demos, tmp_path):
    import ray
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from fleet.coordinator import Fleet, ensure_ray
    from fleet.experiment.evaluation import run_plan_vectorised

    reader = ExperienceStore.open(demos)
    ck = train_policy(dict(TRAIN, steps=10, save_every=10), tmp_path / "run", policy_cfg=MLP, reader=reader,
                      episodes=reader.episodes(is_demo=True), device="cpu")["checkpoint"]
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        cfg = compose("config", overrides=["task=mw_quick", "task.tasks=[reach-v3]", "task.max_episode_steps=30",
                                           "robot=nominal", "policy=mlp_chunk", f"fleet.checkpoint={ck}",
                                           f"store.url={tmp_path}/fleet", f"fleet.registry_url={tmp_path}/reg",
                                           f"fleet.cache_dir={tmp_path}/cache", "fleet.units=1"])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ensure_ray({"num_cpus": 2, "log_to_driver": False})
    try:
        with Fleet(cfg) as fleet:
            result = fleet.run(episodes_per_unit=2, progress=False)
    finally:
        ray.shutdown()
    assert len(result.episodes) == 2 and not result.faulted
    eps = ExperienceStore.open(f"{tmp_path}/fleet").episodes()
    assert len(eps) == 2 and all(e.length == 30 and e.policy_version == 0 for e in eps)
    c = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("robot", "obs", "task")}
    plan = [{"task": "reach-v3", "unit_id": 0, "seed": s} for s in (5, 6, 7)]
    trials = run_plan_vectorised(c, ck, plan, tmp_path / "eval", batch_size=3)
    assert [t["seed"] for t in trials] == [5, 6, 7] and all(t["length"] == 30 for t in trials)
    acts = ExperienceStore.open(str(tmp_path / "eval")).load_episode(trials[0]["episode_id"], keys=["action"])
    assert np.isfinite(acts["action"]).all() and np.abs(acts["action"]).max() <= 1.0
    # ... and exports to the lean runtime, which acts in a real env exactly as the checkpoint does in-process
    from policies.export import export_checkpoint
    from policies.runtime import PolicyRuntime, verify_export
    from sim import make_env

    exp = export_checkpoint(ck, tmp_path / "export", control_hz=80.0)
    meta = verify_export(exp)
    assert meta["policy_type"] == "mlp_chunk" and meta["features"]["action"]["dim"] == 4
    assert "one forward pass per chunk" in (exp / "README.md").read_text()
    rt, ref = PolicyRuntime.load(exp, num_threads=1), load_policy(ck)
    assert rt.inference_window_spec() == {k: (k, [0]) for k in ref.config.state_keys}
    with pytest.raises(ValueError, match="no denoising steps"):
        PolicyRuntime.load(exp, num_inference_steps=5)
    env = make_env(task="reach-v3", unit_id=100, robot_cfg=c["robot"], obs_cfg=c["obs"], task_cfg=c["task"])
    obs, _ = env.reset(seed=11)
    rt.reset()
    ref.reset()
    for _ in range(12):   # three chunks of n_action_steps=4
        a = rt.select_action(obs)
        assert a.shape == (4,) and np.array_equal(a, ref.select_action({k: np.asarray(v) for k, v in obs.items()}))
        obs, *_ = env.step(a)
    env.close()
