"""A small real torch policy (normalised state -> action chunk, MSE regression).

The fleet's learned policy is ``policies.aed_diffusion.AEDDiffusionPolicy``; this one implements the same
interface (``policies.base.Policy``: ``build``, ``window_spec``, ``forward``, ``predict_action_chunk``,
``select_action``, ``reset``, ``save_pretrained``/``from_pretrained`` with safetensors + JSON) and is made and
loaded through ``policies.factory`` (``type: mlp_chunk``; ``scripts/train.py policy=mlp_chunk``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from policies.base import PreTrainedPolicy


@dataclass
class MLPChunkConfig:
    """Hyperparameters of ``MLPChunkPolicy`` (a small, real state -> action-chunk regressor).

    ``state_keys`` are concatenated (feature names of INTERFACES.md); ``horizon`` actions are predicted per
    chunk, the first ``n_action_steps`` are executed (Diffusion Policy's receding horizon, Chi et al. 2023).
    """

    type: str = "mlp_chunk"
    state_keys: list[str] = field(default_factory=lambda: ["observation.state", "observation.environment_state"])
    state_dims: list[int] = field(default_factory=lambda: [4, 17])
    action_dim: int = 4
    horizon: int = 16
    n_action_steps: int = 8
    hidden_dim: int = 256
    n_layers: int = 3

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """Observation features read, ``{name: per-frame shape}`` (as ``AEDDiffusionConfig.input_shapes``)."""
        return {k: [int(d)] for k, d in zip(self.state_keys, self.state_dims)}

    def __post_init__(self):
        if len(self.state_keys) != len(self.state_dims):
            raise ValueError(
                f"MLPChunkConfig: state_keys ({len(self.state_keys)}) and state_dims ({len(self.state_dims)}) "
                "must have the same length"
            )
        if not 1 <= self.n_action_steps <= self.horizon:
            raise ValueError(f"MLPChunkConfig: need 1 <= n_action_steps <= horizon, got {self.n_action_steps}, "
                             f"{self.horizon}")


class MLPChunkPolicy(PreTrainedPolicy):
    """A tiny torch policy: normalised state -> ``(horizon, action_dim)`` action chunk (MSE regression).

    Batch format (``WindowDataset`` / LeRobot style): ``batch[k]`` is ``(B, 1, D_k)`` or ``(B, D_k)`` float32 for
    each ``k`` in ``config.state_keys``; training also needs ``batch["action"]`` ``(B, horizon, action_dim)``.
    ``stats`` maps feature name -> ``{"mean": [...], "std": [...]}`` (``ExperienceStore.stats`` output);
    missing stats mean identity normalisation. Saved as ``model.safetensors`` + ``config.json`` +
    ``stats.json`` (no pickle).
    """

    name = "mlp_chunk"
    denoising = False  # a regressor: no noise, generator or denoising steps (policies.base.Policy)

    def __init__(self, config: MLPChunkConfig, stats: dict[str, dict[str, list[float]]] | None = None):
        super().__init__()
        self.config = config
        in_dim = sum(config.state_dims)
        layers, d = [], in_dim
        for _ in range(config.n_layers - 1):
            layers += [nn.Linear(d, config.hidden_dim), nn.GELU()]
            d = config.hidden_dim
        layers.append(nn.Linear(d, config.horizon * config.action_dim))
        self.net = nn.Sequential(*layers)
        self.stats = stats or {}
        mean, std = [], []
        for k, n in zip(config.state_keys, config.state_dims):
            s = self.stats.get(k, {})
            mean += list(s.get("mean", [0.0] * n))
            std += list(s.get("std", [1.0] * n))
        self.register_buffer("in_mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("in_std", torch.tensor(std, dtype=torch.float32).clamp_min(1e-6))
        self.reset()
        self.tokenizer = None   # no action-history tokens (policies.base.Policy)

    @classmethod
    def build(cls, cfg: dict, reader, episodes) -> MLPChunkPolicy:
        """A fresh policy for the Hydra ``policy`` node ``cfg`` (keys of ``MLPChunkConfig`` plus ``input_keys``:
        null for every non-image ``observation.*`` key of the store), with state statistics over ``episodes``.

        Raises:
            ValueError: an unknown config key, or an input key the store lacks.
        """
        cfg = {k: v for k, v in dict(cfg).items() if k not in ("type", "images")}
        keys = cfg.pop("input_keys", None)
        feats = {k: list(v["shape"]) for k, v in reader.features.items() if k.startswith("observation.")}
        if keys is None:
            keys = [k for k, shp in feats.items() if len(shp) == 1]
        missing = [k for k in keys if k not in feats]
        if missing:
            raise ValueError(f"policy.input_keys: the store lacks {missing} (has {sorted(feats)})")
        known = set(MLPChunkConfig.__dataclass_fields__) - {"type", "state_keys", "state_dims"}
        unknown = sorted(set(cfg) - known)
        if unknown:
            raise ValueError(f"policy (mlp_chunk): unknown keys {unknown}; known: {sorted(known)} and input_keys")
        config = MLPChunkConfig(state_keys=list(keys), state_dims=[int(feats[k][0]) for k in keys], **cfg)
        return cls(config, reader.stats(list(keys), episodes=episodes))

    def window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """Windows a ``WindowDataset`` must produce for training (current state, future action chunk)."""
        spec = {k: (k, [0]) for k in self.config.state_keys}
        spec["action"] = ("action", list(range(self.config.horizon)))
        return spec

    def inference_window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """What one inference step reads: the current frame of each state key (no history, no past actions)."""
        return {k: (k, [0]) for k in self.config.state_keys}

    def _inputs(self, batch: dict[str, Any]) -> torch.Tensor:
        xs = []
        for k, n in zip(self.config.state_keys, self.config.state_dims):
            if k not in batch:
                raise KeyError(f"MLPChunkPolicy: batch lacks {k!r} (have {sorted(batch)})")
            x = torch.as_tensor(batch[k], dtype=torch.float32, device=self.in_mean.device)
            if x.ndim == 3:  # (B, T, D): the newest frame
                x = x[:, -1]
            if x.shape[-1] != n:
                raise ValueError(f"MLPChunkPolicy: {k!r} has {x.shape[-1]} dims, config says {n}")
            xs.append(x)
        return (torch.cat(xs, -1) - self.in_mean) / self.in_std

    def forward(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """MSE between predicted and target action chunks, padded steps (``action_is_pad``) left out, each
        sample weighted by ``sample_weight`` ``(B,)`` when given (FERT's retrieval weights); returns
        ``(loss, {"loss": float})``."""
        pred = self.predict_action_chunk(batch)
        target = torch.as_tensor(batch["action"], dtype=torch.float32, device=pred.device)
        err = (pred - target).pow(2).mean(-1)                                   # (B, horizon)
        pad = batch.get("action_is_pad")
        keep = (~torch.as_tensor(pad, device=pred.device).bool()).float() if pad is not None else torch.ones_like(err)
        per = (err * keep).sum(-1) / keep.sum(-1).clamp_min(1.0)                # (B,)
        w = batch.get("sample_weight")
        w = torch.as_tensor(w, dtype=torch.float32, device=pred.device) if w is not None else torch.ones_like(per)
        loss = (per * w).sum() / w.sum().clamp_min(1e-8)
        return loss, {"loss": loss.item()}

    def predict_action_chunk(self, batch: dict[str, Any]) -> torch.Tensor:
        """``(B, horizon, action_dim)`` float32 actions, clipped to [-1, 1] at inference."""
        out = self.net(self._inputs(batch)).view(-1, self.config.horizon, self.config.action_dim)
        return out if self.training else out.clamp(-1.0, 1.0)

    @torch.no_grad()
    def select_action(self, obs: dict[str, Any]):
        """One action from one step's observations: ``{name: (B, D) tensor}`` -> ``(B, action_dim)`` tensor, or
        ``{name: (D,) np.ndarray}`` -> ``(action_dim,)`` float32 array. Re-plans every ``n_action_steps`` steps."""
        unbatched = all(isinstance(v, np.ndarray) for v in obs.values())
        if unbatched:
            obs = {k: torch.as_tensor(obs[k]).unsqueeze(0) for k in self.config.state_keys if k in obs}
        a = self._next_action(lambda: self.predict_action_chunk(obs)[:, : self.config.n_action_steps])  # (B, A)
        return a[0].cpu().numpy().astype(np.float32) if unbatched else a

    @classmethod
    def _from_saved(cls, directory: Path, cfg: dict, stats: dict | None) -> MLPChunkPolicy:
        """The untrained policy of a checkpoint (``from_pretrained`` checks its files, type and weights)."""
        return cls(MLPChunkConfig(**cfg), stats)

