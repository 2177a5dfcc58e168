"""Policy training's typed config: Hydra's config group ``train``, and the one place its defaults live.

:class:`TrainConfig` is registered in Hydra's ConfigStore as ``train/default`` (:mod:`configs.typed`), so an
unknown key (``train.stpes=10``) or a wrong type (``train.lr=fast``) is refused while the config is composed,
naming the key, and a value out of range by ``configs.schema.check`` before any work. Every trainer reads it
through :meth:`TrainConfig.from_dict` (``policies.aed_diffusion.training.train_policy``: the base, the learner's
rounds, the offline arms, ``scripts/train.py``), so a key a caller leaves out takes the value below. The root
config sets ``train.seed: ${seed}`` (a preset over this group's default). Follows the pattern of LeRobot's
``configs/train.py`` (a dataclass per component, a docstring per field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, TypedConfig, boolean, integer, number, one_of, optional


@dataclass
class EpisodeFilter(TypedConfig):
    """Which store episodes ``scripts/train.py`` trains on: ``ExperienceStore.episodes(**filter)`` (null: any)."""

    is_demo: bool | None = True
    """True: the demonstrations only; False: fleet episodes only; null: both."""
    success: bool | None = None
    """True: successful episodes only; False: failures only; null: both."""


@dataclass
class WandbConfig(TypedConfig):
    """Weights & Biases logging of a training run (offline unless told otherwise)."""

    enabled: bool = True
    """Log the run (loss, learning rate, samples/s, validation loss) to wandb."""
    project: str = "fleetmind"
    """wandb project."""
    mode: str = "offline"
    """offline (files under the run dir; no network) | online (needs ``WANDB_API_KEY``) | disabled."""
    name: str | None = None
    """Run name (null: wandb's)."""


def _bench_defaults() -> dict[str, Any]:
    return {
        "devices": ["cpu", "cuda"],   # cuda is skipped when no GPU is visible
        "configs": ["state", "image"],   # state | image | image64 | pointcloud (scripts/bench_policy.py)
        "batch_size": 64, "train_iters": 5, "infer_iters": 5, "warmup": 2, "num_threads": None,
        "compile": False,    # torch.compile; on CUDA also the denoiser with mode=reduce-overhead (CUDA graphs)
        "amp_bf16": False,
        "policy_overrides": None,   # {field: value}: policy fields set in every benchmarked config
        # LeRobot U-Net candidates; the one nearest our parameter count is timed
        "lerobot_down_dims": [[32, 64, 128], [64, 128, 256], [128, 256, 512], [256, 512, 1024]],
    }


@dataclass
class TrainConfig(TypedConfig):
    """Training a policy (``policies.aed_diffusion.training.train_policy``): AdamW with linear warm-up then cosine
    decay, gradient clipping, EMA weights. Units: steps are optimizer updates; ``lr`` per update.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) listing every value out of its range,
            ``train.<key>: expected ..., given ...``, or naming an unknown key.
    """

    steps: int = 2000
    """Optimizer updates in total (a resumed run continues to this step)."""
    batch_size: int = 64
    """Windows per update."""
    lr: float = 5.0e-4
    """Peak learning rate (AdamW), after the linear warm-up, then cosine decay (the AED paper: 1e-4 cosine, wd 0.01)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    warmup_steps: int = 100
    """Linear warm-up updates."""
    grad_clip: float = 1.0
    """Gradient-norm clip."""
    ema: bool = True
    """Keep EMA weights (Diffusion Policy's warm-up schedule, Chi et al. 2023): they are what gets saved."""
    ema_power: float = 0.75
    """EMA warm-up power: decay = 1 - (1 + step) ** -power."""
    ema_max_decay: float = 0.9999
    """EMA decay ceiling."""
    num_workers: int = 0
    """DataLoader worker processes (tokenization runs in them)."""
    num_threads: int | None = 1
    """``torch.set_num_threads`` (null: the CPUs this process may use; 2 threads collapse on a shared 2-core
    machine)."""
    log_every: int = 50
    """Updates between logged metrics (``metrics.jsonl``, wandb)."""
    save_every: int = 500
    """Updates between checkpoints (and validation losses)."""
    resume: bool = True
    """Resume from ``<out_dir>/checkpoints/last.json`` when it exists."""
    amp_bf16: bool = False
    """bf16 autocast (GPU)."""
    compile: bool = False
    """``torch.compile`` the denoiser and the observation encoder (GPU)."""
    seed: int = 0
    """Seed of the data order, the noise and the timesteps (the root config sets it to the job's ``seed``)."""
    progress: bool = True
    """Show a progress bar."""
    desc: str = "train"
    """The progress bar's label (which policy is trained)."""
    val_batches: int = 8
    """Held-out batches for the validation loss at each checkpoint (with a validation set)."""
    out_dir: str | None = None
    """``scripts/train.py``: the run directory (null: Hydra's run dir; a fixed dir resumes an interrupted run)."""
    init_from: str | None = None
    """``scripts/train.py``: a ``pretrained_model`` dir to fine-tune instead of building a fresh policy."""
    episodes: EpisodeFilter = field(default_factory=EpisodeFilter)
    """``scripts/train.py``: which store episodes to train on (tasks from ``task.tasks``)."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging."""
    bench: dict[str, Any] = field(default_factory=_bench_defaults)
    """``scripts/bench_policy.py``'s settings (free-form: it reads them as a whole)."""


_TRAIN_RULES = {
    "steps": POS, "batch_size": POS, "lr": number(0, open_lo=True), "weight_decay": number(0),
    "betas": lambda v: None if isinstance(v, list | tuple) and len(v) == 2 and all(
        number(0, 1)(b) is None for b in v) else "two numbers in [0, 1]",
    "warmup_steps": integer(0), "grad_clip": number(0, open_lo=True), "ema": boolean,
    "ema_power": number(0, open_lo=True), "ema_max_decay": number(0, 1), "num_workers": integer(0),
    "num_threads": optional(integer(0)), "log_every": POS, "save_every": POS, "resume": boolean,
    "amp_bf16": boolean, "compile": boolean, "seed": integer(0), "progress": boolean, "val_batches": integer(0),
}
EpisodeFilter._group, EpisodeFilter._rules = "train.episodes", {"is_demo": optional(boolean),
                                                                "success": optional(boolean)}
WandbConfig._group, WandbConfig._rules = "train.wandb", {"enabled": boolean,
                                                         "mode": one_of("offline", "online", "disabled")}
TrainConfig._group, TrainConfig._rules = "train", _TRAIN_RULES
TrainConfig._nested = {"episodes": EpisodeFilter, "wandb": WandbConfig}
