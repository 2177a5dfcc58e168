"""Fitting FERT's success critic on the store: every committed episode, successes and failures, retries included.

The critic itself (:class:`policies.critic.SuccessCritic`, its files and :class:`policies.critic.CriticGuidedSampler`)
is model code and lives with the policies; fitting it on the fleet's experience is FERT's (the learner calls
:func:`fit_critic` every round, ``fert.critic``: :class:`fleet.fert.config.CriticConfig`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from fleet.fert.config import CriticConfig
from policies.critic import CriticFeatures, SuccessCritic


def success_targets(length: int, success: bool, steps_after_success: int, gamma: float) -> np.ndarray:
    """The critic's target per step of one episode, (length,) float32 in [0, 1].

    A successful episode ran ``steps_after_success`` steps past its first success (``task.steps_after_success``),
    so its success step is ``t_s = max(length - steps_after_success, 0)`` and step ``t`` gets
    ``gamma ** max(t_s - t, 0)``; every step of a failed episode gets 0 (a Monte-Carlo return of the reward
    "1 at the first success").

    Raises:
        ValueError: ``length < 1`` or ``gamma`` outside (0, 1].
    """
    if int(length) < 1 or not 0.0 < float(gamma) <= 1.0:
        raise ValueError(f"success_targets: expected length >= 1 and gamma in (0, 1], given {length}, {gamma}")
    if not success:
        return np.zeros(int(length), np.float32)
    t_s = max(int(length) - int(steps_after_success), 0)
    return (float(gamma) ** np.maximum(t_s - np.arange(int(length)), 0)).astype(np.float32)


def critic_arrays(reader, episodes: Sequence, state_keys: Sequence[str], chunk_steps: int,
                  steps_after_success: int, gamma: float,
                  features: CriticFeatures | None = None) -> dict[str, np.ndarray]:
    """Training rows of every step of ``episodes`` (``EpisodeMeta`` of ``reader``, an ``ExperienceStore``).

    The state of a step is ``features`` of its frame (:class:`policies.critic.CriticFeatures`: the state vectors,
    then each camera through the frozen image encoder, 256 frames per call), or ``state_keys`` concatenated.

    Returns:
        ``{"state": (N, D), "prev_state": (N, D), "chunk": (N, n, A), "target": (N,), "episode": (N,) int64}``,
        float32 but ``episode`` (the index into ``episodes``). The chunk at ``t`` is the executed ``a_{t:t+n}``,
        the last action repeated past the episode's end; ``prev_state`` at ``t = 0`` is the state itself.

    Raises:
        ValueError: no episodes, or a state key the store lacks.
    """
    if not episodes:
        raise ValueError("critic_arrays: no episodes to fit the critic on")
    features = features if features is not None else CriticFeatures(state_keys)
    missing = [k for k in features.keys if k not in reader.keys]
    if missing:
        raise ValueError(f"critic_arrays: the store lacks state keys {missing}; it has {reader.keys}")
    out: dict[str, list] = {k: [] for k in ("state", "prev_state", "chunk", "target", "episode")}
    for i, m in enumerate(episodes):
        d = reader.load_episode(m.episode_id, keys=[*features.keys, "action"])
        n = len(d["action"])
        s = np.concatenate([features({k: np.asarray(d[k][j:j + 256]) for k in features.keys}).numpy()
                            for j in range(0, n, 256)] or [np.zeros((0, 0), np.float32)], 0).astype(np.float32)
        a = np.asarray(d["action"], np.float32)
        T = len(a)
        if T == 0:
            continue
        idx = np.minimum(np.arange(T)[:, None] + np.arange(int(chunk_steps))[None], T - 1)
        out["state"].append(s)
        out["prev_state"].append(np.concatenate([s[:1], s[:-1]]))
        out["chunk"].append(a[idx])
        out["target"].append(success_targets(T, bool(m.success), steps_after_success, gamma))
        out["episode"].append(np.full(T, i, np.int64))
    return {k: np.concatenate(v) for k, v in out.items()}


def fit_critic(reader, episodes: Sequence, state_keys: Sequence[str], action_dim: int, chunk_steps: int,
               steps_after_success: int, cfg: dict | None = None, seed: int = 0,
               device: str = "cpu", features: CriticFeatures | None = None) -> tuple[SuccessCritic, dict]:
    """Fit a :class:`SuccessCritic` on every step of ``episodes`` (successes and failures).

    ``features``: what the critic sees of a frame (:class:`policies.critic.CriticFeatures`, e.g. the policy's state
    vectors and its cameras through a frozen copy of its image encoder; default: ``state_keys`` alone); the
    critic ships with it (its ``frame``), so whoever loads the critic scores the same features.

    Binary cross-entropy on the soft target :func:`success_targets`; AdamW; each ensemble member draws its own
    minibatch (bootstrap). ``cfg``: ``fert.critic``, a :class:`fleet.fert.config.CriticConfig` or a
    mapping of its keys (a key left out takes its default). A fraction ``val_fraction`` of
    the episodes (every ``1/val_fraction``-th) is held out for the reported validation loss only.

    Returns:
        ``(critic in eval mode, record)``; record: ``{"episodes", "steps", "positive_share", "train_loss",
        "val_loss", "val_loss_constant", "members", "updates"}`` (``val_loss_constant``: the validation BCE of
        predicting the training rows' mean target everywhere, the level a critic that ignores its input reaches;
        the validation rows are whole held-out episodes, so this measures generalisation across episodes, not the
        ranking of chunks at one state that the sampler uses).

    Raises:
        ValueError: as :func:`critic_arrays`, or a bad ``cfg`` value (``configs.rules.ConfigError``).
    """
    c = CriticConfig.from_dict(cfg).to_dict()
    if not float(c["val_fraction"]) < 1.0:
        raise ValueError(f"fit_critic: expected fert.critic.val_fraction < 1, given {c['val_fraction']}")
    features = features if features is not None else CriticFeatures(state_keys)
    data = critic_arrays(reader, episodes, state_keys, chunk_steps, steps_after_success, float(c["gamma"]),
                         features=features)
    g = torch.Generator().manual_seed(int(seed))
    torch.manual_seed(int(seed))
    every = round(1.0 / float(c["val_fraction"])) if float(c["val_fraction"]) > 0 else 0
    val = (data["episode"] % every == every - 1) if every > 1 else np.zeros(len(data["target"]), bool)
    if val.all():
        val[:] = False
    S, P, A, Y = (torch.as_tensor(data[k]).to(device) for k in ("state", "prev_state", "chunk", "target"))
    critic = SuccessCritic(S.shape[1], int(action_dim), int(chunk_steps), int(c["members"]), int(c["hidden"]),
                           float(c["dropout"]), **features.spec())
    critic.frame.load_state_dict(features.state_dict())
    critic = critic.to(device)
    tr = torch.as_tensor(~val, device=S.device)
    with torch.no_grad():
        x = critic.raw_features(S[tr], P[tr], A[tr])
        critic.mean.copy_(x.mean(0))
        critic.std.copy_(x.std(0) + 1e-3)
    critic.train()
    opt = torch.optim.AdamW(critic.parameters(), lr=float(c["lr"]), weight_decay=float(c["weight_decay"]))
    idx = torch.nonzero(tr).squeeze(1).cpu()
    bce = nn.BCEWithLogitsLoss()
    loss = torch.tensor(float("nan"))
    for _ in range(int(c["updates"])):
        b = idx[torch.randint(len(idx), (critic.members, int(c["batch_size"])), generator=g)].to(S.device)
        logits = torch.stack([net(critic.features(S[b[k]], P[b[k]], A[b[k]])).squeeze(-1)
                              for k, net in enumerate(critic.nets)])
        loss = bce(logits, Y[b])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    critic.eval()
    val_loss = val_const = None
    if val.any():
        v = ~tr
        Sv, Pv, Av, Yv = S[v], P[v], A[v], Y[v]
        p = torch.cat([critic.success_probability(Sv[i:i + 4096], Pv[i:i + 4096], Av[i:i + 4096])
                       for i in range(0, len(Yv), 4096)])
        val_loss = float(nn.functional.binary_cross_entropy(p.clamp(1e-6, 1 - 1e-6), Yv))
        const = Y[tr].mean().clamp(1e-6, 1 - 1e-6).expand(len(Yv))
        val_const = float(nn.functional.binary_cross_entropy(const, Yv))
    rec = {"episodes": len(episodes), "steps": len(Y), "positive_share": float((Y > 0).float().mean()),
           "train_loss": float(loss.detach()), "val_loss": val_loss,
           "val_loss_constant": val_const, "members": critic.members, "updates": int(c["updates"])}
    return critic, rec
