"""The success critic (policies/critic.py): its Monte-Carlo target on hand-made episodes, a fit on a real Zarr
store of real Meta-World steps that learns which actions succeed, the sampler's choice and its independence of
the batch, save/load with clear errors, and the learner shipping it in a published, loadable version."""

import json

import numpy as np
import pytest
import torch

from experience_dict.store import ExperienceStore
from fleet.fert.critic_fit import fit_critic, success_targets
from policies.critic import (
    CRITIC_CONFIG,
    CRITIC_WEIGHTS,
    CriticGuidedSampler,
    SuccessCritic,
    load_critic,
    save_critic,
)

torch.set_num_threads(1)
KEYS = ["observation.state", "observation.environment_state"]


def test_success_targets_discount_to_the_first_success_and_zero_on_failure():
    y = success_targets(8, True, steps_after_success=3, gamma=0.5)      # first success at step 5
    np.testing.assert_allclose(y, [0.5 ** 5, 0.5 ** 4, 0.5 ** 3, 0.5 ** 2, 0.5, 1, 1, 1])
    assert y.dtype == np.float32
    np.testing.assert_array_equal(success_targets(4, False, 3, 0.9), np.zeros(4))
    np.testing.assert_array_equal(success_targets(2, True, 5, 0.9), np.ones(2))   # success at the first step
    with pytest.raises(ValueError, match="gamma"):
        success_targets(4, True, 1, 0.0)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Real reach-v3 steps: episodes pushing +x are labelled successes, episodes pushing -x failures (the
    critic must learn that the action, not the state, decides)."""
    from sim import make_env

    url = str(tmp_path_factory.mktemp("critic") / "store")
    from tests.test_learner import OBS_CFG, ROBOT_CFG, TASK_CFG

    env = make_env(task="reach-v3", unit_id=0, robot_cfg=ROBOT_CFG, obs_cfg=OBS_CFG, task_cfg=TASK_CFG)
    spec = env.spec_dict()
    st = ExperienceStore.create_or_open(url, spec=spec, control_hz=spec["control_hz"])
    w = st.writer("unit-0000")
    rng = np.random.default_rng(0)
    for i in range(16):
        sign = 1.0 if i % 2 == 0 else -1.0
        obs, _ = env.reset(seed=i)
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=1, seed=i, is_demo=False)
        for _ in range(12):
            a = np.array([0.5 * sign, *rng.uniform(-0.3, 0.3, 2), 0.0], np.float32)
            nxt, r, _, _, info = env.step(a)
            w.add_step(obs, a, float(r), info["progress"])
            obs = nxt
        w.commit(success=sign > 0)
    w.close()
    env.close()
    return url


def _fit(url, updates=150):
    reader = ExperienceStore.open(url)
    return fit_critic(reader, reader.episodes(), KEYS, 4, 4, steps_after_success=2,
                      cfg={"updates": updates, "members": 2, "hidden": 32, "batch_size": 64, "dropout": 0.0},
                      seed=0)


def test_fit_critic_learns_which_chunks_succeed(store):
    critic, rec = _fit(store)
    assert rec["episodes"] == 16 and rec["steps"] == 16 * 12 and 0.3 < rec["positive_share"] < 0.6
    assert rec["val_loss"] is not None and rec["val_loss"] < rec["val_loss_constant"] - 0.1   # held-out episodes
    reader = ExperienceStore.open(store)
    ep = reader.load_episode(reader.episodes()[1].episode_id, keys=KEYS)  # a failed episode's states
    s = torch.as_tensor(np.concatenate([ep[k] for k in KEYS], 1)[3:9], dtype=torch.float32)
    good = torch.zeros(len(s), 4, 4)
    good[..., 0] = 0.5
    p_good = critic.success_probability(s, s, good)
    p_bad = critic.success_probability(s, s, -good)
    assert bool((p_good > p_bad + 0.2).all()), (p_good, p_bad)


class _NoisePolicy:
    """A 'policy' whose chunk steps push +-0.5 along x by the sign of its initial noise (the candidates differ
    only by their noise, and stay inside the actions the critic saw)."""

    class config:
        horizon, action_dim, n_action_steps = 6, 4, 4

    def predict_action_chunk(self, batch, noise=None, noise_scale=1.0, **kw):
        out = torch.zeros_like(noise)
        out[..., 0] = 0.5 * torch.sign(noise[..., 0])
        return out


def test_sampler_executes_the_best_ranked_candidate_independently_of_the_batch(store):
    critic, _ = _fit(store)
    pol = _NoisePolicy()
    reader = ExperienceStore.open(store)
    ep = reader.load_episode(reader.episodes()[0].episode_id, keys=KEYS)
    s = torch.as_tensor(np.concatenate([ep[k] for k in KEYS], 1)[:6], dtype=torch.float32)
    d0 = ep[KEYS[0]].shape[1]
    batch = {KEYS[0]: torch.stack([s[:2, :d0]] * 3), KEYS[1]: torch.stack([s[:2, d0:]] * 3)}   # (B=3, T=2, .)
    noise = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(0))
    sampler = CriticGuidedSampler(pol, critic, candidates=16)
    out = sampler(batch, noise=noise)
    assert out.shape == (3, 6, 4) and sampler.decisions == 3
    # candidates from one's own noise: the chosen chunk pushes +x more often than a chunk of random noise
    assert float(out[:, :4, 0].mean()) > 0.25
    # the critic ranked the chosen chunk at least as high as the policy's own sample (candidate 0)
    cur, prev = s[1].expand(3, -1), s[0].expand(3, -1)
    own = pol.predict_action_chunk(batch, noise=noise)
    assert bool((critic.success_probability(cur, prev, out) >= critic.success_probability(cur, prev, own) - 1e-6).all())
    # a row's choice depends on its own noise only: the same row alone gives the same chunk
    alone = sampler({k: v[1:2] for k, v in batch.items()}, noise=noise[1:2])
    torch.testing.assert_close(alone[0], out[1])
    # one candidate: the policy's own chunk
    torch.testing.assert_close(CriticGuidedSampler(pol, critic, 1)(batch, noise=noise), own)


def test_save_load_round_trip_and_clear_errors(store, tmp_path):
    critic, _ = _fit(store, updates=5)
    assert load_critic(tmp_path) is None                                # no critic: None, not an error
    save_critic(critic, tmp_path, candidates=4)
    loaded, k = load_critic(tmp_path)
    assert k == 4 and loaded.state_keys == KEYS
    x = torch.randn(5, critic.state_dim)
    c = torch.randn(5, 4, 4)
    torch.testing.assert_close(loaded.success_probability(x, x, c), critic.success_probability(x, x, c))
    with torch.no_grad():                                               # a diverged fit: refused, tensor named
        critic.nets[1][0].bias[3] = float("nan")
    save_critic(critic, tmp_path / "nan", candidates=4)
    with pytest.raises(ValueError, match=r"non-finite values in \['nets.1.0.bias'\]"):
        load_critic(tmp_path / "nan")
    cfg = json.loads((tmp_path / CRITIC_CONFIG).read_text())
    (tmp_path / CRITIC_CONFIG).write_text(json.dumps({**cfg, "hidden": 8}))
    with pytest.raises(ValueError, match="does not fit"):
        load_critic(tmp_path)
    (tmp_path / CRITIC_WEIGHTS).unlink()
    with pytest.raises(ValueError, match="needs both"):
        load_critic(tmp_path)
    with pytest.raises(ValueError, match="state keys"):
        fit_critic(ExperienceStore.open(store), ExperienceStore.open(store).episodes(), ["observation.nope"], 4, 4, 2)
    with pytest.raises(ValueError, match=">= 1"):
        SuccessCritic(0, 4, 4)
