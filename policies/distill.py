"""Critic distillation: the success critic's choices become the policy's own supervision.

A success critic (``policies.critic``) steers a diffusion policy at run time by sampling K chunks and executing the
one it ranks highest; the gain then lives in the sampling, not in the weights, and a robot that runs the policy
alone (K = 1, the ONNX runtime) gets none of it. PA-RL (Mark et al., "Policy Agnostic RL: Offline RL and Online RL
Fine-Tuning of Any Class and Backbone", 2024) moves the gain into the weights: at the states of the replay data,
sample candidate actions from the policy, keep the one the critic ranks best ("global optimization"), and train the
policy to reproduce it by its own supervised loss. Repeated every round, the policy climbs the critic, and the
critic refits on the data the better policy collects.

:func:`critic_targets` does the relabelling on stored windows; :class:`ChunkTargets` holds the result as a
training dataset the policy's ``forward`` reads like any ``experience_dict.sampler.WindowDataset`` batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

META_KEYS = ("episode_index", "step", "task", "unit_id")


class ChunkTargets(Dataset):
    """Windows held in memory whose ``action`` target is a chosen chunk (:func:`critic_targets`).

    Args:
        tensors: ``{name: (N, ...) tensor}``: the policy's training windows (``policy.window_spec()`` names and
            their ``_is_pad`` flags) with ``action`` (N, horizon, A) float32 replaced by the chosen chunks.
        tasks: (N,) the task of each window (for per-task counts).

    Item ``i``: ``{name: tensor[i]}`` plus ``sample_weight`` (1.0). ``ds[[i, j, ...]]`` (or :meth:`fetch`): a
    collated batch, so ``policies.aed_diffusion.training.train_policy`` reads it without per-item collation.

    Raises:
        ValueError: tensors of different lengths, or no ``action``.
    """

    def __init__(self, tensors: dict[str, torch.Tensor], tasks: Sequence[str]):
        n = {len(v) for v in tensors.values()}
        if len(n) != 1 or "action" not in tensors or len(tasks) != next(iter(n)):
            raise ValueError(f"ChunkTargets: expected equal-length tensors with 'action' and one task per window, "
                             f"given lengths {sorted(n)} for {sorted(tensors)} and {len(tasks)} tasks")
        self.tensors, self.tasks = tensors, list(tasks)

    def __len__(self) -> int:
        return len(self.tasks)

    def fetch(self, indices: Sequence[int]) -> dict:
        """Collated batch ``{name: (B, ...)}`` plus ``sample_weight`` (B,) float32 ones."""
        idx = torch.as_tensor(np.asarray(indices, np.int64).reshape(-1))
        out = {k: v[idx] for k, v in self.tensors.items()}
        out["sample_weight"] = torch.ones(len(idx))
        return out

    def __getitem__(self, i):
        if isinstance(i, (int, np.integer)):
            return {k: v[0] for k, v in self.fetch([int(i)]).items()}
        return self.fetch(i)

    def task_counts(self) -> dict[str, int]:
        """``{task: windows}``."""
        out: dict[str, int] = {}
        for t in self.tasks:
            out[t] = out.get(t, 0) + 1
        return out


@torch.no_grad()
def critic_targets(policy, critic, windows, indices: Sequence[int], candidates: int, seed: int = 0,
                   batch_size: int = 128) -> tuple[ChunkTargets, dict]:
    """Relabel stored windows with the chunk the critic ranks best among ``candidates`` sampled by ``policy``.

    For each window (an anchor step of a stored episode, read with the policy's own window spec), the policy
    samples K chunks from its denoiser at that state (its observation window and executed action history), the
    critic scores each one's executed part, and the best becomes the window's ``action`` target
    (``policies.critic.CriticGuidedSampler``: candidate 0 from the window's own noise, the others from noise seeded
    by it). The future frames the motion-aware transition loss reads belong to the stored actions, not the chosen
    chunk, so they are flagged as padding (that loss skips them).

    Args:
        policy: an AED diffusion policy (eval mode; ``window_spec``, ``inference_window_spec``, ``config.horizon``,
            ``config.action_dim``). critic: a ``policies.critic.SuccessCritic``.
        windows: an ``experience_dict.sampler.WindowDataset`` built with ``policy.window_spec()``.
        indices: the windows to relabel (indices into ``windows``).
        candidates: K >= 2 chunks per state.
        seed: the initial noise of batch ``b`` comes from a generator seeded with ``(seed, b)``.
        batch_size: states per batched call (K x this chunks per call).

    Returns:
        ``(ChunkTargets, record)``; record: ``{"states", "candidates", "q_chosen", "q_own", "q_gap", "picked_own",
        "per_task": {task: states}}`` (mean critic scores of the chosen chunk and of candidate 0, the policy's own
        sample; ``picked_own``: the share of states where candidate 0 won).

    Raises:
        ValueError: ``candidates < 2`` or no indices.
    """
    sampled = sample_candidates(policy, windows, indices, candidates, critic.state_keys, seed, batch_size,
                                features=critic.frame)
    return choose_targets(critic, sampled)


def sample_candidates(policy, windows, indices: Sequence[int], candidates: int, state_keys: Sequence[str],
                      seed: int = 0, batch_size: int = 128, features=None) -> list[dict]:
    """:func:`critic_targets`' first half, which needs no critic: the policy's ``candidates`` chunks at each window
    (the same noise as :func:`critic_targets`), so that a learner can sample them while its critic is still being
    fitted. Returns one ``{"batch", "chunks" (B, K, horizon, A), "state" (B, D), "prev_state" (B, D)}`` per batch
    of ``batch_size`` windows, for :func:`choose_targets`. ``features``: a ``policies.critic.CriticFeatures`` for
    the states (what the critic that will rank them sees; default ``state_keys`` concatenated).

    Raises:
        ValueError: ``candidates < 2``, no indices, or a window without one of ``state_keys``.
    """
    from policies.critic import CriticGuidedSampler

    if int(candidates) < 2:
        raise ValueError(f"critic_targets: candidates must be >= 2 (1 would relabel nothing), given {candidates}")
    indices = [int(i) for i in indices]
    if not indices:
        raise ValueError("critic_targets: no windows to relabel")
    cfg = policy.config
    H, A = int(cfg.horizon), int(cfg.action_dim)
    names = set(policy.inference_window_spec())
    keys = None if features is not None else state_keys   # the features name their own keys
    sampler = CriticGuidedSampler(policy, None, int(candidates), state_keys=keys, features=features)
    out = []
    for b, i0 in enumerate(range(0, len(indices), int(batch_size))):
        batch = windows.fetch(indices[i0:i0 + int(batch_size)])
        B = len(batch["task"])
        inf = {k: v for k, v in batch.items() if k in names or (k.endswith("_is_pad") and k[:-7] in names)}
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([int(seed), b]).generate_state(1)[0]))
        with torch.no_grad():
            chunks, cur, prev = sampler.candidate_chunks(inf, noise=torch.randn(B, H, A, generator=g))
        out.append({"batch": batch, "chunks": chunks, "state": cur, "prev_state": prev})
    return out


def choose_targets(critic, sampled: list[dict]) -> tuple[ChunkTargets, dict]:
    """:func:`critic_targets`' second half: in each of :func:`sample_candidates`' batches the chunk ``critic``
    ranks best becomes the window's ``action`` target (the MT loss's future frames flagged as padding). Returns
    ``(ChunkTargets, record)`` as :func:`critic_targets`.

    Raises:
        ValueError: nothing sampled."""
    from policies.critic import CriticGuidedSampler

    if not sampled:
        raise ValueError("choose_targets: no sampled windows")
    K = int(sampled[0]["chunks"].shape[1])
    H = int(sampled[0]["chunks"].shape[2])
    chooser = CriticGuidedSampler(None, critic, K)
    parts: dict[str, list[torch.Tensor]] = {}
    tasks: list[str] = []
    q_chosen, q_own = [], []
    for part in sampled:
        batch = dict(part["batch"])
        B = len(batch["task"])
        with torch.no_grad():
            chunk = chooser.choose(part["chunks"], part["state"], part["prev_state"])
        q = chooser.last_scores                        # (B, K)
        q_chosen.append(q.max(1).values)
        q_own.append(q[:, 0])
        batch["action"] = chunk.float().cpu()
        batch["action_is_pad"] = torch.zeros(B, H, dtype=torch.bool)
        for k in list(batch):
            if k.startswith("future.") and k.endswith("_is_pad"):
                batch[k] = torch.ones_like(batch[k])
        tasks += list(batch["task"])
        for k, v in batch.items():
            if k not in META_KEYS:
                parts.setdefault(k, []).append(v)
    data = ChunkTargets({k: torch.cat(v) for k, v in parts.items()}, tasks)
    qc, qo = torch.cat(q_chosen), torch.cat(q_own)
    rec = {"states": len(data), "candidates": K, "q_chosen": float(qc.mean()), "q_own": float(qo.mean()),
           "q_gap": float((qc - qo).mean()), "picked_own": chooser.picked_own / max(chooser.decisions, 1),
           "per_task": data.task_counts()}
    return data, rec


def balanced_anchors(windows, per_task: int, seed: int = 0) -> list[int]:
    """Up to ``per_task`` window indices of each task of a ``WindowDataset``, drawn uniformly without replacement
    over that task's steps (every task gets the same number of states when it has them), in sorted order.

    Raises:
        ValueError: ``per_task < 1``.
    """
    if int(per_task) < 1:
        raise ValueError(f"balanced_anchors: per_task must be >= 1, given {per_task}")
    rng = np.random.default_rng(int(seed))
    task_of_ep = np.array([e.task for e in windows.episodes])
    ep = np.searchsorted(windows.cum, np.arange(len(windows)), side="right") - 1
    out = []
    for t in sorted(set(task_of_ep)):
        idx = np.flatnonzero(task_of_ep[ep] == t)
        out += rng.choice(idx, min(int(per_task), len(idx)), replace=False).tolist()
    return sorted(int(i) for i in out)
