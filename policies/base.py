"""The policy interface: what every fleetmind policy implements, so the trainer, the fleet (worker, policy
server, learner, evaluation) and the scripts can take any of them through ``policies.factory``.

It is LeRobot's policy surface (``lerobot.policies.pretrained.PreTrainedPolicy``: ``forward``,
``predict_action_chunk``, ``select_action``, ``reset``, ``save_pretrained``/``from_pretrained``) plus the two
things fleetmind's training and serving need: ``build`` (a fresh policy from its Hydra config and the store's
episodes) and ``window_spec`` (the observation/action windows one training sample and one inference step read,
so the sampler, the policy server and deployment build the same conditioning).

:class:`Policy` is the interface (a Protocol the factory and the fleet type against); :class:`PreTrainedPolicy` is
the base class both policies subclass, implementing save, load and the action queue once.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn


@runtime_checkable
class Policy(Protocol):
    """A fleetmind policy (a ``torch.nn.Module``).

    Attributes:
        name: the ``type`` written in ``config.json`` and looked up by ``policies.factory``.
        config: a dataclass with ``to_dict()``; ``action_dim``, ``horizon`` and ``n_action_steps`` fields and
            ``input_shapes`` (``{observation feature: per-frame shape}``). A diffusion policy's config also has
            ``num_inference_steps`` / ``num_train_timesteps`` (denoising steps; the runtime may change the first).
        tokenizer: the AED action tokenizer run in the DataLoader's collate, or None.
        denoising: the policy samples its chunks from noise (a diffusion policy), and its sampling takes the
            keywords ``predict_action_chunk(batch, noise=None, generator=None, num_inference_steps=None,
            noise_scale=1.0)`` and ``select_action(obs, generator=None, generators=None, noise_scale=1.0)``
            (``generators``: one per batch row, so a row's noise does not depend on the others; ``noise_scale``:
            the temperature of the initial noise). False: they take only the batch / the observation. The fleet,
            the evaluation and the runtime read this declaration instead of inspecting signatures.
    """

    name: str
    config: Any
    tokenizer: Any
    denoising: bool

    @classmethod
    def build(cls, cfg: dict, reader, episodes) -> Policy:
        """A fresh policy from the Hydra ``policy`` node and the store (shapes, statistics over ``episodes``)."""

    def window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """``{sample name: (store key, step offsets)}`` of one training sample (``WindowDataset``); offsets
        <= 0 are what inference reads, positive offsets (the future action chunk) are the training target."""

    def inference_window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """The windows ``predict_action_chunk`` reads at one control step (offsets <= 0 from the current step):
        what the policy server and the runtime build from an observation history."""

    def forward(self, batch: dict) -> tuple[Any, dict[str, float]]:
        """Training loss (scalar tensor; honours ``sample_weight`` ``(B,)`` when given) and logged metrics."""

    def predict_action_chunk(self, batch: dict) -> Any:
        """``(B, horizon, action_dim)`` float32 actions in [-1, 1] from a batch of observation windows."""

    def select_action(self, obs: dict) -> Any:
        """One action per call, queuing the chunk's first ``n_action_steps`` actions."""

    def reset(self) -> None:
        """Forget the episode (observation history, action queue)."""

    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json`` (with ``type``), ``model.safetensors`` and JSON side files; no pickle."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str = "cpu") -> Policy:
        """Load a ``save_pretrained`` directory in eval mode; shape mismatches raise ValueError naming them."""

    def load_weights(self, path: str | Path) -> None:
        """Load a ``model.safetensors`` into this policy (training resume); mismatches raise ValueError."""

    def num_parameters(self) -> int:
        """Learned parameters."""


class PreTrainedPolicy(nn.Module):
    """The base class of fleetmind's policies: save, load and the action queue, implemented once (after LeRobot's
    ``lerobot.policies.pretrained.PreTrainedPolicy``).

    A subclass sets ``name`` (the ``type`` in ``config.json``), ``denoising`` (its declared capability, see
    :class:`Policy`) and ``REQUIRED_FILES``; implements ``_from_saved`` (build an untrained instance from a saved
    directory's ``config.json`` dict) and, where it saves more than weights, config and statistics,
    ``_save_extra``; and calls :meth:`_next_action` from its ``select_action``.

    A checkpoint directory (no pickle anywhere): ``config.json`` (``{"type": name, **config.to_dict()}``),
    ``model.safetensors`` (every tensor of ``state_dict``), ``stats.json`` (the normalisation statistics,
    ``{feature: {"mean": [...], "std": [...]}}``) and a subclass's side files.
    """

    name: str = ""
    denoising: bool = False
    CONFIG_FILE, WEIGHTS_FILE, STATS_FILE = "config.json", "model.safetensors", "stats.json"
    REQUIRED_FILES: tuple[str, ...] = (CONFIG_FILE, WEIGHTS_FILE)
    """Files ``from_pretrained`` refuses to load without."""

    config: Any
    stats: dict

    # ------------------------------------------------------------------ checkpoints
    def save_pretrained(self, directory: str | Path) -> Path:
        """Write ``config.json``, ``stats.json``, a subclass's side files and ``model.safetensors`` into
        ``directory`` (created); returns it."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        (d / self.CONFIG_FILE).write_text(json.dumps({"type": self.name, **self.config.to_dict()}, indent=2))
        (d / self.STATS_FILE).write_text(json.dumps(self.stats))
        self._save_extra(d)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(d / self.WEIGHTS_FILE))
        return d

    def _save_extra(self, directory: Path) -> None:
        """A subclass's side files (the AED policy: ``tokenizer.json``); none here."""

    @classmethod
    def from_pretrained(cls, directory: str | Path, device: str | torch.device = "cpu") -> PreTrainedPolicy:
        """Load a ``save_pretrained`` directory (no training code needed); returns the policy in eval mode on
        ``device``.

        Raises:
            FileNotFoundError: one of ``REQUIRED_FILES`` is missing.
            ValueError: the config's ``type`` is another policy's, or a weight is missing, unexpected or of the
                wrong shape (naming the tensor, the expected and the given shape).
        """
        d = Path(directory)
        for name in cls.REQUIRED_FILES:
            if not (d / name).is_file():
                raise FileNotFoundError(f"checkpoint {d} lacks {name}")
        cfg_d = json.loads((d / cls.CONFIG_FILE).read_text())
        if cfg_d.get("type", cls.name) != cls.name:
            raise ValueError(f"checkpoint {d}: config type {cfg_d.get('type')!r}, expected {cls.name!r}")
        stats_file = d / cls.STATS_FILE
        stats = json.loads(stats_file.read_text()) if stats_file.is_file() else None
        policy = cls._from_saved(d, cfg_d, stats)
        policy.load_weights(d / cls.WEIGHTS_FILE)
        return policy.to(device).eval()

    @classmethod
    def _from_saved(cls, directory: Path, cfg: dict, stats: dict | None) -> PreTrainedPolicy:
        """An untrained instance for a saved directory: its ``config.json`` dict and ``stats.json`` (None when
        absent)."""
        raise NotImplementedError(f"{cls.__name__} does not implement _from_saved")

    def load_weights(self, path: str | Path) -> None:
        """Load a ``model.safetensors`` into this policy, checking every name and shape first.

        Raises:
            ValueError: missing / unexpected tensors (listed), or a tensor of the wrong shape (its name, the
                expected and the given shape).
        """
        from safetensors.torch import load_file

        sd = load_file(str(path))
        own = self.state_dict()
        missing, unexpected = sorted(set(own) - set(sd)), sorted(set(sd) - set(own))
        if missing or unexpected:
            raise ValueError(f"checkpoint {path} does not match the model: missing tensors {missing[:10]}, "
                             f"unexpected tensors {unexpected[:10]}")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise ValueError(f"checkpoint {path}: tensor {k!r} has shape {tuple(v.shape)}, the model "
                                 f"expects {tuple(own[k].shape)}")
        self.load_state_dict(sd, strict=True)

    def num_parameters(self) -> int:
        """Learned parameters."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ the action queue
    def reset(self) -> None:
        """Forget the episode: empty the action queue (a subclass also clears its observation history)."""
        self._queue: deque = deque()

    def _next_action(self, make_chunk: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The next queued action, ``(B, action_dim)``; when the queue is empty, ``make_chunk()`` first gives
        the actions to queue, ``(B, n_action_steps, action_dim)`` (Diffusion Policy's receding horizon: the
        chunk's first ``n_action_steps`` actions are executed, then the policy plans again)."""
        if not self._queue:
            self._queue.extend(make_chunk().transpose(0, 1))
        return self._queue.popleft()
