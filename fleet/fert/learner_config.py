"""The FERT learner's typed config: Hydra's config group ``learner``, and the one place its defaults live.

:class:`LearnerConfig` is registered in Hydra's ConfigStore as ``learner/default`` (:mod:`configs.typed`), so the
composed job config's ``learner`` node is typed: an unknown key (``learner.updates_per_versoin=5``) or a value of
the wrong type (``learner.lr=fast``) is refused by Hydra when the config is composed, naming the key, and a value
out of range by :meth:`LearnerConfig.problems` in ``configs.schema.check`` before any work. The learner
(:class:`fleet.fert.learner.FertLearner`), the gate (:mod:`fleet.fert.gate`) and the rounds (:mod:`fleet.experiment.rounds`)
read the group through :meth:`LearnerConfig.from_dict`, so a key a caller leaves out takes the value below (the
pattern of LeRobot's ``configuration_diffusion.py``: a dataclass with a docstring per field).
"""

from __future__ import annotations

from dataclasses import dataclass

from configs.rules import POS, TypedConfig, boolean, integer, number, one_of, optional

ROUND_INIT = ("published", "base", "continue")
AFTER_REJECT = ("published", "candidate")
TASK_CORRECTION = ("none", "holm")


@dataclass
class LearnerConfig(TypedConfig):
    """The FERT learner (``fleet/fert/learner.py``): how much it trains a round, what it waits for, and the gate that
    decides whether the fleet gets the round's weights. Units: seconds where a name ends in ``_s``; success
    differences as fractions of trials (0.05 = 5 points). Raises :class:`configs.rules.ConfigError` (a
    ``ValueError``) listing every value out of its range, ``learner.<key>: expected ..., given ...``."""

    updates_per_version: int = 1500
    """Optimizer updates per FERT round (every fine-tuned arm gets rounds x this). 600 with WiSE 0.5 left the policy
    alone 15-19 points under its critic, 1,500 raw weights 5 (docs/RESULTS.md, experiment 28 D)."""
    min_new_episodes: int = 30
    """Fleet episodes committed since the last round before the next round starts."""
    poll_s: float = 1.0
    """Store polling period while waiting for fleet data, seconds."""
    max_wait_s: float = 300.0
    """Stop waiting for new fleet data after this long and run the round on what exists, seconds."""
    lr: float = 3.0e-4
    """Fine-tuning learning rate (AdamW; 1e-4 for 400 updates barely moved the base)."""
    warmup_steps: int = 0
    """Linear learning-rate warm-up steps of each round's fine-tuning."""
    batch_size: int = 64
    """Fine-tuning batch size (windows)."""
    device: str = "auto"
    """auto (CUDA when present) | cpu | cuda."""
    torch_threads: int | None = 1
    """CPU threads for training (null: torch's default); the fleet's workers use the other cores."""
    wise_alpha: float | None = None
    """WiSE-FT (Wortsman et al., 2022): publish init + alpha (fine-tuned - init), 0..1; null: the fine-tuned weights.
    0.5 measured best for one long run (experiments 10-12, round_init continue); in compounding rounds the raw
    weights of each round, per-task gated, fit the critic's choices far better (experiment 28 D: the policy alone
    94.7 % against 81.3 %)."""
    validate_trials_per_task: int = 30
    """The publishing learner's gate: candidates against the current version on a fixed plan of training-unit
    trials (0: off). The best candidate is published unless worse than ``-validate_tolerance`` (30: ~45 s a round on
    2 cores; 10 left a 3-point loss unseen)."""
    round_init: str = "published"
    """published: every round starts from the version the fleet runs now, fits the success critic first and distils
    its choices into the weights (``fert.distill``, PA-RL, Mark et al. 2024), and the gate compares the policies
    alone (K = 1); base: the same round, but every round starts from the loop's initial weights (the base) and
    trains on the whole store (no version inherits a predecessor's drift; docs/RESULTS.md, experiments 37 and 40);
    continue: one long fine-tuning run over the rounds with the critic fitted after it (experiments 1-25)."""
    after_reject: str = "published"
    """published mode, the round after a rejected one starts from: published: the version the fleet runs (the
    rejection resets the lineage) | candidate: the rejected round's own weights (training compounds; the gate still
    decides what the fleet runs)."""
    validate_task_tolerance: float | None = 0.1
    """published mode: a task whose paired validation success falls by more than this (and the one-sided McNemar
    test at ``validate_alpha`` agrees) rejects the round (null: off)."""
    validate_task_correction: str = "none"
    """none: each task's test at ``validate_alpha`` | holm: Holm's step-down over the tasks (family-wise
    ``validate_alpha``; with 10 tasks at 0.1 each some task "loses" by chance in up to 65 % of rounds: mw10's
    +6.0-point candidate was rejected on 0 / 4, experiment 33)."""
    validate_critic_only: bool = True
    """continue mode only; candidates: the fine-tuned weights + the round's critic, and the current weights + the
    same critic (the gate publishes the better on the plan; ties: fine-tuned)."""
    validate_tolerance: float = 0.05
    """A candidate is rejected only when worse than this (paired success fraction) ..."""
    validate_alpha: float = 0.1
    """... and the one-sided exact McNemar test says worse at p < validate_alpha."""
    failure_replay: bool = False
    """After each round, the new weights replay the round's failed fleet trials (same units and reset seeds, no
    exploration): how many of the fleet's failures the update solves."""
    seed: int = 0
    """The fine-tuning seed: round r trains with seed 1000 * seed + r (data order, noise, timesteps). The main job
    sets it per arm to the job's seed (``job.seeds``)."""


_RULES = {
    "updates_per_version": POS, "min_new_episodes": integer(0), "poll_s": number(0, open_lo=True),
    "max_wait_s": number(0), "lr": number(0, open_lo=True), "warmup_steps": integer(0), "batch_size": POS,
    "device": one_of("auto", "cpu", "cuda"), "torch_threads": optional(POS), "wise_alpha": optional(number(0, 1)),
    "validate_trials_per_task": integer(0), "round_init": one_of(*ROUND_INIT), "after_reject": one_of(*AFTER_REJECT),
    "validate_task_tolerance": optional(number(0, 1)), "validate_task_correction": one_of(*TASK_CORRECTION),
    "validate_critic_only": boolean, "validate_tolerance": number(0, 1), "validate_alpha": number(0, 1),
    "failure_replay": boolean, "seed": integer(0),
}

LearnerConfig._group, LearnerConfig._rules = "learner", _RULES
