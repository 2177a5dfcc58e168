"""The ``steer`` config group: fitting a noise actor (``scripts/steer.py``, ``policies.noise_actor``). Kept apart
from the actor so that composing a config loads no torch."""

from __future__ import annotations

from dataclasses import dataclass

from configs.rules import POS, TypedConfig, integer, number, optional


@dataclass
class SteerConfig(TypedConfig):
    """Fitting a noise actor (``scripts/steer.py``, :func:`fit_noise_actor`). Raises :class:`ConfigError`
    listing every value out of range."""

    checkpoint: str | None = None
    """The policy to steer: a ``pretrained_model`` directory with its success critic (``critic.safetensors``)."""
    critic: str | None = None
    """A directory holding the success critic to steer against (``critic.safetensors``); null: the checkpoint's
    own."""
    out_dir: str | None = None
    """Where the steered checkpoint goes (the policy's files without the critic, plus the actor); null: the run
    dir's ``steered/``."""
    states_per_task: int = 256
    """Fleet states per task the actor is trained on (``policies.distill.balanced_anchors``)."""
    updates: int = 1500
    """Adam updates of the actor."""
    batch_size: int = 64
    """States per update."""
    lr: float = 1.0e-3
    """Adam learning rate."""
    hidden: int = 256
    """The actor's width."""
    bound: float = 2.0
    """Each noise coordinate in (-bound, bound)."""
    pessimism: float = 1.0
    """The objective is the critic members' mean success probability minus this times their std."""
    num_inference_steps: int | None = None
    """DDIM steps of the chain the gradient goes through (null: the policy's own)."""
    seed: int = 0
    """States' draw and the actor's initialisation."""


_STEER_RULES = {"states_per_task": POS, "updates": POS, "batch_size": POS, "lr": number(0, open_lo=True),
                "hidden": POS, "bound": number(0, open_lo=True), "pessimism": number(0),
                "num_inference_steps": optional(POS), "seed": integer(0)}
SteerConfig._group, SteerConfig._rules = "steer", _STEER_RULES
