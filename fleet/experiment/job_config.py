"""The main job's typed config: Hydra's config group ``job``, and the one place its defaults live.

:class:`JobConfig` is registered in Hydra's ConfigStore as ``job/default`` (:mod:`configs.typed`), so an unknown
key (``job.base_stpes=10``) or a wrong type is refused while the config is composed, naming the key, and a value
out of range by ``configs.schema.check`` before any work. The job's stages (:mod:`fleet.experiment`) read it
through :meth:`JobConfig.from_dict`, so a key a caller leaves out takes the value below.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from configs.rules import POS, TypedConfig, boolean, int_list, integer, names, number, one_of, optional

DEFAULT_ARMS = ("base", "filtered_bc_retries", "fert", "fert_critic", "fert_onnx")


@dataclass
class JobConfig(TypedConfig):
    """The main job (``scripts/run.py``): per experiment seed, demonstrations -> base policies -> fleet rounds
    (a fixed plan + failure retries + in-loop FERT learners) -> offline arms -> held-out evaluation; then tables
    over the seeds.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) listing every value out of its range,
            ``job.<key>: expected ..., given ...``, or naming an unknown key.
    """

    seeds: list[int] = field(default_factory=lambda: [0])
    """Experiment seeds; each redraws the demonstrations' noise, the base, the fleet, the retries and the
    fine-tuning."""
    demos_per_task: int = 10
    """Successful scripted-expert demonstrations per task, exactly (the only expert data)."""
    demo_noise_std: float = 0.1
    """Gaussian noise on the expert's actions while collecting demonstrations (diversity), in action units."""
    base_steps: int = 2000
    """Optimizer updates of the base policies at most (demonstrations only); which saved checkpoint (every
    ``train.save_every`` steps) is the base: ``base_select``."""
    base_select: str = "val_loss"
    """val_loss: the saved base checkpoint with the lowest validation loss on the held-out demonstrations |
    success: the most successes on a fixed plan of training-unit trials (the plateau of training-unit success,
    not of the loss)."""
    base_select_trials_per_task: int = 10
    """``base_select=success``: trials per task per checkpoint (fleet units, plan seed 6000 + seed)."""
    val_demos_per_task: int = 2
    """Held-out demonstrations per task for the base's validation loss (their own store; 0: the last step)."""
    fleet_episodes_per_unit: int = 15
    """Fleet episodes per unit per round, from a fixed plan (tasks round-robin): 16 units x 15 = 240."""
    arms: list[str] = field(default_factory=lambda: list(DEFAULT_ARMS))
    """The compared arms (``fleet.experiment.arms.ARMS``). fert: the newest version's weights alone (K = 1);
    fert_critic: the same version with its success critic; fert_onnx: fert's export run by the deploy runtime's
    ONNX graph, as a robot runs it. The full ablation set: ``experiment=fleet_ablations``."""
    fleet_backend: str = "vector"
    """vector: the round's fleet episodes and retries step every unit's env in batches with one policy call per
    step (``fleet.experiment.protocol.VectorFleet``) | ray: one Ray actor per unit."""
    fleet_critic: bool = True
    """The round's fleet and retries act with the newest version's success critic (K = the critic's candidates);
    false: its weights alone (K = 1), so the critic relabels the states the policy itself reaches (vector backend
    only)."""
    overlap_offline_arms: bool = True
    """The offline arms (filtered BC + retries, ...) train in a process of their own beside the last round's
    learner, once the store is final (1 thread each: the same weights)."""
    curve_trials_per_task: int = 50
    """The learning curve: every published version on the held-out plan, K = 1 and with its critic, this many
    trials per task (0: no curve)."""
    background_curve: bool = True
    """A round's new versions are evaluated for the curve in a process of its own (nice 10) while the next round
    works (``fleet.experiment.curve.BackgroundCurve``); false: before it starts."""
    videos: int = 2
    """Rollout videos per arm kind (successes and failures) from held-out units."""
    video_episodes: int = 8
    """Held-out episodes rendered at most per arm while looking for those videos."""
    fleet_sizes: list[int] | None = None
    """E.g. ``[1, 2, 4]``: after the first seed, the main loop again per fleet size (units from
    ``robot.train_units``; ``fleet.experiment.sweep``), fert (K = 1) and filtered BC per size on the held-out units
    -> ``fleet_size.md/json``, ``success_vs_fleet_size.png`` (null: no sweep)."""
    sweep_episodes_per_unit: int = 20
    """Fleet-size sweep: episodes each unit runs per round, exactly (a fixed collection per robot)."""


JobConfig._group, JobConfig._rules = "job", {
    "seeds": int_list(0), "demos_per_task": POS, "demo_noise_std": number(0), "base_steps": POS,
    "base_select": one_of("val_loss", "success"), "base_select_trials_per_task": POS,
    "val_demos_per_task": integer(0), "fleet_episodes_per_unit": POS,
    "arms": names,
    "fleet_backend": one_of("vector", "ray"), "fleet_critic": boolean, "overlap_offline_arms": boolean,
    "curve_trials_per_task": integer(0), "background_curve": boolean, "videos": integer(0),
    "video_episodes": integer(0), "fleet_sizes": optional(int_list(1)), "sweep_episodes_per_unit": POS}
