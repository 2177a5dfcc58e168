"""Noise steering (DSRL): a small policy over the diffusion policy's initial noise, trained against the success critic.

DSRL (Wagenmaker et al., "Steering Your Diffusion Policy with Latent Space Reinforcement Learning", CoRL 2025)
leaves the diffusion policy's weights as they are and learns where its sampler starts: a small actor maps the state
to the initial noise ``w`` of the (deterministic, DDIM) denoising chain, so the chunk executed is
``a = DDIM(s, w(s))``. Any ``w`` of typical size gives a chunk of the policy's own kind, so steering cannot make the
denoiser forget a task, and the policy acting alone (one chunk per decision, K = 1) gets the choice the success
critic would make among K samples.

Here the critic is known and the chain is differentiable (``AEDDiffusionPolicy._denoise_chunk``: diffusers' DDIM
step is tensor arithmetic), so the actor is trained by the deterministic policy gradient through the chain:
maximise the ensemble's pessimistic success probability ``mean - pessimism * std`` over the critic's members of
``Q(s, DDIM(s, w(s)))``, with ``w = bound * tanh(f(s))`` bounded per coordinate (DSRL's noise bound, which keeps
``w`` where the denoiser was trained). DSRL itself learns a noise-space critic with SAC; with the chunk critic in
hand that step is not needed.

Files beside the weights: ``noise_actor.safetensors`` (weights and input standardisation) and ``noise_actor.json``
(:meth:`NoiseActor.config`). :func:`install_noise_actor` makes a loaded policy's ``chunk_sampler`` start from the
actor's noise (``fleet.acting.load_checkpoint`` calls it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from policies.steer_config import SteerConfig  # noqa: F401 - its home is torch-free (configs compose it)

ACTOR_FILE, ACTOR_CONFIG = "noise_actor.safetensors", "noise_actor.json"


class NoiseActor(nn.Module):
    """``(state (B, D), previous state (B, D)) -> initial noise (B, horizon, A)`` float32, each coordinate in
    ``(-bound, bound)``: an MLP (2 hidden layers, LayerNorm, ReLU) on the standardised ``[s, s - s_prev]`` (the
    success critic's state features), then ``bound * tanh``.

    Args:
        state_dim: D (the concatenated ``state_keys``). horizon, action_dim: the policy's chunk shape.
        hidden: width. bound: the noise bound (DSRL's action bound in noise space; N(0, 1) noise lies within
            +-2 for 95 % of coordinates). state_keys: the observation keys of the state, in order.

    Raises:
        ValueError: a size below 1 or a bound <= 0.
    """

    def __init__(self, state_dim: int, horizon: int, action_dim: int, hidden: int = 256, bound: float = 2.0,
                 state_keys: Sequence[str] = ()):
        super().__init__()
        if min(state_dim, horizon, action_dim, hidden) < 1 or not bound > 0:
            raise ValueError(f"NoiseActor: sizes must be >= 1 and bound > 0, given state_dim={state_dim}, "
                             f"horizon={horizon}, action_dim={action_dim}, hidden={hidden}, bound={bound}")
        self.state_dim, self.horizon, self.action_dim = int(state_dim), int(horizon), int(action_dim)
        self.hidden, self.bound, self.state_keys = int(hidden), float(bound), list(state_keys)
        self.net = nn.Sequential(nn.Linear(2 * self.state_dim, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                 nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.ReLU(),
                                 nn.Linear(hidden, self.horizon * self.action_dim))
        self.register_buffer("mean", torch.zeros(2 * self.state_dim))
        self.register_buffer("std", torch.ones(2 * self.state_dim))

    def forward(self, state: torch.Tensor, prev_state: torch.Tensor) -> torch.Tensor:
        x = (torch.cat([state, state - prev_state], -1).float() - self.mean) / self.std
        return self.bound * torch.tanh(self.net(x)).reshape(-1, self.horizon, self.action_dim)

    def config(self) -> dict:
        return {"state_dim": self.state_dim, "horizon": self.horizon, "action_dim": self.action_dim,
                "hidden": self.hidden, "bound": self.bound, "state_keys": self.state_keys}


def window_states(batch: dict, state_keys: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The last two frames of ``state_keys`` in an observation window -> ``(state (B, D), previous (B, D))`` (the
    previous is the last when the window has one frame), as the success critic reads them.

    Raises:
        ValueError: the window lacks one of ``state_keys``."""
    missing = [k for k in state_keys if k not in batch]
    if missing:
        raise ValueError(f"noise actor: the observation window lacks {missing} (state keys {list(state_keys)})")
    st = torch.cat([torch.as_tensor(batch[k]).float().flatten(2) for k in state_keys], -1)   # (B, T_obs, D)
    return st[:, -1], (st[:, -2] if st.shape[1] > 1 else st[:, -1])


class NoiseSteeredSampler:
    """The policy's ``chunk_sampler`` with a noise actor: every chunk starts from ``actor(state)`` instead of the
    noise it is given (so the chunk is a function of the observation window alone: a batched evaluation acts like
    one episode at a time). ``noise_scale`` multiplies the actor's noise as it would the random one."""

    def __init__(self, policy, actor: NoiseActor, inner=None):
        self.policy, self.actor = policy, actor
        self.inner = inner or policy.predict_action_chunk

    @torch.no_grad()
    def __call__(self, batch: dict, noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
                 noise_scale: float | torch.Tensor = 1.0, **kw) -> torch.Tensor:
        cur, prev = window_states(batch, self.actor.state_keys)
        dev = self.actor.mean.device
        w = self.actor(cur.to(dev), prev.to(dev)).cpu()
        return self.inner(batch, noise=w, noise_scale=noise_scale, **kw)


def save_noise_actor(actor: NoiseActor, directory: str | Path, record: dict | None = None) -> Path:
    """Write ``noise_actor.safetensors`` + ``noise_actor.json`` (config, and ``record``: how it was fitted) into
    ``directory``; returns the weights' path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in actor.state_dict().items()}, str(d / ACTOR_FILE))
    (d / ACTOR_CONFIG).write_text(json.dumps({"config": actor.config(), "record": record or {}}, indent=1))
    return d / ACTOR_FILE


def load_noise_actor(directory: str | Path, device: str = "cpu") -> NoiseActor | None:
    """The noise actor saved in ``directory``, or None when there is none.

    Raises:
        ValueError: one of its two files missing, or weights that do not fit its config."""
    d = Path(directory)
    have = [(d / f).exists() for f in (ACTOR_FILE, ACTOR_CONFIG)]
    if not any(have):
        return None
    if not all(have):
        raise ValueError(f"{d}: a noise actor needs both {ACTOR_FILE} and {ACTOR_CONFIG}")
    actor = NoiseActor(**json.loads((d / ACTOR_CONFIG).read_text())["config"])
    try:
        actor.load_state_dict(load_file(str(d / ACTOR_FILE)))
    except RuntimeError as e:
        raise ValueError(f"{d / ACTOR_FILE}: does not fit its config ({e})") from None
    return actor.to(device).eval()


def install_noise_actor(policy, directory: str | Path, device: str = "cpu") -> bool:
    """Load ``directory``'s noise actor (if any) and make ``policy``'s chunks start from its noise (installed
    inside any other sampler, e.g. the critic's); returns whether one was installed.

    Raises:
        ValueError: the actor reads a state key the policy does not observe, or its chunk shape differs."""
    actor = load_noise_actor(directory, device)
    if actor is None or not hasattr(policy, "chunk_sampler"):
        return False
    cfg = policy.config
    missing = [k for k in actor.state_keys if k not in getattr(cfg, "input_shapes", {})]
    if missing or (actor.horizon, actor.action_dim) != (int(cfg.horizon), int(cfg.action_dim)):
        raise ValueError(f"checkpoint {str(directory)!r}: the noise actor (state {actor.state_keys}, chunk "
                         f"{actor.horizon}x{actor.action_dim}) does not fit the policy")
    policy.chunk_sampler = NoiseSteeredSampler(policy, actor, inner=policy.chunk_sampler)
    return True




def fit_noise_actor(policy, critic, windows, indices: Sequence[int], cfg: SteerConfig,
                    progress: bool = True) -> tuple[NoiseActor, dict]:
    """Train a :class:`NoiseActor` for ``policy`` against ``critic`` at the stored states ``indices`` of
    ``windows`` (an ``experience_dict.sampler.WindowDataset`` with ``policy.window_spec()``).

    The conditioning of every state (observation tokens, AED prefix) is computed once, without gradients; each
    update runs the DDIM chain from ``actor(s)`` with the denoiser frozen and ascends the pessimistic success
    probability of the chunk's executed part. Returns ``(actor (eval mode, CPU), record)``; record:
    ``{"states", "updates", "q_start", "q_end", "q_random", "noise_rms", "per_task_q"}``: the critic's mean
    success probability of the actor's chunks before and after training, of the policy's own random-noise
    chunks at the same states, the actor's noise RMS, and per task (after / random).

    Raises:
        ValueError: no indices."""
    from tqdm.auto import tqdm

    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("fit_noise_actor: no states")
    torch.manual_seed(int(cfg.seed))
    pol_cfg = policy.config
    H, A = int(pol_cfg.horizon), int(pol_cfg.action_dim)
    steps = policy.inference_steps(cfg.num_inference_steps)
    names = set(policy.inference_window_spec())
    policy.eval().requires_grad_(False)
    critic.eval().requires_grad_(False)
    obs_l, pre_l, cur_l, prev_l, tasks = [], [], [], [], []
    for i0 in range(0, len(indices), 128):
        batch = windows.fetch(indices[i0:i0 + 128])
        inf = {k: v for k, v in batch.items() if k in names or (k.endswith("_is_pad") and k[:-7] in names)}
        cur, prev = window_states(inf, critic.state_keys)
        with torch.no_grad():
            obs, prefix = policy._conditioning(policy._to_device(policy.tokenize_history(inf)))
        obs_l.append(obs)
        pre_l.append(prefix)
        cur_l.append(cur)
        prev_l.append(prev)
        tasks += list(batch["task"])
    obs, cur, prev = torch.cat(obs_l), torch.cat(cur_l), torch.cat(prev_l)
    prefix = None if pre_l[0] is None else torch.cat(pre_l)
    N = obs.shape[0]
    actor = NoiseActor(cur.shape[1], H, A, cfg.hidden, cfg.bound, critic.state_keys)
    x = torch.cat([cur, cur - prev], -1)
    actor.mean.copy_(x.mean(0))
    actor.std.copy_(x.std(0).clamp_min(1e-3))
    opt = torch.optim.Adam(actor.net.parameters(), lr=float(cfg.lr))

    def chunks(idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return policy._denoise_chunk(obs[idx], None if prefix is None else prefix[idx], w.to(obs.dtype), steps)

    def scores(idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:        # (members, B) success probabilities
        return torch.sigmoid(critic(cur[idx], prev[idx], chunks(idx, w)))

    def mean_q(make_w) -> torch.Tensor:                                     # (N,) ensemble mean, no gradients
        out = []
        with torch.no_grad():
            for i0 in range(0, N, 256):
                idx = torch.arange(i0, min(i0 + 256, N))
                out.append(scores(idx, make_w(idx)).mean(0))
        return torch.cat(out)

    g = torch.Generator().manual_seed(int(cfg.seed) + 1)
    q_random = mean_q(lambda idx: torch.randn(len(idx), H, A, generator=g))
    q_start = mean_q(lambda idx: actor(cur[idx], prev[idx]))
    rng = np.random.default_rng(int(cfg.seed))
    bar = tqdm(range(int(cfg.updates)), desc="noise actor", disable=not progress)
    actor.train()
    for _ in bar:
        idx = torch.as_tensor(rng.choice(N, min(int(cfg.batch_size), N), replace=False))
        p = scores(idx, actor(cur[idx], prev[idx]))                         # (members, B)
        objective = p.mean(0) - float(cfg.pessimism) * p.std(0)
        loss = -objective.mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        bar.set_postfix(q=f"{float(p.detach().mean()):.3f}", refresh=False)
    actor.eval()
    q_end = mean_q(lambda idx: actor(cur[idx], prev[idx]))
    with torch.no_grad():
        rms = float(actor(cur, prev).pow(2).mean().sqrt())
    t = np.array(tasks)
    per_task = {str(k): [round(float(q_end[t == k].mean()), 4), round(float(q_random[t == k].mean()), 4)]
                for k in sorted(set(tasks))}
    rec = {"states": int(N), "updates": int(cfg.updates), "q_start": float(q_start.mean()),
           "q_end": float(q_end.mean()), "q_random": float(q_random.mean()), "noise_rms": rms,
           "noise_rms_random": 1.0, "per_task_q": per_task, "config": cfg.to_dict(),
           "bound_fraction": float(math.erf(cfg.bound / math.sqrt(2)))}
    return actor.cpu(), rec
