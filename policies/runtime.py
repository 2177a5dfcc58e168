"""Lean deployment runtime: loads an exported policy folder (``scripts/export.py``) and returns action chunks.

Imports torch, numpy, safetensors and the policy package only: no Ray, MuJoCo, Hydra, wandb, zarr, gymnasium or
fleet code (tested in a fresh interpreter). The policy's DDIM sampler comes from ``diffusers`` (imported by
``policies.aed_diffusion``; ~2-3 s of import time, no network), the action-history tokenizer from HF
``tokenizers``.

Export folder layout (``EXPORT_FORMAT``)::

    config.json  model.safetensors  stats.json  tokenizer.json   # the policy checkpoint (safetensors + JSON)
    export.json                                                  # features, control rate, sources, sha256 of files
    README.md                                                    # model card

Usage::

    rt = PolicyRuntime.load("exports/push", num_inference_steps=10, num_threads=1)
    rt.reset()                                    # at every episode start
    action = rt.select_action(obs)                # obs: {feature name: np.ndarray}, one control step -> (A,)
    chunk = rt.predict_action_chunk(batch)        # batch: inference windows (B, ...) -> (B, horizon, A)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

EXPORT_FORMAT = "fleetmind-export/1"
EXPORT_META = "export.json"
MODEL_CARD = "README.md"


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_export(folder: str | Path) -> dict[str, Any]:
    """Read ``export.json`` and check every listed file's sha256; returns the metadata.

    Raises:
        FileNotFoundError: the folder, ``export.json`` or a listed file is missing.
        ValueError: unknown format, or a file whose sha256 differs from ``export.json`` (file, expected, given).
    """
    d = Path(folder)
    meta_path = d / EXPORT_META
    if not meta_path.is_file():
        raise FileNotFoundError(f"export folder {d} lacks {EXPORT_META} (write one with scripts/export.py)")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != EXPORT_FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r}, expected {EXPORT_FORMAT!r}")
    for rel, digest in meta.get("files", {}).items():
        p = d / rel
        if not p.is_file():
            raise FileNotFoundError(f"export folder {d}: {rel} listed in {EXPORT_META} is missing")
        got = sha256_file(p)
        if got != digest:
            raise ValueError(f"export folder {d}: {rel} has sha256 {got}, {EXPORT_META} expects {digest}")
    return meta


class PolicyRuntime:
    """An exported policy, ready to act.

    Args:
        policy: the loaded policy module (eval mode), with ``predict_action_chunk``, ``select_action``, ``reset``.
        meta: ``export.json`` contents.
        num_inference_steps: DDIM denoising steps per chunk (None: the trained value), 1..num_train_timesteps.
    Raises:
        ValueError: ``num_inference_steps`` out of range.
    """

    def __init__(self, policy: torch.nn.Module, meta: dict[str, Any], num_inference_steps: int | None = None):
        self.policy, self.meta = policy, meta
        self.config = policy.config
        if num_inference_steps is not None:
            n = int(num_inference_steps)
            if not 1 <= n <= self.config.num_train_timesteps:
                raise ValueError(f"num_inference_steps: expected 1..{self.config.num_train_timesteps}, given {n}")
            self.config.num_inference_steps = n  # select_action's chunks use it too
        self.reset()

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", num_inference_steps: int | None = None,
             num_threads: int | None = None, verify: bool = True) -> PolicyRuntime:
        """Load an export folder (sha256-verified unless ``verify=False``).

        Args:
            folder: written by ``scripts/export.py``.
            device: torch device.
            num_inference_steps: DDIM steps (None: the value in the exported config).
            num_threads: ``torch.set_num_threads`` for CPU inference (None: leave torch's setting).
        Raises:
            FileNotFoundError / ValueError: see ``verify_export``; ValueError for an unknown policy type.
        """
        folder = Path(folder)
        meta = verify_export(folder) if verify else json.loads((folder / EXPORT_META).read_text())
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        ptype = json.loads((folder / "config.json").read_text()).get("type", "aed_diffusion")
        if ptype != "aed_diffusion":
            raise ValueError(f"export {folder}: policy type {ptype!r} is not supported by the runtime "
                             "(supported: 'aed_diffusion')")
        from policies.aed_diffusion import AEDDiffusionPolicy

        policy = AEDDiffusionPolicy.from_pretrained(folder, device=device)
        return cls(policy, meta, num_inference_steps)

    # ------------------------------------------------------------------ description
    @property
    def input_shapes(self) -> dict[str, list[int]]:
        """Observation features the policy reads: ``{name: per-frame shape}``."""
        return dict(self.config.input_shapes)

    @property
    def action_dim(self) -> int:
        return int(self.config.action_dim)

    @property
    def control_hz(self) -> float | None:
        """Control rate the policy was trained at (Hz), from the export metadata (None if unknown)."""
        hz = self.meta.get("control_hz")
        return None if hz is None else float(hz)

    def inference_window_spec(self) -> dict[str, tuple[str, list[int]]]:
        """Windows ``predict_action_chunk`` needs: ``{name: (feature, offsets from the current step)}``."""
        return self.policy.inference_window_spec()

    # ------------------------------------------------------------------ acting
    def reset(self) -> None:
        """Clear the observation/action history and the action queue (call at every episode start)."""
        self.policy.reset()

    @torch.no_grad()
    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None,
                             generator: torch.Generator | None = None,
                             num_inference_steps: int | None = None) -> torch.Tensor:
        """One action chunk per batch row.

        Args:
            batch: the windows of ``inference_window_spec()``, tensors or arrays with a leading batch dim B.
            noise: (B, horizon, action_dim) initial noise (default: drawn with ``generator``).
            num_inference_steps: DDIM steps for this call (default: the runtime's).
        Returns:
            (B, horizon, action_dim) float32 actions in raw units (``export.json`` ``features.action``).
        """
        return self.policy.predict_action_chunk(batch, noise=noise, generator=generator,
                                                num_inference_steps=num_inference_steps)

    @torch.no_grad()
    def select_action(self, obs: dict[str, np.ndarray], generator: torch.Generator | None = None) -> np.ndarray:
        """One control step: ``obs`` {feature name: unbatched np.ndarray} -> (action_dim,) float32 action.

        Keeps the history windows itself; predicts a new chunk every ``n_action_steps`` steps.
        Raises ValueError for a missing feature or a wrongly shaped one (name, expected, given).
        """
        return self.policy.select_action({k: np.asarray(v) for k, v in obs.items()}, generator=generator)
