"""Normalization of observations and actions from the store's statistics.

Stats follow the store contract (docs/INTERFACES.md): ``{key: {"min", "max", "mean", "std", ...}}`` with
per-dimension lists. ``min_max`` maps [min, max] to [-1, 1] (Diffusion Policy / LeRobot MIN_MAX);
``mean_std`` standardizes. Dimensions with (near) zero range or std are left centred but unscaled, as
LeRobot does, so constant dims (e.g. an unused quaternion) do not blow up; ``unnormalize`` returns such a
dimension's constant exactly (whatever the model predicts there). Images are uint8 and scaled
to [-1, 1] without statistics.
"""

from __future__ import annotations

import torch
from torch import nn

_EPS = 1e-6


class Normalizer(nn.Module):
    """Per-key affine normalization; parameters are non-persistent buffers (the checkpoint keeps stats JSON).

    Args:
        stats: store statistics (see module docstring).
        modes: ``{key: "min_max" | "mean_std"}`` for every key to normalize.
        dims: ``{key: d}`` expected per-frame widths, checked against the stats.
    Raises:
        ValueError: a key missing from ``stats``, a missing statistic, or a width that differs from ``dims``.
    """

    def __init__(self, stats: dict, modes: dict[str, str], dims: dict[str, int]):
        super().__init__()
        self.keys = list(modes)
        for i, key in enumerate(self.keys):
            if key not in stats:
                raise ValueError(f"normalization stats lack key {key!r} (have {sorted(stats)})")
            need = ("min", "max") if modes[key] == "min_max" else ("mean", "std")
            for s in need:
                if s not in stats[key]:
                    raise ValueError(f"normalization stats[{key!r}] lack {s!r}")
            a = torch.as_tensor(stats[key][need[0]], dtype=torch.float32).reshape(-1)
            b = torch.as_tensor(stats[key][need[1]], dtype=torch.float32).reshape(-1)
            if a.numel() != dims[key] or b.numel() != dims[key]:
                raise ValueError(f"normalization stats[{key!r}]: expected {dims[key]} dims, given "
                                 f"{a.numel()}/{b.numel()}")
            if modes[key] == "min_max":
                centre, half = (a + b) / 2, (b - a) / 2
            else:
                centre, half = a, b
            const = half < _EPS
            self.register_buffer(f"centre_{i}", centre, persistent=False)
            self.register_buffer(f"half_{i}", torch.where(const, torch.ones_like(half), half), persistent=False)
            # unnormalize: a constant dimension comes back as its constant (scale 0), not centre + prediction
            self.register_buffer(f"out_{i}", torch.where(const, torch.zeros_like(half), half), persistent=False)

    def _ab(self, key: str):
        i = self.keys.index(key)
        return getattr(self, f"centre_{i}"), getattr(self, f"half_{i}")

    def normalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """(..., d) raw -> (..., d) normalized."""
        c, h = self._ab(key)
        return (x - c) / h

    def unnormalize(self, key: str, x: torch.Tensor) -> torch.Tensor:
        """(..., d) normalized -> (..., d) raw; constant dimensions (zero range / std) give their constant."""
        i = self.keys.index(key)
        return x * getattr(self, f"out_{i}") + getattr(self, f"centre_{i}")


def normalize_image(x: torch.Tensor) -> torch.Tensor:
    """(..., H, W, 3) uint8 (or float 0..255) -> (..., 3, H, W) float in [-1, 1].

    The permutation is spelled with non-negative dimensions: ``movedim(-1, -3)`` exports to ONNX as a Transpose
    with ``perm`` containing -1, which onnxruntime rejects."""
    n = x.dim()
    return x.float().permute(*range(n - 3), n - 1, n - 3, n - 2) / 127.5 - 1.0
