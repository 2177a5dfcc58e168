"""Acting policies for fleet workers: the scripted expert, a random policy, or a trained checkpoint.

Every acting policy has the same small surface the worker drives, one control step at a time:

    policy.version: int                     # recorded with every episode (see the constants below)
    policy.reset()                          # at the start of each episode (clears action-chunk queues)
    action = policy.select_action(obs)      # obs: dict[str, np.ndarray] (feature names of INTERFACES.md),
                                            # action: (action_dim,) float32 in [-1, 1]

Policy versions recorded in the store: registry versions are 1, 2, 3 ...; the non-learned policies use
negative constants (``EXPERT_VERSION = -1``, ``RANDOM_VERSION = -2``) and a checkpoint loaded from a plain
directory with no registry manifest records ``UNVERSIONED = 0``.

Trained policies follow the LeRobot-style contract of ``policies/`` (``from_pretrained``, ``select_action``,
``predict_action_chunk``, ``reset``): the action chunk is executed over several steps by the policy's own
``select_action`` queue (local inference) or by ``ChunkQueuePolicy`` here (policy-server inference).
``fleet.mlp_policy.MLPChunkPolicy`` is a tiny real torch policy (state -> action chunk) used for benchmarks and tests; the
fleet's learned policy is ``policies.aed_diffusion.AEDDiffusionPolicy``.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

EXPERT_VERSION = -1
RANDOM_VERSION = -2
UNVERSIONED = 0


# ---------------------------------------------------------------------------------------------------- simple
class ExpertPolicy:
    """The privileged scripted expert of one env (``sim.make_expert``; Meta-World's ``ENV_POLICY_MAP``)."""

    version = EXPERT_VERSION

    def __init__(self, env, noise_std: float = 0.0, seed: int = 0):
        from sim import make_expert

        self.expert = make_expert(env, noise_std=noise_std, seed=seed)
        self.seed = seed

    def reset(self) -> None:
        """Restart the expert's noise stream from ``self.seed`` (the worker sets it to the episode seed)."""
        self.expert.reset(self.seed)

    def select_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        return np.asarray(self.expert.act(obs), dtype=np.float32)


class RandomPolicy:
    """Uniform random actions in ``[low, high]`` (default [-1, 1]), shape ``(action_dim,)`` float32."""

    version = RANDOM_VERSION

    def __init__(self, action_dim: int = 4, low: float = -1.0, high: float = 1.0, seed: int = 0):
        self.action_dim, self.low, self.high = action_dim, low, high
        self.rng = np.random.default_rng(seed)

    def reset(self) -> None:
        pass

    def select_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        return self.rng.uniform(self.low, self.high, self.action_dim).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- loading
def _aed_cls():
    from policies.aed_diffusion import AEDDiffusionPolicy

    return AEDDiffusionPolicy


def _mlp_cls():
    from fleet.mlp_policy import MLPChunkPolicy

    return MLPChunkPolicy


# config.json "type" -> loader of the policy class (lazy: expert/random workers never import torch)
POLICY_CLASSES: dict[str, Callable[[], type]] = {
    "mlp_chunk": _mlp_cls,
    "aed_diffusion": _aed_cls,
}


def load_checkpoint(path: str | Path, device: str = "cpu") -> tuple[Any, int]:
    """Load a saved policy directory; returns ``(model in eval mode on device, policy version)``.

    The class comes from ``config.json``'s ``"type"`` (``POLICY_CLASSES``; a config without one is taken as
    ``aed_diffusion``). When the directory holds a registry ``MANIFEST.json`` every file is first verified
    against it (``fleet.registry.verify_checkpoint_dir``) and the version comes from it; otherwise the version
    is ``UNVERSIONED`` (0).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        KeyError: unknown policy type.
        fleet.registry.ChecksumMismatchError: a file differs from the manifest.
    """
    from fleet.registry import MANIFEST, verify_checkpoint_dir

    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} has no config.json")
    version = UNVERSIONED
    if (path / MANIFEST).is_file():
        version = int(verify_checkpoint_dir(path)["version"])
    ptype = json.loads(cfg_file.read_text()).get("type", "aed_diffusion")
    if ptype not in POLICY_CLASSES:
        raise KeyError(f"checkpoint {str(path)!r}: unknown policy type {ptype!r}; known: {sorted(POLICY_CLASSES)}")
    model = POLICY_CLASSES[ptype]().from_pretrained(path)
    return model.to(device).eval(), version


def resolve_device(device: str = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is visible, else ``"cpu"``; other values pass through."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


class TorchPolicy:
    """Local inference with a loaded policy module; its ``select_action`` queues the action chunk.

    Args:
        model: a policy with ``reset()`` and ``select_action(obs)`` taking one unbatched observation
            ``{name: np.ndarray}`` and returning ``(action_dim,)`` (LeRobot-style contract of ``policies/``).
        version: the policy version recorded with episodes.
    """

    def __init__(self, model, version: int):
        self.model, self.version = model, version

    def reset(self) -> None:
        self.model.reset()

    def select_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        import torch

        with torch.no_grad():
            a = self.model.select_action(obs)
        a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
        return a.reshape(-1).astype(np.float32)


# ---------------------------------------------------------------------------------------------------- server
class ObservationHistory:
    """Builds one inference sample from the steps seen so far, following a policy's ``window_spec``.

    Windows whose offsets are all ``<= 0`` are kept (the current and past observations; past actions for
    ``("action", [-k..-1])`` windows); windows reaching into the future (the training target) are skipped.
    Steps before the episode start repeat the first frame (actions: the first action, zeros before any was
    taken) and are flagged in ``<name>_is_pad`` ``(T,)`` bool, matching ``WindowDataset``'s edge padding and
    ``AEDDiffusionPolicy.select_action``'s deployment windows.
    """

    def __init__(self, window_spec: dict[str, tuple[str, list[int]]], action_dim: int):
        self.spec = {n: (k, list(o)) for n, (k, o) in window_spec.items() if max(o) <= 0}
        self.action_dim = action_dim
        self.reset()

    def reset(self) -> None:
        self.frames: dict[str, list[np.ndarray]] = {}
        self.actions: list[np.ndarray] = []

    def push_obs(self, obs: dict[str, np.ndarray]) -> None:
        for k, v in obs.items():
            self.frames.setdefault(k, []).append(np.asarray(v))

    def push_action(self, action: np.ndarray) -> None:
        self.actions.append(np.asarray(action, dtype=np.float32))

    def sample(self) -> dict[str, np.ndarray]:
        """The current step's sample: ``name -> (T, ...)`` plus ``name_is_pad -> (T,)``."""
        out: dict[str, np.ndarray] = {}
        for name, (key, offsets) in self.spec.items():
            if key == "action":
                seq, t_now = self.actions, len(self.actions)  # offset -1 is the last action taken
                fill = seq[0] if seq else np.zeros(self.action_dim, np.float32)
            else:
                if key not in self.frames:
                    raise KeyError(f"policy window {name!r} needs observation {key!r}; env gives {sorted(self.frames)}")
                seq, t_now = self.frames[key], len(self.frames[key]) - 1
                fill = seq[0]
            vals, pad = [], []
            for o in offsets:
                i = t_now + o
                ok = 0 <= i < len(seq)
                pad.append(not ok)
                vals.append(seq[i] if ok else fill)
            out[name] = np.stack(vals)
            out[f"{name}_is_pad"] = np.asarray(pad)
        return out


class ChunkQueuePolicy:
    """Acting policy backed by a ``PolicyServer`` actor: requests an action chunk when its queue is empty
    and executes its first ``n_action_steps`` actions, one per step.

    Args:
        server: ``PolicyServer`` actor handle.
        version: the registry version to request (fixed for the episode; the server loads it on demand).
        window_spec, n_action_steps, action_dim: from ``server.info``.
        retry_s: how long to keep retrying while the server is restarting (``RayActorError``).
    """

    def __init__(self, server, version: int, window_spec: dict, n_action_steps: int, action_dim: int,
                 retry_s: float = 60.0):
        self.server, self.version = server, version
        self.history = ObservationHistory(window_spec, action_dim)
        self.n_action_steps, self.action_dim, self.retry_s = n_action_steps, action_dim, retry_s
        self.queue: deque[np.ndarray] = deque()
        self._zero_action = np.zeros(action_dim, np.float32)

    def reset(self) -> None:
        self.history.reset()
        self.queue.clear()

    def select_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        import ray
        from ray.exceptions import RayActorError

        self.history.push_obs(obs)
        if not self.queue:
            sample = self.history.sample()
            deadline = time.monotonic() + self.retry_s
            while True:
                try:
                    chunk = ray.get(self.server.predict_chunk.remote(sample, self.version))
                    break
                except RayActorError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self.queue.extend(np.asarray(chunk[: self.n_action_steps], np.float32))
        a = self.queue.popleft()
        self.history.push_action(a)
        return a
