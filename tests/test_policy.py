"""AED diffusion policy: config checks, attention mask, overfitting windows of a real Zarr store, training
resume, checkpoints loaded in a fresh process, wrong-shape checkpoints, deployment windows."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from experience_dict.sampler import WindowDataset
from experience_dict.store import ExperienceStore
from policies.aed_diffusion import AEDDiffusionConfig, AEDDiffusionPolicy
from policies.aed_diffusion.modeling_aed_diffusion import Denoiser, build_policy, denoiser_mask
from policies.aed_diffusion.training import last_checkpoint, train_policy

torch.set_num_threads(1)
REPO = Path(__file__).resolve().parents[1]
SPEC = {"observation.state": {"shape": [4], "dtype": "float32"},
        "observation.environment_state": {"shape": [6], "dtype": "float32"},
        "action": {"shape": [4], "dtype": "float32"}, "control_hz": 80.0}
TINY = {"input_shapes": {"observation.state": [4], "observation.environment_state": [6]}, "dim": 32, "n_layers": 2,
            "n_heads": 2, "state_hidden": 32, "horizon": 8, "n_action_steps": 4,
            "action_patch": 1, "condition_layers": None,  # the one-token-a-step denoiser these tests were written on
            "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2, "tokenizer_vocab_size": 256},
            "mt_loss": {"weight": 0.01}}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A real Zarr store: 4 episodes of a point reaching a goal (action = gain * (goal - pos), gripper closes)."""
    url = str(tmp_path_factory.mktemp("store") / "store")
    st = ExperienceStore.create_or_open(url, spec=SPEC, progress_keys=[])
    w = st.writer("unit-0000")
    rng = np.random.default_rng(0)
    for e in range(4):
        pos, goal = rng.uniform(-0.2, 0.2, 3), rng.uniform(-0.2, 0.2, 3)
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=-1, seed=e, is_demo=True)
        for t in range(40):
            act = np.clip(np.r_[(goal - pos) * 8.0, 1.0 if t > 20 else -1.0], -1, 1).astype(np.float32)
            obs = {"observation.state": np.r_[pos, 0.5].astype(np.float32),
                   "observation.environment_state": np.r_[goal, pos - goal].astype(np.float32)}
            w.add_step(obs, act, reward=0.0, progress={})
            pos = pos + act[:3] * 0.01
        w.commit(success=True)
    return ExperienceStore.open(url)


def tiny_cfg(**over) -> AEDDiffusionConfig:
    d = json.loads(json.dumps(TINY))
    for k, v in over.items():
        if isinstance(v, dict):
            d[k] = {**d.get(k, {}), **v}
        else:
            d[k] = v
    return AEDDiffusionConfig.from_dict(d)


def test_config_validation():
    with pytest.raises(ValueError, match="n_action_steps"):
        AEDDiffusionConfig(horizon=8, n_action_steps=9)
    with pytest.raises(ValueError, match="partition"):
        AEDDiffusionConfig(relative_action_dims=[0, 1], absolute_action_dims=[3])
    with pytest.raises(ValueError, match="multiple"):
        tiny_cfg(aed={"history_actions": 10})
    with pytest.raises(ValueError, match=r"\[H, W, 3\]"):
        AEDDiffusionConfig(input_shapes={"observation.images.corner": [96, 96]})
    with pytest.raises(ValueError, match="unknown keys"):
        AEDDiffusionConfig.from_dict({"dimm": 3})
    with pytest.raises(ValueError, match="action_patch"):
        AEDDiffusionConfig(horizon=16, action_patch=3)


def test_config_defaults_are_the_policy_yaml():
    """The dataclass defaults of the denoiser's form are configs/policy/aed_diffusion.yaml's (one source of truth
    for a config that leaves them out); old checkpoints get their own values from the migration (below)."""
    from omegaconf import OmegaConf

    yaml = OmegaConf.to_container(OmegaConf.load(REPO / "configs/policy/aed_diffusion.yaml"))
    default = AEDDiffusionConfig()
    assert (default.action_patch, default.condition_layers) == (yaml["action_patch"], yaml["condition_layers"]) == (4, 0)
    assert AEDDiffusionConfig.from_dict({}).action_patch == 4


def test_every_policy_yaml_value_is_its_config_class_default():
    """configs/policy/<type>.yaml mirrors its config class (AEDDiffusionConfig, MLPChunkConfig): every key the
    class has holds the class's default (the YAML adds only the Hydra-side keys: type, input_keys, images), so a
    policy built from a partial dict and one composed by Hydra agree. The presets (aed_diffusion_image) override."""
    from dataclasses import asdict

    from omegaconf import OmegaConf

    from policies.mlp_chunk.modeling_mlp_chunk import MLPChunkConfig

    for name, defaults in (("aed_diffusion", AEDDiffusionConfig().to_dict()), ("mlp_chunk", asdict(MLPChunkConfig()))):
        yaml = OmegaConf.to_container(OmegaConf.load(REPO / f"configs/policy/{name}.yaml"))
        assert set(yaml) - set(defaults) <= {"type", "input_keys", "images"}, name
        assert {k: v for k, v in yaml.items() if k in defaults} == {k: defaults[k] for k in yaml if k in defaults}, name


def test_checkpoint_saved_before_action_patch_and_condition_layers_loads_with_their_old_values(store, tmp_path):
    """A config.json without ``action_patch``/``condition_layers`` (saved before the fields existed) is read
    with 1 / None, the model it was saved from, not the dataclass defaults (4 / 0)."""
    from policies.aed_diffusion.configuration_aed_diffusion import migrate_checkpoint_config

    assert migrate_checkpoint_config({"dim": 32}) == {"dim": 32, "action_patch": 1, "condition_layers": None}
    assert migrate_checkpoint_config({"action_patch": 4, "condition_layers": 0})["action_patch"] == 4  # kept
    policy = build_policy(tiny_cfg(), store, store.episodes())      # action_patch 1, condition_layers None
    d = policy.save_pretrained(tmp_path / "old")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["action_patch"], cfg["condition_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    loaded = AEDDiffusionPolicy.from_pretrained(d)                  # (with action_patch 4 the weights would not fit)
    assert (loaded.config.action_patch, loaded.config.condition_layers) == (1, None)


def test_window_spec_and_ablations(store):
    eps = store.episodes()
    p = build_policy(tiny_cfg(), store, eps)
    spec = p.window_spec()
    assert spec["action"] == ("action", list(range(8)))
    assert spec["history.action"] == ("action", list(range(-8, 0)))
    assert spec["history.observation.state"] == ("observation.state", [-8, -4, 0])
    assert spec["future.observation.state"] == ("observation.state", [0, 4, 8])
    assert spec["observation.state"] == ("observation.state", [-1, 0])
    base = build_policy(tiny_cfg(aed={"enabled": False}, mt_loss={"weight": 0.0}), store, eps)
    assert set(base.window_spec()) == {"observation.state", "observation.environment_state", "action"}
    assert base.tokenizer is None and not hasattr(base, "aed") and not hasattr(base, "mt_decoder")
    ds = WindowDataset(store, eps, windows=base.window_spec())
    loss, m = base(torch.utils.data.default_collate([ds[i] for i in range(4)]))
    assert torch.isfinite(loss) and "mt_loss" not in m


def test_attention_mask_blocks_what_it_must():
    m = denoiser_mask(n_obs=3, n_prefix=2, n_act=4)
    obs, pre, act = slice(0, 3), slice(3, 5), slice(5, 9)
    assert m[obs, obs].all() and not m[obs, pre].any() and not m[obs, act].any()
    assert m[pre, obs].all() and m[pre, pre].all() and not m[pre, act].any()
    assert m[act].all()
    # functionally: with non-zero adaLN weights, noisy actions cannot change obs/prefix states,
    # the prefix cannot change obs states, and both do change the action states
    torch.manual_seed(0)
    cfg = tiny_cfg()
    den = Denoiser(cfg, n_obs_tokens=3, n_prefix=2).eval()
    for blk in den.blocks:
        torch.nn.init.normal_(blk.ada[1].weight, std=0.1)
    states = {}
    den.blocks[-1].register_forward_hook(lambda mod, inp, out: states.__setitem__("x", out.detach().clone()))
    obs_t, prefix, noisy = torch.randn(2, 3, 32), torch.randn(2, 2, 32), torch.randn(2, 8, 4)
    t = torch.tensor([5, 50])
    den.forward_masked(noisy, t, obs_t, prefix)  # the whole sequence under the mask, as the design states it
    x0 = states["x"]
    den.forward_masked(noisy + 1.0, t, obs_t, prefix)
    torch.testing.assert_close(states["x"][:, :5], x0[:, :5])
    assert not torch.allclose(states["x"][:, 5:], x0[:, 5:])
    den.forward_masked(noisy, t, obs_t, prefix + torch.randn_like(prefix))  # (a constant shift would vanish in LN)
    torch.testing.assert_close(states["x"][:, :3], x0[:, :3])
    assert not torch.allclose(states["x"][:, 3:5], x0[:, 3:5]) and not torch.allclose(states["x"][:, 5:], x0[:, 5:])
    den.forward_masked(noisy, torch.tensor([70, 99]), obs_t, prefix)  # obs / prefix are modulated at timestep 0
    torch.testing.assert_close(states["x"][:, :5], x0[:, :5])


@pytest.mark.parametrize("aed,patch,cond_layers", [(True, 1, None), (False, 1, None), (True, 4, None), (True, 4, 0),
                                                    (False, 2, 1)])
def test_two_stream_denoiser_and_cached_sampling_match_the_masked_sequence(store, aed, patch, cond_layers):
    """forward (obs/prefix stream + action stream on cached keys/values) == forward_masked (one masked
    sequence), values and gradients; DDIM sampling with the per-chunk cache == recomputing everything.
    patch: actions per action token (``action_patch``), which changes the token count, not the chunk's shape;
    cond_layers: blocks that update the obs/prefix tokens (``condition_layers``; later blocks hold them fixed)."""
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(aed={"enabled": aed}, action_patch=patch,
                                    condition_layers=cond_layers), store, store.episodes())
    with torch.no_grad():  # non-zero adaLN / output weights, so every path matters
        for name, w in policy.denoiser.named_parameters():
            if "ada" in name or name.startswith("out."):
                w.normal_(std=0.1)
    den = policy.denoiser
    obs_t = torch.randn(3, den.n_obs, 32, requires_grad=True)
    prefix = torch.randn(3, den.n_prefix, 32, requires_grad=True) if aed else None
    noisy, t = torch.randn(3, 8, 4), torch.tensor([3, 40, 99])
    outs = []
    for fn in (den, den.forward_masked):
        pred, hidden = fn(noisy, t, obs_t, prefix)
        grads = torch.autograd.grad((pred ** 2).sum() + hidden.sum(), [obs_t] + ([prefix] if aed else []))
        outs.append((pred, hidden, grads))
    assert outs[0][0].shape == (3, 8, 4) and outs[0][1].shape == (3, 8 // patch, 32)
    for a, b in zip(outs[0][:2] + tuple(outs[0][2]), outs[1][:2] + tuple(outs[1][2])):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if cond_layers == 0:  # the obs/prefix tokens held at their input state: not the full-depth denoiser
        den.cond_layers = cfg_layers = policy.config.n_layers
        assert not torch.allclose(den(noisy, t, obs_t, prefix)[0], outs[0][0]), cfg_layers
        den.cond_layers = 0
    if patch > 1:  # token j predicts actions [j * patch, (j + 1) * patch): other tokens' noise changes them too,
        # but each token's own actions come from its own output row
        pred = den(noisy, t, obs_t, prefix)[0]
        with torch.no_grad():
            den.out.weight[:4].zero_(), den.out.bias[:4].fill_(0.25)  # the first action of every token
        pred2 = den(noisy, t, obs_t, prefix)[0]
        assert torch.equal(pred2[:, ::patch], torch.full_like(pred2[:, ::patch], 0.25))
        torch.testing.assert_close(pred2[:, 1::patch], pred[:, 1::patch])
        loss, metrics = policy.train()(policy.tokenize_history(next(iter(torch.utils.data.DataLoader(
            WindowDataset(store, store.episodes(), windows=policy.window_spec()), batch_size=4)))))
        assert torch.isfinite(loss) and metrics["mt_loss"] > 0  # the MT decoder reads patched hidden states
    policy.eval()
    ds = WindowDataset(store, store.episodes(), windows=policy.inference_window_spec())
    batch = torch.utils.data.default_collate([ds[i] for i in (0, 7, 50, 90)])
    batch = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    noise = torch.randn(4, 8, 4, generator=torch.Generator().manual_seed(2))
    cached = policy.predict_action_chunk(batch, noise=noise)
    full = policy.predict_action_chunk(batch, noise=noise, use_cache=False)
    assert cached.abs().max() > 0.05  # not a degenerate all-zero chunk
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def _eval_loss(policy, batch, seeds=range(8)):
    out = []
    for s in seeds:
        torch.manual_seed(s)
        with torch.no_grad():
            out.append(policy(batch)[0].item())
    return float(np.mean(out))


@pytest.mark.slow
def test_overfits_windows_of_a_real_store_and_resumes(store, tmp_path):
    eps = store.episodes()
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(), store, eps)
    ds = torch.utils.data.Subset(WindowDataset(store, eps, windows=policy.window_spec()), [3, 17, 45, 70, 101, 150])
    batch = policy.tokenize_history(torch.utils.data.default_collate([ds[i] for i in range(len(ds))]))
    assert batch["history.group_mask"][0].tolist() == [False, True]  # step 3: steps -5..-2 precede the episode
    policy.train()
    start = _eval_loss(policy, batch)
    tc = {"steps": 150, "batch_size": 6, "lr": 3e-3, "warmup_steps": 10, "log_every": 25, "save_every": 75, "ema": False,
              "progress": False, "seed": 0, "wandb": {"enabled": False}}
    res = train_policy(tc, tmp_path / "run", policy=policy, dataset=ds, device="cpu")
    assert res["step"] == 150
    policy.train()
    end = _eval_loss(policy, batch)
    print("overfit loss", start, "->", end)
    assert end < 0.35 * start, (start, end)
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [25, 50, 75, 100, 125, 150]
    # resume: a longer run in the same dir continues from the last checkpoint (step 150), not from scratch
    assert last_checkpoint(tmp_path / "run").name == "0000150"
    res2 = train_policy({**tc, "steps": 175}, tmp_path / "run", dataset=ds, device="cpu")
    assert res2["step"] == 175
    lines = [json.loads(s) for s in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines][-2:] == [150, 175]
    assert lines[-1]["lr"] < tc["lr"] * 0.05  # cosine schedule resumed near its end
    opt_json = json.loads((last_checkpoint(tmp_path / "run") / "training_state" / "optimizer.json").read_text())
    assert opt_json["state"]["0"]["step"] == {"tensor": "0.step"}


def test_checkpoint_same_actions_in_fresh_process(store, tmp_path):
    eps = store.episodes()
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(), store, eps).eval()
    ds = WindowDataset(store, eps, windows=policy.inference_window_spec())
    batch = torch.utils.data.default_collate([ds[i] for i in (0, 5, 30)])
    batch = {k: v for k, v in batch.items() if torch.is_tensor(v)}
    noise = torch.randn(3, 8, 4, generator=torch.Generator().manual_seed(1))
    ref = policy.predict_action_chunk(batch, noise=noise)
    assert ref.shape == (3, 8, 4) and torch.isfinite(ref).all()
    policy.save_pretrained(tmp_path / "ckpt")
    assert {p.name for p in (tmp_path / "ckpt").iterdir()} == {"config.json", "model.safetensors", "stats.json",
                                                               "tokenizer.json"}
    save_file({**{k: v.contiguous() for k, v in batch.items()}, "noise": noise}, str(tmp_path / "batch.safetensors"))
    code = (
        "import sys, torch; torch.set_num_threads(1)\n"
        "from safetensors.torch import load_file, save_file\n"
        "from policies.aed_diffusion import AEDDiffusionPolicy\n"
        f"p = AEDDiffusionPolicy.from_pretrained({str(tmp_path / 'ckpt')!r})\n"
        f"b = load_file({str(tmp_path / 'batch.safetensors')!r}); noise = b.pop('noise')\n"
        f"save_file({{'a': p.predict_action_chunk(b, noise=noise)}}, {str(tmp_path / 'out.safetensors')!r})\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, env=env, timeout=300)
    torch.testing.assert_close(load_file(str(tmp_path / "out.safetensors"))["a"], ref, atol=1e-5, rtol=1e-5)


def test_wrong_shape_checkpoint_fails_clearly(store, tmp_path):
    eps = store.episodes()
    small = build_policy(tiny_cfg(), store, eps)
    big = build_policy(tiny_cfg(dim=48), store, eps)
    small.save_pretrained(tmp_path / "a")
    big.save_pretrained(tmp_path / "b")
    (tmp_path / "a" / "model.safetensors").write_bytes((tmp_path / "b" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"tensor '.+' has shape \(.*48.*\), the model expects \(.*32.*\)"):
        AEDDiffusionPolicy.from_pretrained(tmp_path / "a")
    noaed = build_policy(tiny_cfg(aed={"enabled": False}), store, eps)
    noaed.save_pretrained(tmp_path / "c")
    (tmp_path / "a" / "model.safetensors").write_bytes((tmp_path / "c" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="missing tensors"):
        AEDDiffusionPolicy.from_pretrained(tmp_path / "a")


def _deployment_case(store):
    """A tiny policy in eval mode, its inference window spec, the sampler over the store's first episode, that
    episode's arrays and the policy's observation keys."""
    eps = store.episodes()
    policy = build_policy(tiny_cfg(), store, eps).eval()
    spec = policy.inference_window_spec()
    return (policy, spec, WindowDataset(store, eps[:1], windows=spec), store.load_episode(eps[0].episode_id),
            list(policy.config.input_shapes))


def test_select_action_builds_the_sampler_windows(store):
    policy, spec, ds, ep, keys = _deployment_case(store)
    calls = []
    orig = policy.predict_action_chunk

    def spy(batch, **kw):
        calls.append(batch)
        return orig(batch, **kw)

    policy.predict_action_chunk = spy
    policy.reset()
    # drive select_action with the episode's observations; replace the executed actions by the episode's own
    for t in range(13):
        a = policy.select_action({k: ep[k][t] for k in keys})
        assert a.shape == (4,) and a.dtype == np.float32 and np.all(np.abs(a) <= 1.0 + 1e-5)
        policy.history.actions[-1] = torch.from_numpy(ep["action"][t])[None]
        if t in (0, 4, 12):  # re-plans every n_action_steps = 4 steps; compare windows with the sampler
            got, want = calls[-1], ds[t]
            for name in spec:
                pad = want[f"{name}_is_pad"]
                assert torch.equal(got[f"{name}_is_pad"][0], pad), name
                torch.testing.assert_close(got[name][0][~pad].float(), want[name][~pad].float())
    assert len(calls) == 4
    policy.reset()
    assert not policy._queue and not policy.history.actions and not policy.history.frames


def test_policy_server_history_builds_the_sampler_windows_from_the_first_step(store):
    """Training (the sampler), local acting (the policy's history) and the policy server's worker side build the
    same conditioning for the same episode at every step, the padded first steps included."""
    from fleet.acting import ObservationHistory

    policy, spec, ds, ep, keys = _deployment_case(store)
    server_side = ObservationHistory(spec, policy.config.action_dim)
    policy.reset()
    for t in range(14):
        obs = {k: ep[k][t] for k in keys}
        server_side.push_obs(obs)
        policy.history.push_obs({k: torch.from_numpy(v)[None] for k, v in obs.items()})
        got, local, want = server_side.sample(), policy.history.batch(), ds[t]
        for name in spec:
            pad = want[f"{name}_is_pad"].numpy()
            assert (got[f"{name}_is_pad"] == pad).all() and (local[f"{name}_is_pad"][0].numpy() == pad).all(), (t, name)
            np.testing.assert_allclose(got[name][~pad], want[name].numpy()[~pad], err_msg=f"{t} {name}")
            np.testing.assert_array_equal(local[name][0].numpy(), got[name])
        server_side.push_action(ep["action"][t])
        policy.history.push_action(torch.from_numpy(ep["action"][t])[None])
    assert pad.sum() == 0   # by step 13 the history windows are full


def _store_with(tmp_path, action_fn, n_eps: int = 3, T: int = 30):
    """A real Zarr store whose step-t action of episode e is ``action_fn(e, t)`` (4,)."""
    st = ExperienceStore.create_or_open(str(tmp_path / "s"), spec=SPEC, progress_keys=[])
    w = st.writer("unit-0000")
    rng = np.random.default_rng(1)
    for e in range(n_eps):
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=-1, seed=e, is_demo=True)
        for t in range(T):
            obs = {"observation.state": rng.normal(size=4).astype(np.float32),
                   "observation.environment_state": rng.normal(size=6).astype(np.float32)}
            w.add_step(obs, np.asarray(action_fn(e, t), np.float32), reward=0.0, progress={})
        w.commit(success=True)
    w.close()
    return ExperienceStore.open(str(tmp_path / "s"))


def test_constant_action_dimension_comes_back_exactly(tmp_path):
    """Action dim 3 is always 0.5: whatever the network predicts there, the unnormalized action is 0.5."""
    rng = np.random.default_rng(0)
    st = _store_with(tmp_path, lambda e, t: np.r_[rng.uniform(-1, 1, 3), 0.5])
    eps = st.episodes()
    for norm in ("min_max", "mean_std"):
        torch.manual_seed(0)
        policy = build_policy(tiny_cfg(action_norm=norm), st, eps).eval()
        batch = torch.utils.data.default_collate([WindowDataset(st, eps, windows=policy.inference_window_spec())[i]
                                                  for i in (0, 11, 40)])
        with torch.no_grad():
            a = policy.predict_action_chunk(batch, generator=torch.Generator().manual_seed(0))
        assert torch.all(a[..., 3] == torch.tensor(0.5)), (norm, a[..., 3].unique())
        assert a[..., :3].std() > 0                                   # the other dims still vary
        raw = torch.tensor([[0.1, -0.3, 0.7, 0.5]])
        back = policy.normalizer.unnormalize("action", policy.normalizer.normalize("action", raw))
        torch.testing.assert_close(back, raw)


def test_mean_std_clip_range_covers_the_data(tmp_path):
    """With action_norm=mean_std the clip range derives from the statistics: a clean chunk at the data's largest
    action (2.5+ std from the mean) is sampled back by DDIM instead of being clipped to mean + 1 std."""
    # dim 0: mostly 0, one step in ten at 1.0 (= mean + 3 std); the others uniform
    rng = np.random.default_rng(0)
    st = _store_with(tmp_path, lambda e, t: np.r_[1.0 if t % 10 == 0 else 0.0, rng.uniform(-1, 1, 3)])
    eps = st.episodes()
    policy = build_policy(tiny_cfg(action_norm="mean_std"), st, eps).eval()
    stats = policy.stats["action"]
    z = (1.0 - stats["mean"][0]) / stats["std"][0]
    assert z > 2.5 and policy.clip_sample_range >= z - 1e-6
    with pytest.raises(ValueError, match="clips actions the data holds"):
        build_policy(tiny_cfg(action_norm="mean_std", clip_sample_range=1.0), st, eps)

    def ddim_from_oracle(sched, x0: torch.Tensor) -> torch.Tensor:
        """DDIM with a denoiser that knows the clean chunk ``x0`` (epsilon consistent with it at every step)."""
        sched.set_timesteps(10)
        x = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
        for t in sched.timesteps:
            ab = sched.alphas_cumprod[t]
            eps = (x - ab.sqrt() * x0) / (1 - ab).sqrt()
            x = sched.step(eps, t, x).prev_sample
        return x

    x0 = torch.zeros(1, 8, 4)
    x0[..., 0] = z                                                   # the largest action of the data, normalized
    out = policy.normalizer.unnormalize("action", ddim_from_oracle(policy.inference_scheduler, x0))
    torch.testing.assert_close(out[..., 0], torch.ones(1, 8), atol=1e-4, rtol=0)
    from diffusers import DDIMScheduler

    old = DDIMScheduler(**{**dict(policy.inference_scheduler.config), "clip_sample_range": 1.0})
    clipped = policy.normalizer.unnormalize("action", ddim_from_oracle(old, x0))
    assert clipped[..., 0].max() < 0.5                                # the old default: never above mean + 1 std
    min_max = build_policy(tiny_cfg(), st, eps)
    assert min_max.clip_sample_range == 1.0


def test_resumed_training_is_bit_identical_to_an_uninterrupted_run(store, tmp_path, monkeypatch):
    """Interrupt a 6-step run after its step-3 checkpoint, resume it: the weights, EMA and optimizer at step 6
    equal the uninterrupted run's bit for bit (batches and diffusion noise are functions of (seed, step))."""
    from policies.aed_diffusion.training import StepBatchSampler

    eps = store.episodes()
    tc = {"steps": 6, "batch_size": 8, "lr": 1e-3, "warmup_steps": 2, "log_every": 3, "save_every": 3,
          "progress": False, "seed": 5, "wandb": {"enabled": False}}

    def fresh():
        torch.manual_seed(0)
        return build_policy(tiny_cfg(), store, eps)

    train_policy(tc, tmp_path / "straight", policy=fresh(), reader=store, episodes=eps, device="cpu")

    class Interrupted(Exception):
        pass

    orig, calls = torch.optim.AdamW.step, {"n": 0}

    def step(self, *a, **k):
        calls["n"] += 1
        if calls["n"] == 4:                   # after the step-3 checkpoint, before step 4 is applied
            raise Interrupted
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", step)
    with pytest.raises(Interrupted):
        train_policy(tc, tmp_path / "resumed", policy=fresh(), reader=store, episodes=eps, device="cpu")
    monkeypatch.setattr(torch.optim.AdamW, "step", orig)
    assert last_checkpoint(tmp_path / "resumed").name == "0000003"
    torch.manual_seed(123)                    # a different global RNG state must not matter
    train_policy(tc, tmp_path / "resumed", reader=store, episodes=eps, device="cpu")
    for f in ("model.safetensors", "ema.safetensors"):
        a = load_file(str(tmp_path / "straight/checkpoints/0000006/training_state" / f))
        b = load_file(str(tmp_path / "resumed/checkpoints/0000006/training_state" / f))
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), (f, k)
    # the batches of steps 3..5 are not those of steps 0..2 (the old resume replayed the first ones)
    s = StepBatchSampler(len(WindowDataset(store, eps, windows=fresh().window_spec())), 8, 5, 0, 6)
    b = list(s)
    assert len(b) == 6 and all(b[i] != b[i + 3] for i in range(3)) and b == [s.batch(i) for i in range(6)]


def test_training_bar_redraws_at_its_interval_off_a_terminal(store, tmp_path, capfd, monkeypatch):
    """Issue 52, item 12: off a terminal (``fleet.progress.calm_progress``: a 30 s interval) the training bar does not
    redraw at every logged step (``set_postfix`` used to force a redraw past the interval)."""
    from functools import partialmethod

    import tqdm.std

    monkeypatch.setattr(tqdm.std.tqdm, "__init__", partialmethod(tqdm.std.tqdm.__init__, mininterval=30.0))
    eps = store.episodes()
    torch.manual_seed(0)
    policy = build_policy(tiny_cfg(), store, eps)
    tc = {"steps": 60, "batch_size": 4, "log_every": 5, "save_every": 60, "ema": False, "progress": True, "seed": 0,
          "wandb": {"enabled": False}}
    capfd.readouterr()
    train_policy(tc, tmp_path / "run", policy=policy, reader=store, episodes=eps, device="cpu")
    err = capfd.readouterr().err
    draws = err.count("\r")
    assert 1 <= draws <= 3, (draws, err[-500:])   # the first draw and the last, not one per logged step (12)
