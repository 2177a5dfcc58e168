"""Batched policy server: one Ray actor answers action-chunk requests from many robot workers.

Requests that arrive while a forward pass is running (or within ``max_wait_ms`` of the first one) are
stacked into one batch and answered by one ``predict_action_chunk`` call, on the GPU when there is one
(dynamic batching as in NVIDIA Triton / Ray Serve's ``@serve.batch``). Requests name the policy version they
want, so an episode keeps one version even when a newer one is published mid-episode; the server loads
versions from the checkpoint registry on demand and keeps the ``keep_versions`` most recent in memory.

The server is stateless between requests (workers send the observation history the policy's
``window_spec`` asks for, built by ``fleet.acting.ObservationHistory``), so when it is restarted by Ray
the workers simply retry and continue their episodes.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fleet.acting import load_checkpoint, policy_input_shapes, resolve_device
from fleet.fleet_config import FleetConfig


class PolicyServer:
    """Dynamic-batching inference actor (wrap with ``ray.remote``; see ``make_policy_server``).

    Args:
        registry_url: ``CheckpointRegistry`` URL the versions are fetched from (``None`` with ``path``).
        path: a local checkpoint directory served as its own version (``UNVERSIONED`` or its manifest's).
        cache_dir: where fetched versions are unpacked.
        device: ``"auto"`` | ``"cpu"`` | ``"cuda"``.
        max_batch: largest batch of one forward pass.
        max_wait_ms: how long the first request of a batch waits for company (milliseconds).
        keep_versions: loaded versions kept in memory.
        num_threads: torch CPU threads of the forward pass.
    """

    def __init__(self, registry_url: str | None = None, path: str | None = None, cache_dir: str = "/tmp/fleet_cache",
                 device: str = "auto", max_batch: int = 64, max_wait_ms: float = 1.0, keep_versions: int = 2,
                 num_threads: int = 1):
        if registry_url is None and path is None:
            raise ValueError("PolicyServer needs registry_url or path")
        torch.set_num_threads(num_threads)
        self.registry_url, self.path, self.cache_dir = registry_url, path, Path(cache_dir)
        self.device = resolve_device(device)
        self.max_batch, self.max_wait = max_batch, max_wait_ms / 1000.0
        self.keep_versions = keep_versions
        self.models: OrderedDict[int, torch.nn.Module] = OrderedDict()
        self.fixed_version: int | None = None
        if path is not None:
            model, self.fixed_version = load_checkpoint(path, self.device)
            self.models[self.fixed_version] = model
        self._pending: deque = deque()
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(1)
        self._batch_sizes: list[int] = []
        self._latency_s: list[float] = []
        self._forward_s: list[float] = []

    # ------------------------------------------------------------------ versions
    def _registry(self):
        from fleet.registry import CheckpointRegistry

        return CheckpointRegistry(self.registry_url)

    def latest_version(self) -> int | None:
        """The version workers should act with now (fixed path: that one; else the registry's latest)."""
        if self.fixed_version is not None:
            return self.fixed_version
        return self._registry().latest_version()

    def _model(self, version: int) -> torch.nn.Module:
        if version in self.models:
            self.models.move_to_end(version)
            return self.models[version]
        if self.fixed_version is not None:
            raise ValueError(f"PolicyServer serves the fixed checkpoint version {self.fixed_version}, not {version}")
        local = self._registry().fetch(version, self.cache_dir / f"server-v{version:06d}")
        model, _ = load_checkpoint(local, self.device)
        self.models[version] = model
        while len(self.models) > self.keep_versions:
            self.models.popitem(last=False)
        return model

    def info(self, version: int | None = None) -> dict[str, Any]:
        """What a worker needs to build requests and check that the version fits its robot: ``{"version",
        "window_spec", "n_action_steps", "action_dim", "horizon", "input_shapes"}`` of ``version`` (``None``:
        latest; ``input_shapes``: ``{feature: shape}`` the policy reads). Raises ``RuntimeError`` when nothing is
        published."""
        version = self.latest_version() if version is None else version
        if version is None:
            raise RuntimeError(f"PolicyServer: registry {self.registry_url!r} has no published version yet")
        model = self._model(version)
        cfg = model.config
        spec = model.inference_window_spec() if hasattr(model, "inference_window_spec") else model.window_spec()
        return {"version": version, "window_spec": {k: (s, list(o)) for k, (s, o) in spec.items()},
                "n_action_steps": int(cfg.n_action_steps), "action_dim": int(cfg.action_dim),
                "horizon": int(cfg.horizon), "input_shapes": policy_input_shapes(cfg)}

    # ------------------------------------------------------------------ batching
    async def predict_chunk(self, sample: dict[str, np.ndarray], version: int, noise_scale: float = 1.0) -> np.ndarray:
        """One action chunk ``(horizon, action_dim)`` float32 for one sample (``name -> (T, ...)`` arrays,
        without batch axis), computed in a batch with the other requests pending now. ``noise_scale``: this
        request's temperature of the initial denoising noise (1.0: as trained; a failure retry's exploration)."""
        if self._wake is None:
            self._wake = asyncio.Event()
            self._loop_task = asyncio.get_running_loop().create_task(self._batch_loop())
        fut = asyncio.get_running_loop().create_future()
        self._pending.append((sample, int(version), fut, time.perf_counter(), float(noise_scale)))
        self._wake.set()
        return await fut

    async def _batch_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._pending:
                continue
            if len(self._pending) < self.max_batch and self.max_wait > 0:
                await asyncio.sleep(self.max_wait)
            version = self._pending[0][1]
            batch, rest = [], deque()
            while self._pending and len(batch) < self.max_batch:
                item = self._pending.popleft()
                (batch if item[1] == version else rest).append(item)
            self._pending.extendleft(reversed(rest))
            try:
                chunks = await loop.run_in_executor(self._pool, self._forward, [b[0] for b in batch], version,
                                                    [b[4] for b in batch])
                now = time.perf_counter()
                for (_, _, fut, t0, _), c in zip(batch, chunks):
                    self._latency_s.append(now - t0)
                    if not fut.done():
                        fut.set_result(c)
            except Exception as e:  # noqa: BLE001 - every waiting request gets the error
                for _, _, fut, _, _ in batch:
                    if not fut.done():
                        fut.set_exception(e)
            if self._pending:
                self._wake.set()

    @torch.no_grad()
    def _forward(self, samples: list[dict[str, np.ndarray]], version: int,
                 noise_scales: list[float] | None = None) -> np.ndarray:
        t0 = time.perf_counter()
        model = self._model(version)
        keys = set(samples[0])
        for s in samples[1:]:
            if set(s) != keys:
                raise ValueError(f"PolicyServer: requests in one batch have different keys: {sorted(keys)} vs {sorted(s)}")
        batch = {k: torch.as_tensor(np.stack([s[k] for s in samples])).to(self.device) for k in keys}
        sample = getattr(model, "chunk_sampler", None) or model.predict_action_chunk   # a critic's choice, if any
        if noise_scales is not None and any(x != 1.0 for x in noise_scales):
            chunk = sample(batch, noise_scale=torch.tensor(noise_scales, dtype=torch.float32))
        else:
            chunk = sample(batch)
        chunk = chunk.float().cpu().numpy()
        self._batch_sizes.append(len(samples))
        self._forward_s.append(time.perf_counter() - t0)
        return chunk

    def forward_batch(self, samples: list[dict[str, np.ndarray]], version: int) -> np.ndarray:
        """Unbatched-by-server forward of ``samples`` in one call: ``(B, horizon, action_dim)`` (benchmarks)."""
        return self._forward(samples, version)

    def stats(self, reset: bool = False) -> dict[str, Any]:
        """Batch sizes and latencies so far: ``{"requests", "batches", "mean_batch", "max_batch", "batch_p50",
        "batch_p90", "batch_histogram" ({batch size: batches}), "latency_ms_p50", "latency_ms_p95",
        "forward_ms_mean", "device"}`` (latency: request arrival to answer)."""
        lat = np.asarray(self._latency_s) * 1e3
        out = {
            "requests": int(sum(self._batch_sizes)),
            "batches": len(self._batch_sizes),
            "mean_batch": float(np.mean(self._batch_sizes)) if self._batch_sizes else 0.0,
            "max_batch": int(max(self._batch_sizes, default=0)),
            "batch_p50": float(np.percentile(self._batch_sizes, 50)) if self._batch_sizes else 0.0,
            "batch_p90": float(np.percentile(self._batch_sizes, 90)) if self._batch_sizes else 0.0,
            "batch_histogram": {str(k): int(v) for k, v in sorted(Counter(self._batch_sizes).items())},
            "latency_ms_p50": float(np.percentile(lat, 50)) if lat.size else None,
            "latency_ms_p95": float(np.percentile(lat, 95)) if lat.size else None,
            "forward_ms_mean": float(np.mean(self._forward_s) * 1e3) if self._forward_s else None,
            "device": self.device,
        }
        if reset:
            self._batch_sizes, self._latency_s, self._forward_s = [], [], []
        return out

    def pid(self) -> int:
        import os

        return os.getpid()


def make_policy_server(fleet_cfg: FleetConfig | Mapping, registry_url: str | None = None, path: str | None = None,
                       cache_dir: str = "/tmp/fleet_cache", device: str = "auto"):
    """Start a ``PolicyServer`` Ray actor (restarted by Ray up to ``fleet_cfg.max_restarts`` times; asks
    for one GPU when ``device`` resolves to cuda and the cluster has one)."""
    import ray

    fleet_cfg = FleetConfig.from_dict(fleet_cfg)
    num_gpus = 1 if resolve_device(device) == "cuda" and ray.cluster_resources().get("GPU", 0) >= 1 else 0
    actor = ray.remote(PolicyServer).options(
        max_restarts=int(fleet_cfg.max_restarts), max_task_retries=0, num_cpus=0, num_gpus=num_gpus,
        max_concurrency=1000,
    )
    return actor.remote(registry_url=registry_url, path=path, cache_dir=cache_dir, device=device,
                        max_batch=int(fleet_cfg.server_max_batch),
                        max_wait_ms=float(fleet_cfg.server_max_wait_ms))
