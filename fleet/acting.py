"""Acting policies for fleet workers: the scripted expert, a random policy, or a trained checkpoint.

Every acting policy has the same small surface the worker drives, one control step at a time:

    policy.version: int                     # recorded with every episode (see the constants below)
    policy.reset()                          # at the start of each episode (clears action-chunk queues)
    action = policy.select_action(obs)      # obs: dict[str, np.ndarray] (feature names of INTERFACES.md),
                                            # action: (action_dim,) float32 in [-1, 1]

Policy versions recorded in the store: registry versions are 1, 2, 3 ...; the non-learned policies use
negative constants (``EXPERT_VERSION = -1``, ``RANDOM_VERSION = -2``) and a checkpoint loaded from a plain
directory with no registry manifest records ``UNVERSIONED = 0``.

Trained policies implement ``policies.base.Policy`` and load through ``policies.factory.load_policy`` (any
registered type: the AED diffusion policy, the MLP chunk policy): the action chunk is executed over several
steps by the policy's own ``select_action`` queue (local inference) or by ``ChunkQueuePolicy`` here
(policy-server inference).
"""

from __future__ import annotations

import time
from collections import deque
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
def load_checkpoint(path: str | Path, device: str = "cpu", with_critic: bool = True) -> tuple[Any, int]:
    """Load a saved policy directory; returns ``(model in eval mode on device, policy version)``.

    The class comes from ``config.json``'s ``"type"`` (``policies.factory``; a config without one is taken as
    ``aed_diffusion``). When the directory holds a registry ``MANIFEST.json`` every file is first verified
    against it (``fleet.registry.verify_checkpoint_dir``) and the version comes from it; otherwise the version
    is ``UNVERSIONED`` (0). A success critic saved beside the weights (``critic.safetensors``, FERT's
    ``fert.critic``) is installed: the policy then executes, of ``candidates`` sampled chunks, the one the critic
    ranks highest (``policies.critic.CriticGuidedSampler``). ``with_critic=False`` leaves it out: the weights act
    alone (K = 1), with the version still read from the manifest. A noise actor saved beside the weights
    (``noise_actor.safetensors``, ``policies.noise_actor``: DSRL's noise steering) is part of the policy alone: every
    chunk starts from its noise (under a critic, the first candidate's).

    Raises:
        FileNotFoundError: no ``config.json`` in ``path``.
        KeyError: unknown policy type.
        ValueError: a critic or noise actor whose files are incomplete or do not fit.
        fleet.registry.ChecksumMismatchError: a file differs from the manifest.
    """
    from fleet.registry import MANIFEST, verify_checkpoint_dir
    from policies.factory import load_policy, policy_class, policy_type

    path = Path(path)
    ptype = policy_type(path)                        # FileNotFoundError without config.json
    try:
        policy_class(ptype)
    except KeyError as e:
        raise KeyError(f"checkpoint {str(path)!r}: {e.args[0]}") from None
    version = UNVERSIONED
    if (path / MANIFEST).is_file():
        version = int(verify_checkpoint_dir(path)["version"])
    from policies.critic import install_critic
    from policies.noise_actor import install_noise_actor

    model = load_policy(path, device)
    if with_critic:
        install_critic(model, path, device)
    install_noise_actor(model, path, device)   # chunks start from its noise (candidate 0's, under a critic)
    return model, version


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

    ``noise_scale`` (default 1.0): the temperature of the initial denoising noise of the chunks it samples
    (set by a failure retry's ``fleet.worker.Exploration``); a policy without denoising noise refuses any
    other value.
    """

    def __init__(self, model, version: int):
        self.model, self.version = model, version
        self.noise_scale = 1.0
        self._takes_noise_scale = bool(model.denoising)   # policies.base.Policy's declared sampling keywords

    def reset(self) -> None:
        self.model.reset()

    def select_action(self, obs: dict[str, np.ndarray]) -> np.ndarray:
        """(action_dim,) float32 action for one unbatched observation ``{name: np.ndarray}``.

        Raises:
            ValueError: ``noise_scale != 1`` for a policy whose ``select_action`` takes no ``noise_scale``.
        """
        import torch

        with torch.no_grad():
            if self.noise_scale != 1.0:
                if not self._takes_noise_scale:
                    raise ValueError(f"exploration noise_temperature={self.noise_scale}: the policy "
                                     f"{type(self.model).__name__} samples no denoising noise (use action_noise_std)")
                a = self.model.select_action(obs, noise_scale=self.noise_scale)
            else:
                a = self.model.select_action(obs)
        a = a.detach().cpu().numpy() if torch.is_tensor(a) else np.asarray(a)
        return a.reshape(-1).astype(np.float32)


def policy_input_shapes(config) -> dict[str, list[int]]:
    """``{feature: shape}`` a policy config reads: its ``input_shapes``, or ``state_keys`` with ``state_dims``
    (the state-only policies); ``{}`` when it declares neither."""
    shapes = getattr(config, "input_shapes", None)
    if shapes:
        return {str(k): [int(d) for d in v] for k, v in dict(shapes).items()}
    if hasattr(config, "state_dims"):
        return {str(k): [int(d)] for k, d in zip(config.state_keys, config.state_dims)}
    return {}


# ---------------------------------------------------------------------------------------------------- server
class ObservationHistory:
    """One episode's inference sample, step by step, for the policy server: ``policies.history.WindowHistory``
    (the one history builder, shared with ``AEDDiffusionPolicy.select_action``) over unbatched numpy arrays.

    Windows reaching into the future (the training target) are skipped; steps before the episode start repeat
    the first frame (actions: the first action, zeros before any was taken) and are flagged in
    ``<name>_is_pad`` ``(T,)`` bool, matching ``WindowDataset``'s edge padding.
    """

    def __init__(self, window_spec: dict[str, tuple[str, list[int]]], action_dim: int):
        from policies.history import WindowHistory

        self._h = WindowHistory(window_spec, action_dim)
        self.spec = self._h.spec

    def reset(self) -> None:
        self._h.reset()

    def push_obs(self, obs: dict[str, np.ndarray]) -> None:
        import torch

        self._h.push_obs({k: torch.as_tensor(np.asarray(v))[None] for k, v in obs.items()})

    def push_action(self, action: np.ndarray) -> None:
        import torch

        # a copy: the action may be a read-only view (a Ray object-store array); torch warns on a non-writable one
        self._h.push_action(torch.from_numpy(np.array(action, dtype=np.float32, copy=True))[None])

    def sample(self) -> dict[str, np.ndarray]:
        """The current step's sample: ``name -> (T, ...)`` plus ``name_is_pad -> (T,)``.

        Raises:
            KeyError: a window's observation key missing from the pushed observations.
        """
        return {k: v[0].numpy() for k, v in self._h.batch().items()}


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
        self.noise_scale = 1.0   # temperature of the initial denoising noise (fleet.worker.Exploration)

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
                    chunk = ray.get(self.server.predict_chunk.remote(sample, self.version, self.noise_scale))
                    break
                except RayActorError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            self.queue.extend(np.asarray(chunk[: self.n_action_steps], np.float32))
        a = self.queue.popleft()
        self.history.push_action(a)
        return a
