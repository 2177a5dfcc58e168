"""Export and lean runtime: same actions as the training-side policy, sha256-verified folders, model card,
registry export through the Hydra script, and a runtime import free of Ray/MuJoCo/Hydra/wandb."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from experience_dict.tokenizer import ActionTokenizer
from policies.aed_diffusion import AEDDiffusionConfig, AEDDiffusionPolicy
from policies.export import export_checkpoint
from policies.runtime import PolicyRuntime, verify_export

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
TINY = {"input_shapes": {"observation.state": [4], "observation.environment_state": [17]}, "dim": 32, "n_layers": 2,
        "n_heads": 2, "state_hidden": 32, "horizon": 8, "n_action_steps": 4, "num_inference_steps": 6,
        "action_patch": 1, "condition_layers": None,  # the one-token-a-step denoiser these tests were written on
        "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2, "tokenizer_vocab_size": 256},
        "mt_loss": {"weight": 0.01}}
HEAVY = ("ray", "mujoco", "hydra", "wandb", "metaworld", "zarr", "gymnasium", "sim", "fleet")


def tiny_policy(stats: dict, **over) -> AEDDiffusionPolicy:
    """A tiny AED policy (``TINY`` with ``over``) with random weights, perturbed so that its actions depend on every
    input, eval mode; ``stats``: the normalisation statistics of its state keys and ``action``."""
    cfg = AEDDiffusionConfig.from_dict({**json.loads(json.dumps(TINY)), **over})
    rng = np.random.default_rng(0)
    eps = [np.clip(np.cumsum(rng.normal(0, 0.2, (60, 4)), 0), -1, 1).astype(np.float32) for _ in range(6)]
    tok = ActionTokenizer.fit(eps, r=4, relative_dims=[0, 1, 2], absolute_dims=[3], scale=10.0, vocab_size=256)
    torch.manual_seed(0)
    policy = AEDDiffusionPolicy(cfg, stats, tok)
    with torch.no_grad():  # adaLN-Zero starts at zero output: perturb so actions depend on every input
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return policy.eval()


def _policy() -> AEDDiffusionPolicy:
    return tiny_policy({"observation.state": {"min": [-0.5, 0.3, 0.0, 0.0], "max": [0.5, 0.9, 0.3, 1.0]},
                        "observation.environment_state": {"min": [-1.0] * 17, "max": [1.0] * 17},
                        "action": {"min": [-1.0] * 4, "max": [1.0] * 4}})


def _batch(policy, B=3, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, (key, offs) in policy.inference_window_spec().items():
        dim = policy.config.action_dim if key == "action" else policy.config.input_shapes[key][0]
        out[name] = torch.rand(B, len(offs), dim, generator=g) * 2 - 1
        out[f"{name}_is_pad"] = torch.zeros(B, len(offs), dtype=torch.bool)
    return out


def _same_closed_loop(rt: PolicyRuntime, policy, seed: int, atol: float) -> None:
    """9 control steps of random observations (chunk boundaries every n_action_steps): the runtime's and the policy's
    ``select_action`` give the same (4,) float32 actions from the same generator seed."""
    rt.reset()
    policy.reset()
    rng = np.random.default_rng(seed)
    ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(9):
        obs = {"observation.state": rng.uniform(0, 1, 4).astype(np.float32),
               "observation.environment_state": rng.uniform(-1, 1, 17).astype(np.float32)}
        a, b = rt.select_action(obs, generator=ga), policy.select_action(obs, generator=gb)
        assert a.shape == (4,) and a.dtype == np.float32
        np.testing.assert_allclose(a, b, atol=atol)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    policy = _policy()
    policy.save_pretrained(root / "ckpt")
    table = {"so100-reach": {"success_rate": 0.9, "episodes": 10}, "push-v3": {"success_rate": 0.5, "episodes": 10}}
    out = export_checkpoint(root / "ckpt", root / "export", control_hz=30.0, success_table=table)
    return policy, out


def test_runtime_gives_the_training_policys_actions(exported):
    policy, folder = exported
    rt = PolicyRuntime.load(folder)
    batch = _batch(policy)
    noise = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(1))
    ref = policy.predict_action_chunk(batch, noise=noise)
    got = rt.predict_action_chunk(batch, noise=noise)
    assert got.shape == (3, 8, 4) and torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    # different observations give different chunks (the comparison above is not vacuous)
    assert not torch.allclose(rt.predict_action_chunk(_batch(policy, seed=5), noise=noise), ref, atol=1e-3)
    # DDIM steps are configurable, per call and per runtime, and match the training side
    ref4 = policy.predict_action_chunk(batch, noise=noise, num_inference_steps=4)
    torch.testing.assert_close(rt.predict_action_chunk(batch, noise=noise, num_inference_steps=4), ref4)
    assert not torch.allclose(ref4, ref, atol=1e-4)
    torch.testing.assert_close(PolicyRuntime.load(folder, num_inference_steps=4).predict_action_chunk(batch, noise=noise),
                               ref4)
    # closed loop: select_action with the same generator seed gives the same action stream
    _same_closed_loop(rt, policy, seed=0, atol=1e-6)
    assert rt.control_hz == 30.0 and rt.action_dim == 4 and rt.input_shapes == TINY["input_shapes"]


@pytest.mark.slow
def test_compiled_runtime_gives_the_same_actions(exported):
    """``PolicyRuntime(compile=True)`` (torch.compile of the denoising step): the same chunks as the eager
    training policy, at this batch size and another (which compiles again)."""
    policy, folder = exported
    rt = PolicyRuntime.load(folder, compile=True, num_threads=1)
    for b, seed in ((3, 1), (1, 2)):
        batch = _batch(policy, B=b, seed=seed)
        noise = torch.randn(b, 8, 4, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            ref = policy.predict_action_chunk(batch, noise=noise)
        torch.testing.assert_close(rt.predict_action_chunk(batch, noise=noise), ref, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def exported_onnx(tmp_path_factory, exported):
    policy, _ = exported
    root = tmp_path_factory.mktemp("export_onnx")
    policy.save_pretrained(root / "ckpt")
    return policy, export_checkpoint(root / "ckpt", root / "export", control_hz=30.0, onnx_steps=[6, 4])


def test_onnx_backend_gives_the_training_policys_actions(exported_onnx, exported, tmp_path):
    """The export's ONNX chunk graphs (policies/onnx.py) in ONNX Runtime: the PyTorch policy's chunks and closed-loop
    actions at batch 1 and both exported step counts; other batch sizes run in PyTorch under "auto" and are refused
    under "onnx"; the graph files are sha256-checked like the weights."""
    policy, folder = exported_onnx
    meta = verify_export(folder)
    assert [(g["file"], g["num_inference_steps"], g["batch_size"]) for g in meta["onnx"]] == [
        ("onnx/chunk_ddim6_b1.onnx", 6, 1), ("onnx/chunk_ddim4_b1.onnx", 4, 1)]
    assert all(g["max_abs_diff_vs_torch"] < 1e-4 and g["file"] in meta["files"] for g in meta["onnx"])
    rt = PolicyRuntime.load(folder, backend="onnx", num_threads=1)
    assert rt.backend == "onnx" and rt.uses_onnx(6, 1) and rt.uses_onnx(4, 1) and not rt.uses_onnx(6, 3)
    batch = _batch(policy, B=1, seed=7)
    noise = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(1))
    for steps in (None, 4):
        ref = policy.predict_action_chunk(batch, noise=noise, num_inference_steps=steps)
        torch.testing.assert_close(rt.predict_action_chunk(batch, noise=noise, num_inference_steps=steps), ref,
                                   atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rt.predict_action_chunk(_batch(policy, B=1, seed=8), noise=noise), ref, atol=1e-3)
    b3 = _batch(policy, B=3, seed=2)
    n3 = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(2))
    with pytest.raises(ValueError, match="no ONNX graph for 6 DDIM steps at batch size 3"):
        rt.predict_action_chunk(b3, noise=n3)
    auto = PolicyRuntime.load(folder, num_threads=1)
    assert auto.backend == "auto" and auto.uses_onnx()
    torch.testing.assert_close(auto.predict_action_chunk(b3, noise=n3), policy.predict_action_chunk(b3, noise=n3))
    # closed loop (the chunk boundary every 4 steps): the same actions as the PyTorch policy from the same seed
    _same_closed_loop(rt, policy, seed=1, atol=1e-5)
    # the AED's trace-friendly path (no torch.unique) pools exactly as the training path
    t = policy.tokenize_history(batch)
    torch.testing.assert_close(policy.aed._forward_direct(t["history.tokens"], t["history.token_mask"].bool(),
                                                          t["history.group_mask"].bool()),
                               policy.aed(t["history.tokens"], t["history.token_mask"].bool(),
                                          t["history.group_mask"].bool()))
    # a per-call step count outside 1..num_train_timesteps is refused on the policy and on both backends (0 used to
    # run the default silently; a negative count returned the initial noise as the action chunk)
    for bad_steps in (0, -1, 101, 2.5, True):
        for sampler in (policy, rt, auto):
            with pytest.raises(ValueError, match=r"num_inference_steps: expected an integer in 1\.\.100"):
                sampler.predict_action_chunk(batch, noise=noise, num_inference_steps=bad_steps)
    # refused: an export without graphs under backend="onnx", a step count without a graph, a tampered graph
    with pytest.raises(ValueError, match="has no ONNX graph for 6 DDIM steps"):
        PolicyRuntime.load(exported[1], backend="onnx")
    with pytest.raises(ValueError, match="has no ONNX graph for 5 DDIM steps"):
        PolicyRuntime.load(folder, backend="onnx", num_inference_steps=5)
    assert PolicyRuntime.load(exported[1]).backend == "torch"          # auto without graphs
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    with open(bad / "onnx" / "chunk_ddim4_b1.onnx", "ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="chunk_ddim4_b1.onnx has sha256"):
        PolicyRuntime.load(bad)


def test_export_folder_contents_and_model_card(exported):
    _, folder = exported
    names = {p.name for p in folder.iterdir()}
    assert names == {"config.json", "model.safetensors", "stats.json", "tokenizer.json", "export.json", "README.md"}
    meta = verify_export(folder)
    assert set(meta["files"]) == {"config.json", "model.safetensors", "stats.json", "tokenizer.json"}
    assert meta["features"]["action"]["names"] == ["dx", "dy", "dz", "gripper"] and meta["control_hz"] == 30.0
    card = (folder / "README.md").read_text()
    assert "| so100-reach | 0.900 | 10 |" in card and "| push-v3 | 0.500 | 10 |" in card
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()
    assert meta["git"]["commit"] == commit and commit in card
    assert "`observation.environment_state`: shape [17]" in card


def test_tampered_or_incomplete_exports_are_refused(exported, tmp_path):
    _, folder = exported
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    w = load_file(str(bad / "model.safetensors"))
    k = next(iter(w))
    w[k] = w[k] + 1.0
    save_file(w, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match="model.safetensors has sha256"):
        PolicyRuntime.load(bad)
    (bad / "export.json").unlink()
    with pytest.raises(FileNotFoundError, match="lacks export.json"):
        PolicyRuntime.load(bad)
    with pytest.raises(ValueError, match="num_inference_steps: expected 1..100, given 0"):
        PolicyRuntime.load(folder, num_inference_steps=0)
    with pytest.raises(FileExistsError):
        export_checkpoint(folder, folder)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "out")


def test_runtime_imports_without_heavy_dependencies_in_a_fresh_process(exported, tmp_path):
    policy, folder = exported
    batch = _batch(policy, B=2, seed=2)
    noise = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(4))
    save_file({**batch, "noise": noise}, str(tmp_path / "in.safetensors"))
    code = ("import sys, json, torch; torch.set_num_threads(1)\n"
            "from safetensors.torch import load_file, save_file\n"
            "from policies.runtime import PolicyRuntime\n"
            f"rt = PolicyRuntime.load({str(folder)!r})\n"
            f"b = load_file({str(tmp_path / 'in.safetensors')!r}); n = b.pop('noise')\n"
            f"save_file({{'a': rt.predict_action_chunk(b, noise=n)}}, {str(tmp_path / 'out.safetensors')!r})\n"
            f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({list(HEAVY)!r}))))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == []
    torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["a"],
                               policy.predict_action_chunk(batch, noise=noise), atol=1e-6, rtol=1e-6)


def test_export_script_from_a_registry_version(exported, tmp_path):
    from fleet.registry import CheckpointRegistry

    policy, folder = exported
    ckpt = tmp_path / "ckpt"
    policy.save_pretrained(ckpt)
    reg = CheckpointRegistry(str(tmp_path / "registry"))
    reg.publish(ckpt, metadata={"run_id": "t", "round": 0})
    v = reg.publish(ckpt, metadata={"run_id": "t", "round": 1})
    res = subprocess.run(
        [sys.executable, "scripts/export.py", f"deploy.export.registry_url={tmp_path / 'registry'}",
         f"deploy.export.version={v}", f"deploy.export.out_dir={tmp_path / 'out'}", "deploy.export.control_hz=80",
         f"hydra.run.dir={tmp_path / 'hydra'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    meta = verify_export(tmp_path / "out")
    assert meta["source"]["kind"] == "registry" and meta["source"]["version"] == v
    assert meta["source"]["metadata"] == {"run_id": "t", "round": 1}
    assert f"version {v}" in (tmp_path / "out" / "README.md").read_text()
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()
    # by default the chunk graph at the policy's own step count is exported too (the runtime's fast CPU path)
    assert [(g["num_inference_steps"], g["batch_size"]) for g in meta["onnx"]] == [(6, 1)]
    assert PolicyRuntime.load(tmp_path / "out").uses_onnx()


def test_export_takes_the_control_rate_recorded_by_training(exported, tmp_path):
    """A training run outside its Hydra dir still tells the export its rate (train_summary.json)."""
    import json
    import shutil

    from policies.export import training_provenance
    from scripts.export import store_control_hz

    policy, _ = exported
    ckpt = tmp_path / "run" / "checkpoints" / "0000010" / "pretrained_model"
    policy.save_pretrained(ckpt)
    assert store_control_hz(ckpt) is None                      # nothing recorded: unknown, not a guess
    (tmp_path / "run" / "train_summary.json").write_text(json.dumps(
        {"step": 10, "episodes": 3, "store": "outputs/so100_demos", "tasks": ["so100-reach"], "control_hz": 30.0}))
    prov = training_provenance(ckpt)
    assert prov["control_hz"] == 30.0 and prov["store"] == "outputs/so100_demos" and prov["tasks"] == ["so100-reach"]
    assert store_control_hz(ckpt) == 30.0
    shutil.rmtree(tmp_path / "run")


def test_an_exported_success_critic_chooses_the_runtimes_chunks(exported, tmp_path):
    """A checkpoint with FERT's success critic exports it (sha256-listed) and the runtime acts through it."""
    from policies.critic import CRITIC_FILES, CriticGuidedSampler, SuccessCritic, save_critic

    policy, _ = exported
    policy.save_pretrained(tmp_path / "ckpt")
    shapes = policy.config.input_shapes
    critic = SuccessCritic(shapes["observation.state"][0] + shapes["observation.environment_state"][0],
                           policy.config.action_dim, policy.config.n_action_steps, members=2, hidden=8,
                           state_keys=["observation.state", "observation.environment_state"])
    save_critic(critic, tmp_path / "ckpt", candidates=3)
    folder = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", control_hz=30.0)
    assert set(CRITIC_FILES) <= set(verify_export(folder)["files"])
    rt = PolicyRuntime.load(folder, backend="torch")
    assert rt.critic and isinstance(rt.policy.chunk_sampler, CriticGuidedSampler)
    rt.reset()
    rng = np.random.default_rng(0)
    for _ in range(5):
        a = rt.select_action({"observation.state": rng.uniform(0, 1, 4).astype(np.float32),
                              "observation.environment_state": rng.uniform(-1, 1, 17).astype(np.float32)})
        assert a.shape == (4,) and np.isfinite(a).all()
    assert rt.policy.chunk_sampler.decisions >= 1


def tiny_image_policy(size: int = 24) -> AEDDiffusionPolicy:
    """A tiny AED policy on ``observation.state`` (4) and a ``size`` x ``size`` uint8 corner camera, random weights
    (perturbed so that actions depend on every input), eval mode."""
    return tiny_policy({"observation.state": {"min": [-0.5, 0.3, 0.0, 0.0], "max": [0.5, 0.9, 0.3, 1.0]},
                        "action": {"min": [-1.0] * 4, "max": [1.0] * 4}},
                       image_channels=[8, 16], image_pool=1,
                       input_shapes={"observation.state": [4], "observation.images.corner": [size, size, 3]})


def test_image_policy_exports_to_onnx_and_ships_a_critic_that_sees_its_camera(tmp_path):
    """A policy that sees proprioception and a uint8 camera: its ONNX graph takes the frames an env renders (uint8)
    and gives the PyTorch actions; a success critic on the state plus the camera through a frozen copy of the
    policy's image encoder (policies.critic.CriticFeatures) ships in the export, and the runtime's chunk choice
    depends on the image it is shown."""
    from policies.critic import CriticFeatures, CriticGuidedSampler, SuccessCritic, load_critic, save_critic

    policy = tiny_image_policy()
    policy.save_pretrained(tmp_path / "ckpt")
    feats = CriticFeatures.from_policy(policy)
    assert feats.keys == ["observation.state", "observation.images.corner"] and feats.image_dim() == 16
    assert not any(p.requires_grad for p in feats.parameters())
    # the frozen copy is the policy's encoder: the same pooled features
    img = torch.randint(0, 256, (5, 24, 24, 3), dtype=torch.uint8)
    from policies.aed_diffusion.normalization import normalize_image

    own = policy.obs_encoder.images["observation_images_corner"](normalize_image(img)).mean(1)
    got = feats({"observation.state": torch.zeros(5, 4), "observation.images.corner": img})
    assert got.shape == (5, 20)
    torch.testing.assert_close(got[:, 4:], own, atol=1e-5, rtol=1e-5)
    critic = SuccessCritic(4 + 16, 4, policy.config.n_action_steps, members=2, hidden=8,
                           state_keys=feats.state_keys, image_keys=feats.image_keys,
                           image_channels=feats.image_channels)
    critic.frame.load_state_dict(feats.state_dict())
    with torch.no_grad():   # the critic's score must move with the camera's features
        critic.std.fill_(0.1)
    save_critic(critic.eval(), tmp_path / "ckpt", candidates=3)
    loaded, k = load_critic(tmp_path / "ckpt")
    assert k == 3 and loaded.image_keys == ["observation.images.corner"]
    torch.testing.assert_close(loaded.frame({"observation.state": torch.zeros(5, 4),
                                             "observation.images.corner": img}), got)
    folder = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", control_hz=80.0, onnx_steps=[6], onnx_batch_size=3)
    rt = PolicyRuntime.load(folder, backend="onnx", num_threads=1)
    assert rt.critic and isinstance(rt.policy.chunk_sampler, CriticGuidedSampler)
    ref = PolicyRuntime.load(folder, backend="torch", num_threads=1)
    scores = []
    for shade in (0, 255):
        for r in (rt, ref):
            r.reset()
        frame = np.full((24, 24, 3), shade, np.uint8)
        obs = {"observation.state": np.array([0.1, 0.6, 0.1, 0.5], np.float32), "observation.images.corner": frame}
        ga, gb = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
        a, b = rt.select_action(obs, generator=ga), ref.select_action(obs, generator=gb)
        assert a.shape == (4,) and np.isfinite(a).all()
        np.testing.assert_allclose(a, b, atol=1e-4)
        scores.append(rt.policy.chunk_sampler.last_scores.clone())
    assert not torch.allclose(scores[0], scores[1])
    # noise steering conditions its actor on state vectors only: it refuses a critic that sees a camera, saying so
    out = subprocess.run([sys.executable, "scripts/steer.py", f"steer.checkpoint={tmp_path / 'ckpt'}",
                          f"store.url={tmp_path / 'store'}", f"hydra.run.dir={tmp_path / 'steer'}"],
                         cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300,
                         check=False, env={**os.environ, "WANDB_MODE": "disabled"})
    assert out.returncode != 0 and "sees cameras ['observation.images.corner']" in out.stderr + out.stdout, out.stderr


def test_an_export_whose_action_names_do_not_fit_the_model_is_refused_at_load(exported, tmp_path):
    """An ``export.json`` naming more (or fewer) actions than the model outputs is refused when the runtime is built,
    not discovered at the first step; a fractional step count is refused instead of rounded down."""
    import json
    import shutil

    _, folder = exported
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    meta = json.loads((bad / "export.json").read_text())
    dim = int(meta["policy_config"]["action_dim"])
    meta["features"]["action"]["names"] = [f"j{i}" for i in range(dim + 2)]
    (bad / "export.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"len\(features.action.names\) = {dim + 2}, but the model acts in {dim}"):
        PolicyRuntime.load(bad)
    with pytest.raises(ValueError, match=r"num_inference_steps: expected an integer, given 2.7"):
        PolicyRuntime.load(folder, num_inference_steps=2.7)
    assert PolicyRuntime.load(folder, num_inference_steps=2).config.num_inference_steps == 2


def test_a_published_version_carries_its_rate_tasks_and_lineage_into_the_export(exported, tmp_path):
    """A version published with ``fleet.lineage`` (as the job and the learner publish) exports with its control
    rate, tasks, store snapshot and parent version, with no ``control_hz`` given and no training run directory; the
    model card names the registry, not the temporary folder the version was fetched into."""
    import json

    from experience_dict.store import ExperienceStore
    from fleet.lineage import lineage
    from fleet.registry import CheckpointRegistry
    from tests.test_store import PROGRESS, SPEC, write_episode

    policy, _ = exported
    url = str(tmp_path / "store")
    w = ExperienceStore.create_or_open(url, SPEC, progress_keys=PROGRESS, chunk_bytes=4096).writer("unit-0000")
    write_episode(w, 0, 0, task="reach-v3", is_demo=True)
    write_episode(w, 0, 1, task="push-v3")
    w.close()
    ckpt = tmp_path / "ckpt"
    policy.save_pretrained(ckpt)
    reg = CheckpointRegistry(str(tmp_path / "registry"))
    v0 = reg.publish(ckpt, metadata={"run_id": "base", "round": -1, **lineage(url, None)})
    v1 = reg.publish(ckpt, metadata={"run_id": "fert", "round": 0, **lineage(url, reg.latest_version())})
    import importlib.util

    lerobot_args = ([f"deploy.export.lerobot_dir={tmp_path / 'lerobot'}"]
                    if importlib.util.find_spec("lerobot_policy_fleetmind") else [])
    res = subprocess.run(
        [sys.executable, "scripts/export.py", f"deploy.export.registry_url={tmp_path / 'registry'}",
         "deploy.export.version=latest", f"deploy.export.out_dir={tmp_path / 'out'}", "deploy.export.onnx_steps=[]",
         f"hydra.run.dir={tmp_path / 'hydra'}", *lerobot_args],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "MUJOCO_GL": "egl"}, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    meta = json.loads((tmp_path / "out" / "export.json").read_text())
    assert meta["control_hz"] == 80.0 and meta["source"]["version"] == v1
    if lerobot_args:   # one command from a registry version to a LeRobot policy folder (issue 52, item 9)
        lr = tmp_path / "lerobot"
        cfg = json.loads((lr / "config.json").read_text())
        assert cfg["type"] == "fleetmind" and (lr / cfg["export_subdir"] / "export.json").is_file()
        summary = json.loads(res.stdout[res.stdout.index("{"):])
        assert summary["lerobot_dir"] == str(lr) and summary["version"] == v1   # 'latest' resolved in the summary
    tr = meta["training"]
    assert tr["tasks"] == ["push-v3", "reach-v3"] and tr["store"] == url and tr["parent_version"] == v0
    assert tr["store_episodes"] == 2 and tr["store_demos"] == 1
    card = (tmp_path / "out" / "README.md").read_text()
    assert "control rate: 80.0 Hz" in card and "tasks: push-v3, reach-v3" in card
    source_line = next(line for line in card.splitlines() if line.startswith("- source:"))
    assert str(tmp_path / "registry") in source_line and "ckpt" not in source_line   # not the fetched temp copy
    assert f"fine-tuned from: version {v0}" in card and "2 episodes (1 demonstrations)" in card
