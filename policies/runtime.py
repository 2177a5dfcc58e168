"""Lean deployment runtime: loads an exported policy folder (``scripts/export.py``) of any registered policy type
(``policies.factory``) and returns action chunks.

Imports torch, numpy, safetensors and the policy package only: no Ray, MuJoCo, Hydra, wandb, zarr, gymnasium or
fleet code (tested in a fresh interpreter). The AED diffusion policy's DDIM sampler comes from ``diffusers``
(imported by ``policies.aed_diffusion``; ~2-3 s of import time, no network), its action-history tokenizer from HF
``tokenizers``; the MLP chunk policy needs neither. An export with ONNX graphs of the chunk sampler
(``policies.onnx``) runs them in ``onnxruntime`` on the CPU at the batch size and step count they were exported
for (``backend="auto"``, the default of ``load``; ~5x faster chunks at batch 1 on a CPU).

Export folder layout (``EXPORT_FORMAT``)::

    config.json  model.safetensors  stats.json  tokenizer.json   # the policy checkpoint (safetensors + JSON)
    export.json                                                  # features, control rate, sources, sha256 of files
    onnx/chunk_ddim<steps>_b<batch>.onnx                         # optional: the chunk sampler as an ONNX graph
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
BACKENDS = ("auto", "torch", "onnx")
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


def _onnxruntime_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("onnxruntime") is not None


class PolicyRuntime:
    """An exported policy, ready to act.

    Args:
        policy: the loaded policy module (eval mode; ``policies.base.Policy``).
        meta: ``export.json`` contents.
        num_inference_steps: DDIM denoising steps per chunk (None: the trained value), 1..num_train_timesteps;
            only for a policy that denoises.
        compile: compile the policy's per-step work (``policy.compile_for_inference()``, ``torch.compile``):
            faster chunks after a first one that compiles (scripts/bench_runtime.py measures both).
        backend: ``"torch"`` (eager PyTorch), ``"onnx"`` (the export's ONNX graph for the step count and batch
            size in ONNX Runtime, ``policies.onnx``; anything else raises) or ``"auto"`` (ONNX where the export
            has a graph for the call's step count and batch size and onnxruntime is installed, else PyTorch).
        folder: the export folder (where ``export.json``'s ONNX graphs are); needed for the ONNX backend. A
            success critic exported with the weights (``policies.critic``, FERT's ``fert.critic``) then chooses
            ``select_action``'s chunks among K samples (``self.critic``: whether one was installed).
        num_threads: ONNX Runtime's intra-op threads (None: torch's current setting).
    Raises:
        ValueError: ``export.json``'s action dimension or names that do not match the model's ``action_dim``;
            ``num_inference_steps`` not an integer or out of range, or given for a policy without denoising steps;
            ``compile`` for a policy that offers no compiled inference; an unknown backend; ``backend="onnx"``
            without a graph for the step count (names the graphs the export has) or with ``compile``.
        ImportError: ``backend="onnx"`` without onnxruntime.
    """

    def __init__(self, policy: torch.nn.Module, meta: dict[str, Any], num_inference_steps: int | None = None,
                 compile: bool = False, backend: str = "torch", folder: str | Path | None = None,
                 num_threads: int | None = None):
        self.policy, self.meta = policy, meta
        self.config = policy.config
        self.denoises = bool(policy.denoising)
        # what the policy's sampling accepts (policies.base.Policy.denoising; a regressor takes none of them)
        self._chunk_kw = {"noise", "generator", "num_inference_steps"} if self.denoises else set()
        self._select_kw = {"generator"} if self.denoises else set()
        if num_inference_steps is not None and not self.denoises:
            raise ValueError(f"num_inference_steps={num_inference_steps}: policy type {policy.name!r} has no "
                             "denoising steps")
        act = (meta.get("features") or {}).get("action") or {}
        dims = {"features.action.dim": act.get("dim"),
                "len(features.action.names)": None if act.get("names") is None else len(act["names"])}
        bad = {k: v for k, v in dims.items() if v is not None and int(v) != int(self.config.action_dim)}
        if bad:
            raise ValueError(f"export.json: {', '.join(f'{k} = {v}' for k, v in bad.items())}, but the model acts in "
                             f"{self.config.action_dim} dimensions (policy_config.action_dim): a mismatched export")
        if num_inference_steps is not None:
            if isinstance(num_inference_steps, bool) or int(num_inference_steps) != num_inference_steps:
                raise ValueError(f"num_inference_steps: expected an integer, given {num_inference_steps!r}")
            n = int(num_inference_steps)
            if not 1 <= n <= self.config.num_train_timesteps:
                raise ValueError(f"num_inference_steps: expected 1..{self.config.num_train_timesteps}, given {n}")
            self.config.num_inference_steps = n  # select_action's chunks use it too
        if compile:
            if not hasattr(policy, "compile_for_inference"):
                raise ValueError(f"compile=True: policy type {policy.name!r} offers no compiled inference")
            policy.compile_for_inference()
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, given {backend!r}")
        self.folder = None if folder is None else Path(folder)
        self._graph_files = {(int(g["num_inference_steps"]), int(g["batch_size"])): g["file"]
                             for g in meta.get("onnx", [])} if self.folder is not None else {}
        self._samplers: dict[tuple[int, int], Any] = {}
        self._ort_threads = int(num_threads) if num_threads is not None else torch.get_num_threads()
        if backend == "auto" and (compile or not self._graph_files or not _onnxruntime_installed()):
            backend = "torch"
        if backend == "onnx":
            if compile:
                raise ValueError("backend='onnx' runs the ONNX graph: compile=True does not apply to it")
            steps = int(self.config.num_inference_steps)
            if not any(k[0] == steps for k in self._graph_files):
                raise ValueError(f"backend='onnx': the export has no ONNX graph for {steps} DDIM steps (it has "
                                 f"{sorted(self._graph_files) or 'none'} as (steps, batch size); export with "
                                 f"deploy.export.onnx_steps=[{steps}])")
            self._sampler(next(k for k in self._graph_files if k[0] == steps))  # load now: fail early
        self.backend = backend
        if backend != "torch":  # select_action's chunks too (AEDDiffusionPolicy.chunk_sampler)
            policy.chunk_sampler = self._chunk
        self.critic = self.noise_actor = False
        if self.folder is not None:   # a success critic exported beside the weights chooses select_action's chunks
            from policies.critic import install_critic

            self.critic = install_critic(policy, self.folder, str(getattr(policy, "device", "cpu")))
            from policies.noise_actor import install_noise_actor

            # a noise actor exported beside them starts every chunk (the ONNX graph's too: its noise input)
            self.noise_actor = install_noise_actor(policy, self.folder, str(getattr(policy, "device", "cpu")))
        self.reset()

    def _sampler(self, key: tuple[int, int]):
        if key not in self._samplers:
            from policies.onnx import OnnxChunkSampler

            self._samplers[key] = OnnxChunkSampler(self.folder / self._graph_files[key], self._ort_threads)
        return self._samplers[key]

    def uses_onnx(self, num_inference_steps: int | None = None, batch_size: int = 1) -> bool:
        """Whether a chunk at this step count (None: the runtime's) and batch size runs the ONNX graph."""
        check = getattr(self.policy, "inference_steps", None)   # ValueError outside 1..num_train_timesteps
        steps = check(num_inference_steps) if check else int(num_inference_steps or 0)
        return self.backend != "torch" and (steps, int(batch_size)) in self._graph_files

    def _chunk(self, batch: dict, noise: torch.Tensor | None = None, generator: torch.Generator | None = None,
               num_inference_steps: int | None = None, noise_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
        """An action chunk from the ONNX graph when there is one for (steps, B), else from PyTorch (backend
        "auto"; "onnx" raises ValueError). Same arguments and result as the policy's ``predict_action_chunk``."""
        p = self.policy
        B = int(np.shape(next(v for k, v in batch.items() if not k.endswith("_is_pad")))[0])
        steps = p.inference_steps(num_inference_steps)   # ValueError outside 1..num_train_timesteps
        if not self.uses_onnx(steps, B):
            if self.backend == "onnx":
                raise ValueError(f"backend='onnx': no ONNX graph for {steps} DDIM steps at batch size {B} (the "
                                 f"export has {sorted(self._graph_files)} as (steps, batch size))")
            return type(p).predict_action_chunk(p, batch, noise=noise, generator=generator,
                                                num_inference_steps=num_inference_steps, noise_scale=noise_scale)
        x = p.initial_noise(B, noise, generator, noise_scale).cpu()
        return self._sampler((steps, B))(p.tokenize_history(batch), x)

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu", num_inference_steps: int | None = None,
             num_threads: int | None = None, verify: bool = True, compile: bool = False,
             backend: str = "auto") -> PolicyRuntime:
        """Load an export folder (sha256-verified unless ``verify=False``).

        Args:
            folder: written by ``scripts/export.py``.
            device: torch device.
            num_inference_steps: DDIM steps (None: the value in the exported config).
            num_threads: ``torch.set_num_threads`` for CPU inference (None: leave torch's setting).
            compile: see the class (``torch.compile`` of the per-step work).
            backend: ``"auto"`` (default: the export's ONNX graph where it has one, on a CPU device), ``"torch"``
                or ``"onnx"`` (see the class).
        Raises:
            FileNotFoundError / ValueError: see ``verify_export``; KeyError for an unknown policy type.
        """
        from policies.factory import load_policy

        folder = Path(folder)
        meta = verify_export(folder) if verify else json.loads((folder / EXPORT_META).read_text())
        if num_threads is not None:
            torch.set_num_threads(int(num_threads))
        if backend == "auto" and torch.device(device).type != "cpu":
            backend = "torch"  # the graphs run on ONNX Runtime's CPU provider
        return cls(load_policy(folder, device=device), meta, num_inference_steps, compile=compile, backend=backend,
                   folder=folder, num_threads=num_threads)

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

    @torch.inference_mode()
    def predict_action_chunk(self, batch: dict, noise: torch.Tensor | None = None,
                             generator: torch.Generator | None = None,
                             num_inference_steps: int | None = None) -> torch.Tensor:
        """One action chunk per batch row.

        Args:
            batch: the windows of ``inference_window_spec()``, tensors or arrays with a leading batch dim B.
            noise: (B, horizon, action_dim) initial noise (default: drawn with ``generator``).
            num_inference_steps: DDIM steps for this call (default: the runtime's), 1..num_train_timesteps.
        Returns:
            (B, horizon, action_dim) float32 actions in raw units (``export.json`` ``features.action``).
        Raises:
            ValueError: a step count outside 1..num_train_timesteps (0 and negative counts included), or noise /
            steps given to a policy without denoising.
        """
        kw = {"noise": noise, "generator": generator, "num_inference_steps": num_inference_steps}
        if any(v is not None for k, v in kw.items() if k not in self._chunk_kw):
            raise ValueError(f"policy type {self.policy.name!r} samples no noise and has no denoising steps; "
                             "give none of noise / generator / num_inference_steps")
        if self.backend != "torch":
            return self._chunk(batch, noise=noise, generator=generator, num_inference_steps=num_inference_steps)
        return self.policy.predict_action_chunk(batch, **{k: v for k, v in kw.items() if k in self._chunk_kw})

    @torch.inference_mode()
    def select_action(self, obs: dict[str, np.ndarray], generator: torch.Generator | None = None) -> np.ndarray:
        """One control step: ``obs`` {feature name: unbatched np.ndarray} -> (action_dim,) float32 action.

        Keeps the history windows itself; predicts a new chunk every ``n_action_steps`` steps.
        Raises ValueError for a missing feature or a wrongly shaped one (name, expected, given).
        """
        obs = {k: np.asarray(v) for k, v in obs.items()}
        if "generator" in self._select_kw:
            return self.policy.select_action(obs, generator=generator)
        return self.policy.select_action(obs)
