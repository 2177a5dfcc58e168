"""The one deployment-side history: the observation and action windows a policy conditions on, built step by
step while acting, the same way ``experience_dict.sampler.WindowDataset`` builds them from a stored episode.

Used by ``AEDDiffusionPolicy.select_action`` (local inference, fleet workers, evaluation, the lean runtime,
deployment) and by ``fleet.acting.ChunkQueuePolicy`` (the worker side of the batched policy server), so one
padding rule serves training and every way of acting. ``tests/test_policy.py`` checks it against the sampler on a
stored episode, first steps included.

Padding rule (the sampler's edge padding): an observation window reaching before the episode start repeats the
first frame; an action window repeats the first executed action (zeros before any action was taken); either way
the step is flagged in ``<name>_is_pad``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence

import torch


class WindowHistory:
    """Inference windows of a batch of B episodes that advance together.

    Args:
        spec: a policy's window spec ``{name: (store key, offsets)}``; windows reaching into the future (any
            offset > 0: the training target) are dropped. ``"action"`` keys read the executed actions, where
            offset -1 is the last action taken; other keys read observations, offset 0 the current one.
        action_dim: A, for the zero action before any was taken.

    Usage per control step: ``push_obs(obs)``; ``batch()`` when a new chunk is needed; ``push_action(a)`` with
    the action executed.
    """

    def __init__(self, spec: Mapping[str, tuple[str, Sequence[int]]], action_dim: int):
        self.spec = {n: (k, [int(o) for o in offs]) for n, (k, offs) in spec.items() if max(offs) <= 0}
        self.action_dim = int(action_dim)
        obs_back = [-min(o) for k, o in self.spec.values() if k != "action"]
        act_back = [-min(o) for k, o in self.spec.values() if k == "action"]
        self._obs_len = max(obs_back, default=0) + 1
        self._act_len = max(act_back, default=1)
        self.reset()

    def reset(self) -> None:
        """Forget the episodes (call at every episode start)."""
        self.frames: deque[dict[str, torch.Tensor]] = deque(maxlen=self._obs_len)
        self.actions: deque[torch.Tensor] = deque(maxlen=self._act_len)
        self._seen_obs = self._seen_act = 0

    def push_obs(self, obs: Mapping[str, torch.Tensor]) -> None:
        """The current observations ``{key: (B, ...) tensor}``."""
        self.frames.append(dict(obs))
        self._seen_obs += 1

    def push_action(self, action: torch.Tensor) -> None:
        """The executed actions ``(B, A)``."""
        self.actions.append(action)
        self._seen_act += 1

    def batch(self) -> dict[str, torch.Tensor]:
        """``{name: (B, T, ...), name_is_pad: (B, T) bool}`` for every window of the spec.

        Raises:
            ValueError: no observation pushed yet. KeyError: a window's observation key missing from the
                pushed observations (names the window and what was given).
        """
        if not self.frames:
            raise ValueError("WindowHistory.batch: push an observation first")
        cur = self.frames[-1]
        B = next(iter(cur.values())).shape[0]
        out: dict[str, torch.Tensor] = {}
        for name, (key, offsets) in self.spec.items():
            if key == "action":
                seq, now = list(self.actions), self._seen_act           # offset -1: the last action taken
                # a step before the start exists only while every action taken is still held: seq[0] is the first
                fill = seq[0] if seq else torch.zeros(B, self.action_dim, dtype=torch.float32)
                base = now - len(seq)                                     # step of seq[0]
            else:
                if key not in cur:
                    raise KeyError(f"policy window {name!r} needs observation {key!r}; given {sorted(cur)}")
                seq, now = [f[key] for f in self.frames], self._seen_obs - 1
                fill, base = seq[0], self._seen_obs - len(seq)
            rows, pad = [], []
            for o in offsets:
                i = now + o                                               # absolute step of this frame
                pad.append(i < 0)
                rows.append(seq[i - base] if i >= 0 else fill)
            out[name] = torch.stack(rows, 1)
            out[f"{name}_is_pad"] = torch.tensor(pad).expand(B, len(offsets))
        return out
