"""A learned success detector: is the task done, from what a robot sees (camera frames and proprioception only).

A real fleet has no simulator to say whether an episode succeeded. It labels its own executions with a classifier
trained on a small labelled budget, as LeRobot's reward-classifier API and HIL-SERL (Luo et al. 2024) do: a frame
classifier that fires when the task is done and ends the episode. :class:`SuccessDetector` is that classifier:

* inputs: ``frames`` (B, C, H, W, 3) uint8, one image per configured camera (C may be 0); ``state`` (B, S)
  float32, the robot's proprioception (``observation.state``: end-effector position in metres and gripper opening);
  ``task`` (B,) int64, the task's index in the detector's task list; with ``num_points``, ``clouds`` (B, N, 3)
  float32, the depth cameras' workspace point cloud in the robot's base frame (``sim.pointcloud``; with
  ``point_color`` (B, N, 6): each point's RGB 0..255 after its coordinates). Never the object's simulator state.
* per camera a small convolutional encoder (shared weights, a learned camera embedding), the state through an MLP,
  a task embedding, the cloud through a PointNet (a shared MLP over each point's position and its offset from the
  hand, max-pooled: Qi et al. 2017, the encoder DP3 uses); an MLP head gives one logit: the probability that the
  task is done at this frame.

It is trained with :func:`fit_detector` (binary cross-entropy, random-shift augmentation as in DrQ, Kostrikov et al.
2020) and saved as ``detector.safetensors`` + ``detector.json`` (never pickled). ``fleet.labels`` records the frames,
fits it on the labelled budget, runs it online in the fleet and audits it against the simulator's labels.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

WEIGHTS, META = "detector.safetensors", "detector.json"


@dataclass
class DetectorSpec:
    """The detector's shape: what it reads and how wide it is.

    Raises:
        ValueError: no task or camera, a non-positive size, or an unknown threshold range.
    """

    tasks: list[str]
    cameras: list[str]
    image_size: int = 64
    state_dim: int = 4
    width: int = 16
    threshold: float = 0.5
    """Probability above which a frame is judged a success (chosen on the labelled budget's validation episodes)."""
    state_mean: list[float] = field(default_factory=list)
    state_std: list[float] = field(default_factory=list)
    num_points: int = 0
    """Points of the cloud the detector reads (0: no cloud)."""
    cloud_mean: list[float] = field(default_factory=list)
    cloud_std: list[float] = field(default_factory=list)
    point_color: bool = False
    """The cloud's points carry their RGB (clouds (B, N, 6)); the PointNet reads it beside the coordinates."""
    history: int = 0
    """Earlier proprioception samples the detector reads beside the current one (0: none): the state at
    ``history_every``, 2 ``history_every``, ... steps before the judged frame (:func:`history_steps`), as offsets
    from now: the hand's motion around a moment of success (reach passes through its goal)."""
    history_every: int = 2
    """Control steps between the history's samples."""
    task_thresholds: list[float] = field(default_factory=list)
    """Per-task firing thresholds, in ``tasks`` order (empty: ``threshold`` for every task): tasks whose
    probabilities are calibrated differently each get their own cut."""

    @property
    def cloud_channels(self) -> int:
        """Channels per point of the clouds the detector reads: 3 (x, y, z metres), 6 with ``point_color``."""
        return 6 if self.point_color else 3

    def __post_init__(self) -> None:
        if not self.tasks or not (self.cameras or self.num_points):
            raise ValueError(f"DetectorSpec: expected tasks and cameras or a point cloud, given {self.tasks}, "
                             f"{self.cameras}, num_points={self.num_points}")
        if self.num_points < 0:
            raise ValueError(f"DetectorSpec.num_points: expected >= 0, given {self.num_points}")
        if min(self.image_size, self.state_dim, self.width) < 1:
            raise ValueError(f"DetectorSpec: expected positive sizes, given image_size={self.image_size}, "
                             f"state_dim={self.state_dim}, width={self.width}")
        if not 0.0 < float(self.threshold) < 1.0:
            raise ValueError(f"DetectorSpec.threshold: expected a probability in (0, 1), given {self.threshold}")
        if self.history < 0 or self.history_every < 1:
            raise ValueError(f"DetectorSpec: expected history >= 0 and history_every >= 1, given history="
                             f"{self.history}, history_every={self.history_every}")
        if self.task_thresholds and (len(self.task_thresholds) != len(self.tasks)
                                     or not all(0.0 < float(x) < 1.0 for x in self.task_thresholds)):
            raise ValueError(f"DetectorSpec.task_thresholds: expected one probability in (0, 1) per task "
                             f"({len(self.tasks)}), given {self.task_thresholds}")

    def threshold_of(self, task: str) -> float:
        """The firing threshold for ``task`` (its own with ``task_thresholds``, else ``threshold``).

        Raises:
            KeyError: a task the detector was not trained on.
        """
        if not self.task_thresholds:
            return float(self.threshold)
        if str(task) not in self.tasks:
            raise KeyError(f"success detector: task {task!r} not among its tasks {self.tasks}")
        return float(self.task_thresholds[self.tasks.index(str(task))])


def history_steps(t: int, history: int, every: int, first: int) -> list[int]:
    """The steps of a detector's proprioception history at judged step ``t``: ``t - every * k`` for k = 1..``history``,
    each clamped to ``first`` (the earliest step a record holds: the labelled budget's first recorded step), so the
    fleet and the recorded budget give the detector the same input.

    Returns:
        ``history`` ints, most recent first.
    """
    return [max(int(t) - int(every) * k, int(first)) for k in range(1, int(history) + 1)]


class SuccessDetector(nn.Module):
    """Frame-level success classifier over camera frames + proprioception + task (see the module docstring).

    Args:
        spec: :class:`DetectorSpec`.
    """

    def __init__(self, spec: DetectorSpec) -> None:
        super().__init__()
        self.spec = spec
        w = int(spec.width)
        # (N, 3, H, W) -> a 4x4 patch stem (H/4) -> (N, 2w, 8, 8) -> flattened, so where things are is kept (a
        # pooled feature would lose the hand-to-marker offset); ~10x cheaper on a CPU than a 5x5 stride-2 stem
        self.encoder = nn.Sequential(
            nn.Conv2d(3, w, 4, stride=4), nn.GELU(),
            nn.Conv2d(w, 2 * w, 3, stride=2, padding=1), nn.GELU(),
            nn.Conv2d(2 * w, 2 * w, 3, padding=1), nn.GELU(),
            nn.AdaptiveAvgPool2d(8), nn.Flatten(), nn.Linear(2 * w * 64, 4 * w), nn.GELU())
        self.camera_embed = nn.Parameter(torch.zeros(len(spec.cameras), 4 * w))
        self.state_mlp = nn.Sequential(nn.Linear(spec.state_dim * (1 + int(spec.history)), 2 * w), nn.GELU(),
                                       nn.Linear(2 * w, 2 * w))
        self.task_embed = nn.Embedding(len(spec.tasks), 2 * w)
        cloud_w = 0
        if spec.num_points:
            # PointNet over (x, y, z, x - hand_x, y - hand_y, z - hand_z): where each point is and where it is from the
            # gripper; max over the points
            self.point_mlp = nn.Sequential(nn.Linear(6 + 3 * bool(spec.point_color), 2 * w), nn.LayerNorm(2 * w),
                                           nn.ReLU(),
                                           nn.Linear(2 * w, 4 * w), nn.LayerNorm(4 * w), nn.ReLU(),
                                           nn.Linear(4 * w, 8 * w), nn.LayerNorm(8 * w), nn.ReLU())
            cloud_w = 8 * w
            cm = torch.tensor(spec.cloud_mean or [0.0] * 3, dtype=torch.float32)
            cs = torch.tensor(spec.cloud_std or [1.0] * 3, dtype=torch.float32)
            self.register_buffer("cloud_mean", cm)
            self.register_buffer("cloud_std", cs.clamp_min(1e-6))
        self.head = nn.Sequential(nn.Linear(4 * w * len(spec.cameras) + 4 * w + cloud_w, 4 * w), nn.GELU(),
                                  nn.Linear(4 * w, 1))
        mean = torch.tensor(spec.state_mean or [0.0] * spec.state_dim, dtype=torch.float32)
        std = torch.tensor(spec.state_std or [1.0] * spec.state_dim, dtype=torch.float32)
        self.register_buffer("state_mean", mean)
        self.register_buffer("state_std", std.clamp_min(1e-6))

    def forward(self, frames: torch.Tensor, state: torch.Tensor, task: torch.Tensor,
                clouds: torch.Tensor | None = None, history: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) logits that the task is done.

        Args:
            frames: (B, C, H, W, 3) uint8 (or float in 0..255); C = 0 without cameras. state: (B, S) float32, the
                first three entries the hand's position (metres, base frame). task: (B,) int64. clouds: (B, N, 3)
                float32 metres, (B, N, 6) with ``spec.point_color`` (RGB 0..255 after the coordinates)
                (``spec.num_points`` N; None without a cloud). history: (B, H, S) float32, the proprioception at the
                steps of :func:`history_steps` (``spec.history`` H; None without).

        Raises:
            ValueError: shapes that do not match the spec.
        """
        B, C = frames.shape[:2]
        if C != len(self.spec.cameras) or (C and tuple(frames.shape[2:]) != (self.spec.image_size,
                                                                             self.spec.image_size, 3)):
            raise ValueError(f"SuccessDetector: expected frames (B, {len(self.spec.cameras)}, {self.spec.image_size}, "
                             f"{self.spec.image_size}, 3), given {tuple(frames.shape)}")
        if state.shape != (B, self.spec.state_dim):
            raise ValueError(f"SuccessDetector: expected state (B, {self.spec.state_dim}), given {tuple(state.shape)}")
        parts = []
        if C:
            x = frames.reshape(B * C, *frames.shape[2:]).permute(0, 3, 1, 2).float() / 127.5 - 1.0
            parts.append((self.encoder(x).reshape(B, C, -1) + self.camera_embed).reshape(B, -1))
        s = [(state.float() - self.state_mean) / self.state_std]
        if self.spec.history:
            H = int(self.spec.history)
            if history is None or tuple(history.shape) != (B, H, self.spec.state_dim):
                raise ValueError(f"SuccessDetector: expected history (B, {H}, {self.spec.state_dim}), given "
                                 f"{None if history is None else tuple(history.shape)}")
            s.append(((history.float() - state.float()[:, None]) / self.state_std).reshape(B, -1))
        parts += [self.state_mlp(torch.cat(s, -1)), self.task_embed(task.long())]
        if self.spec.num_points:
            ch = self.spec.cloud_channels
            if clouds is None or tuple(clouds.shape) != (B, self.spec.num_points, ch):
                raise ValueError(f"SuccessDetector: expected clouds (B, {self.spec.num_points}, {ch}), given "
                                 f"{None if clouds is None else tuple(clouds.shape)}")
            p = clouds[..., :3].float()
            feats = [(p - self.cloud_mean) / self.cloud_std, (p - state[:, None, :3].float()) / self.cloud_std]
            if self.spec.point_color:
                feats.append(clouds[..., 3:6].float() / 127.5 - 1.0)
            parts.append(self.point_mlp(torch.cat(feats, -1)).amax(1))
        return self.head(torch.cat(parts, -1)).squeeze(-1)

    @torch.no_grad()
    def probability(self, frames, state, task, clouds=None, history=None) -> torch.Tensor:
        """(B,) success probabilities in [0, 1] (eval mode); the arguments as :meth:`forward`'s."""
        self.eval()
        return torch.sigmoid(self(torch.as_tensor(frames), torch.as_tensor(state), torch.as_tensor(task),
                                  None if clouds is None else torch.as_tensor(clouds),
                                  None if history is None else torch.as_tensor(history)))

    def task_index(self, task: str) -> int:
        """The index of ``task`` in the detector's task list.

        Raises:
            KeyError: a task the detector was not trained on (it names the known ones).
        """
        try:
            return self.spec.tasks.index(str(task))
        except ValueError:
            raise KeyError(f"success detector: task {task!r} not among its tasks {self.spec.tasks}") from None

    def save(self, directory: str | Path) -> Path:
        """Write ``detector.safetensors`` and ``detector.json`` into ``directory`` (created); returns it."""
        from safetensors.torch import save_file

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(d / WEIGHTS))
        (d / META).write_text(json.dumps({"spec": asdict(self.spec), "format": 1,
                                          "source": "fleetmind success detector (frame classifier, HIL-SERL style)"},
                                         indent=1))
        return d

    @classmethod
    def load(cls, directory: str | Path) -> SuccessDetector:
        """Load a detector saved by :meth:`save`.

        Raises:
            FileNotFoundError: the directory lacks ``detector.json`` or ``detector.safetensors``.
            ValueError: the weights do not fit the spec (names the first mismatching tensor).
        """
        from safetensors.torch import load_file

        d = Path(directory)
        if not (d / META).is_file() or not (d / WEIGHTS).is_file():
            raise FileNotFoundError(f"{d} holds no success detector ({META} + {WEIGHTS})")
        model = cls(DetectorSpec(**json.loads((d / META).read_text())["spec"]))
        weights = load_file(str(d / WEIGHTS))
        own = model.state_dict()
        for k, v in own.items():
            if k not in weights or tuple(weights[k].shape) != tuple(v.shape):
                raise ValueError(f"success detector {d}: tensor {k!r} expected shape {tuple(v.shape)}, given "
                                 f"{tuple(weights[k].shape) if k in weights else 'none'}")
        model.load_state_dict(weights)
        return model.eval()


def random_shift(frames: torch.Tensor, pad: int, generator: torch.Generator) -> torch.Tensor:
    """DrQ's augmentation: each image padded by ``pad`` pixels (edge values) and cropped back at a random offset.
    ``frames`` (N, H, W, 3) uint8 -> the same shape and dtype."""
    if pad <= 0:
        return frames
    N, H, W, _ = frames.shape
    x = nn.functional.pad(frames.permute(0, 3, 1, 2), (pad, pad, pad, pad), mode="replicate")
    off = torch.randint(0, 2 * pad + 1, (N, 2), generator=generator).tolist()
    return torch.stack([x[i, :, dy:dy + H, dx:dx + W] for i, (dy, dx) in enumerate(off)]).permute(0, 2, 3, 1)


def fit_detector(spec: DetectorSpec, frames: torch.Tensor, state: torch.Tensor, task: torch.Tensor,
                 label: torch.Tensor, updates: int = 1500, batch_size: int = 128, lr: float = 1e-3,
                 weight_decay: float = 1e-4, shift_px: int = 3, seed: int = 0,
                 clouds: torch.Tensor | None = None, jitter_m: float = 0.002,
                 history: torch.Tensor | None = None) -> tuple[SuccessDetector, dict]:
    """Train a :class:`SuccessDetector` on labelled frames (binary cross-entropy, positives re-weighted to balance
    the classes, AdamW, random shifts).

    Args:
        spec: the detector's spec (its ``state_mean`` / ``state_std`` are set here from ``state``).
        frames: (N, C, H, W, 3) uint8. state: (N, S) float32. task: (N,) int64. label: (N,) {0, 1}.
        clouds: (N, P, 3) float32 metres when ``spec.num_points`` ((N, P, 6) with ``spec.point_color``: RGB after
            the coordinates); the coordinates augmented with Gaussian noise of ``jitter_m`` metres (a depth sensor's
            noise; PointNet's jitter augmentation). history: (N, H, S) float32 when ``spec.history`` (the
            proprioception at :func:`history_steps`).

    Returns:
        ``(detector in eval mode, {"frames", "positives", "loss"})``.

    Raises:
        ValueError: no frames, or only one class.
    """
    n, pos = len(label), int(label.sum())
    if n == 0 or pos in (0, n):
        raise ValueError(f"fit_detector: expected frames of both classes, given {n} frames with {pos} positives")
    spec.state_mean = state.float().mean(0).tolist()
    spec.state_std = state.float().std(0).clamp_min(1e-3).tolist()
    if spec.num_points:
        if clouds is None or tuple(clouds.shape[1:]) != (spec.num_points, spec.cloud_channels) or len(clouds) != n:
            raise ValueError(f"fit_detector: expected clouds ({n}, {spec.num_points}, {spec.cloud_channels}), given "
                             f"{None if clouds is None else tuple(clouds.shape)}")
        flat = clouds[..., :3].float().reshape(-1, 3)
        spec.cloud_mean, spec.cloud_std = flat.mean(0).tolist(), flat.std(0).clamp_min(1e-3).tolist()
    if spec.history and (history is None or tuple(history.shape) != (n, int(spec.history), spec.state_dim)):
        raise ValueError(f"fit_detector: expected history ({n}, {spec.history}, {spec.state_dim}), given "
                         f"{None if history is None else tuple(history.shape)}")
    g = torch.Generator().manual_seed(int(seed))
    torch.manual_seed(int(seed))
    model = SuccessDetector(spec)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(int(updates), 1))
    pos_weight = torch.tensor((n - pos) / pos, dtype=torch.float32)
    model.train()
    loss_avg = None
    for _ in range(int(updates)):
        idx = torch.randint(0, n, (min(int(batch_size), n),), generator=g)
        f = frames[idx]
        B, C = f.shape[:2]
        if C:
            f = random_shift(f.reshape(B * C, *f.shape[2:]), shift_px, g).reshape(f.shape)
        cl = None
        if spec.num_points:
            cl = clouds[idx].float()
            cl[..., :3] += torch.randn(cl[..., :3].shape, generator=g) * float(jitter_m)
        logit = model(f, state[idx], task[idx], cl, history[idx] if spec.history else None)
        loss = nn.functional.binary_cross_entropy_with_logits(logit, label[idx].float(), pos_weight=pos_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        v = float(loss.detach())
        loss_avg = v if loss_avg is None else 0.98 * loss_avg + 0.02 * v
    return model.eval(), {"frames": n, "positives": pos, "loss": loss_avg}
