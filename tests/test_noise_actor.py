"""Noise steering (policies/noise_actor.py, DSRL): on a tiny real store and policy, the actor trained through the
DDIM chain raises the critic's score of the chunks it starts, it round-trips through its files, and a checkpoint
that carries it acts from its noise (a function of the observation window alone), through ``load_checkpoint``."""

import shutil

import pytest
import torch

from configs.rules import ConfigError
from experience_dict.sampler import WindowDataset
from experience_dict.store import ExperienceStore
from fleet.acting import load_checkpoint
from fleet.fert.critic_fit import fit_critic
from policies.distill import balanced_anchors
from policies.factory import load_policy
from policies.noise_actor import (
    NoiseSteeredSampler,
    SteerConfig,
    fit_noise_actor,
    load_noise_actor,
    save_noise_actor,
    window_states,
)
from tests.test_learner import setup  # noqa: F401  (fixture)

torch.set_num_threads(1)
KEYS = ["observation.state", "observation.environment_state"]


def test_actor_climbs_the_critic_and_steers_a_loaded_checkpoint(setup, tmp_path):  # noqa: F811 (the fixture)
    reader = ExperienceStore.open(setup["store"])
    policy = load_policy(setup["base"]).eval()
    critic, _ = fit_critic(reader, reader.episodes(), KEYS, policy.config.action_dim, policy.config.n_action_steps,
                           steps_after_success=5, cfg={"updates": 30, "members": 2, "hidden": 16, "batch_size": 64,
                                                       "dropout": 0.0}, seed=0)
    windows = WindowDataset(reader, reader.episodes(), windows=policy.window_spec())
    anchors = balanced_anchors(windows, 24, seed=0)
    cfg = SteerConfig(updates=40, batch_size=16, lr=3e-3, hidden=32, pessimism=0.0)
    actor, rec = fit_noise_actor(policy, critic, windows, anchors, cfg, progress=False)
    assert rec["states"] == 24 and rec["q_end"] > rec["q_start"] and rec["q_end"] > rec["q_random"]
    H, A = policy.config.horizon, policy.config.action_dim
    assert 0 < rec["noise_rms"] < cfg.bound and set(rec["per_task_q"]) == {"reach-v3"}
    # the policy's weights are untouched by the fit (steering never changes the denoiser)
    ref = load_policy(setup["base"]).state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in policy.state_dict().items())

    # files: a checkpoint with the actor beside the weights loads steered; its chunks come from the actor's noise
    ckpt = tmp_path / "steered"
    shutil.copytree(setup["base"], ckpt)
    save_noise_actor(actor, ckpt, rec)
    again = load_noise_actor(ckpt)
    batch = windows.fetch(anchors[:6])
    names = policy.inference_window_spec()
    inf = {k: v for k, v in batch.items() if k in names or (k.endswith("_is_pad") and k[:-7] in names)}
    cur, prev = window_states(inf, KEYS)
    torch.testing.assert_close(again(cur, prev), actor(cur, prev))
    model, _ = load_checkpoint(ckpt)
    assert isinstance(model.chunk_sampler, NoiseSteeredSampler)
    with torch.no_grad():
        steered = model.chunk_sampler(inf, noise=torch.randn(6, H, A))
        other_noise = model.chunk_sampler(inf, noise=torch.randn(6, H, A))   # the noise given is not used
        direct = policy.predict_action_chunk(inf, noise=actor(cur, prev))
        plain = policy.predict_action_chunk(inf, noise=torch.randn(6, H, A))
    torch.testing.assert_close(steered, other_noise)
    torch.testing.assert_close(steered, direct)
    assert not torch.allclose(steered, plain)
    plain_model, _ = load_checkpoint(setup["base"])
    assert plain_model.chunk_sampler is None

    # the export (ONNX chunk graph) carries the actor: the runtime a robot uses starts its graph from the actor's noise
    from policies.export import export_checkpoint
    from policies.runtime import PolicyRuntime

    exp = export_checkpoint(ckpt, tmp_path / "export", onnx_steps=[policy.config.num_inference_steps],
                            onnx_batch_size=6)
    rt = PolicyRuntime.load(exp)
    assert rt.noise_actor and rt.uses_onnx(batch_size=6)
    with torch.no_grad():
        torch.testing.assert_close(rt.policy.chunk_sampler(inf, noise=torch.randn(6, H, A)), steered, atol=2e-3, rtol=0)

    # bad input: a half-written actor, and config values out of range, are refused by name
    (ckpt / "noise_actor.json").unlink()
    with pytest.raises(ValueError, match="needs both"):
        load_checkpoint(ckpt)
    with pytest.raises(ConfigError, match="steer.bound: expected a number > 0"):
        SteerConfig(bound=0.0)
    with pytest.raises(ConfigError, match="unknown keys"):
        SteerConfig.from_dict({"update": 3})
