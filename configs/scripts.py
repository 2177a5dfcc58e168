"""The scripts' typed config groups: ``chaos``, ``async_run``, ``ablate``, ``compare`` and ``sim``.

Each is a dataclass registered in Hydra's ConfigStore (:mod:`configs.typed`) and the one place its defaults live,
like LeRobot's ``configs/train.py`` and ``configs/eval.py`` for its own scripts: an unknown key or a wrong type is
refused while composing, a value out of range by ``configs.schema.check``. Each script reads its group through
``<Config>.from_dict``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, POS_NUMBER, TypedConfig, boolean, int_list, integer, names, number, optional

CHAOS_POLICY = {"dim": 64, "n_layers": 2, "n_heads": 2, "state_hidden": 64, "num_inference_steps": 4}
ABLATE_ARMS = ("filtered_bc_retries", "fert", "fert_no_retries", "fert_no_gate", "fert_abs_key")


@dataclass
class ChaosConfig(TypedConfig):
    """``scripts/chaos.py``: a fleet with the FERT learner and the policy server under random SIGKILLs (local
    processes); every committed episode and published version is verified afterwards."""

    kills: int = 100
    """SIGKILLs in all (workers, the learner, the policy server)."""
    interval_s: float = 4.0
    """Pause between kills, seconds (a target still restarting is skipped, not counted)."""
    max_wall_s: float = 1500.0
    """Stop killing after this many seconds even if fewer kills landed."""
    targets: dict[str, float] = field(default_factory=lambda: {"worker": 0.6, "learner": 0.2, "server": 0.2})
    """Relative odds of each kind of target: ``worker``, ``learner``, ``server``."""
    units: int = 2
    """Simulated units (each its own Ray worker process)."""
    tasks: list[str] = field(default_factory=lambda: ["reach-v3"])
    """Tasks the fleet plays."""
    max_episode_steps: int = 60
    """Short episodes: many commits per minute."""
    demos_per_task: int = 4
    """Scripted-expert demonstrations per task for the tiny base."""
    base_steps: int = 40
    """The tiny base policy's training steps (what matters here is the machinery, not skill)."""
    learner_updates: int = 10
    """Updates per learner round (it publishes a version each round)."""
    settle_s: float = 20.0
    """After the last kill: seconds for every process to come back and commit again before the stop."""
    policy: dict[str, Any] = field(default_factory=lambda: dict(CHAOS_POLICY))
    """The tiny policy's overrides of ``policy/aed_diffusion``."""


ChaosConfig._group, ChaosConfig._rules = "chaos", {
    "kills": integer(0), "interval_s": POS_NUMBER, "max_wall_s": POS_NUMBER, "units": POS, "tasks": names,
    "targets": lambda v: None if isinstance(v, Mapping) and v and set(v) <= {"worker", "learner", "server"}
    and all(isinstance(x, int | float) and x >= 0 for x in v.values()) and sum(v.values()) > 0
    else "a mapping of worker / learner / server to odds >= 0, not all 0",
    "max_episode_steps": POS, "demos_per_task": POS, "base_steps": POS, "learner_updates": POS,
    "settle_s": number(0)}


@dataclass
class AsyncRunConfig(TypedConfig):
    """``scripts/async_run.py``: a finished synchronous job's seed run again with the learner beside a working
    fleet. The fleet never waits for training: it plays round after round of its plan (the synchronous job's
    ``fleet_plan``, then its failure retries) in waves, and picks up the newest published version before every
    wave; the learner (its own process) starts a round whenever enough new fleet episodes are in."""

    from_dir: str | None = None
    """Required: the synchronous job's seed directory (``<run dir>/seed_<s>``): its config, demonstrations and
    base (v1) are reused, and its fert arm is the comparison."""
    learner_rounds: int | None = None
    """Learner rounds to run (null: the synchronous job's ``fert.rounds``)."""
    min_new_episodes: int | None = None
    """New fleet episodes before a learner round starts (null: one synchronous round's fleet episodes,
    ``fleet.units`` x ``job.fleet_episodes_per_unit``)."""
    wave: int = 64
    """Fleet trials per wave: every wave acts with the newest version at its start."""
    max_wall_s: float = 7200.0
    """The learner and the fleet are stopped after this many seconds (the run still reports)."""


AsyncRunConfig._group, AsyncRunConfig._rules = "async_run", {
    "learner_rounds": optional(integer(1)), "min_new_episodes": optional(integer(1)), "wave": POS,
    "max_wall_s": POS_NUMBER}


@dataclass
class FleetSizeConfig(TypedConfig):
    """``scripts/fleet_size.py``: the fleet-size sweep on a finished seed (the seed paper's figure): the main loop
    once per fleet size, from the seed's demonstrations, base and (with ``labels.source: detector``) detector, every
    unit running the same episodes per round; each size's ``fert`` (K = 1) and filtered BC + retries on the held-out
    plan (``fleet.experiment.sweep.fleet_size_sweep``)."""

    from_dir: str | None = None
    """Required: the finished seed directory (``<run dir>/seed_<s>``): its config, demonstrations, base, detector."""
    sizes: list[int] = field(default_factory=lambda: [4, 16, 64])
    """Fleet sizes, units each (the first n of ``train_units``)."""
    train_units: Any = "0:64"
    """The training units the sizes draw from (a list or ``"start:stop"``; disjoint from the held-out units)."""
    episodes_per_unit: int | None = None
    """Episodes each unit runs per round (null: the seed's ``job.fleet_episodes_per_unit``)."""


FleetSizeConfig._group, FleetSizeConfig._rules = "fleet_size", {
    "sizes": int_list(1), "episodes_per_unit": optional(POS)}


@dataclass
class AblateConfig(TypedConfig):
    """``scripts/ablate.py``: fine-tune arm variants on a frozen fleet store and evaluate them paired, without
    running the fleet again. Every ``fert.*`` / ``learner.*`` override on the command line applies to the
    variants."""

    run_dir: str | None = None
    """A finished ``scripts/run.py`` seed directory (``<run dir>/seed_<s>``): its store and bases."""
    arms: list[str] = field(default_factory=lambda: list(ABLATE_ARMS))
    """The variants (``fleet.experiment.arms.ARMS`` names)."""
    baseline: str = "base"
    """Every variant is paired against this arm (and against filtered_bc_retries)."""
    seeds: list[int] = field(default_factory=lambda: [0])
    """Fine-tuning seeds; intervals bootstrap over them, then over trials."""
    eval_seed: int | None = None
    """Held-out trial plan seed (null: the frozen run's ``eval.seed``); use a development plan of your own when
    iterating, so the run's test trials stay unseen."""
    pool: list[str] | None = None
    """Finished ablation directories: pool them (each ``<dir>/seed_<s>`` one bootstrap unit) instead of running."""
    reexplore: bool = False
    """Explore the frozen run's failures again with this command line's ``fert.retry`` into a new store
    (``<output dir>/store``) and train the arms on it (``fleet.experiment.protocol.reexplore``)."""


AblateConfig._group, AblateConfig._rules = "ablate", {
    "arms": names, "seeds": int_list(0), "eval_seed": optional(integer(0)), "pool": optional(names),
    "reexplore": boolean}


@dataclass
class CompareConfig(TypedConfig):
    """``scripts/compare_policies.py``: policy variants trained as base policies on the same demonstrations and
    evaluated on the same held-out trials."""

    variants: Any = None
    """``{name: {policy field: value}}`` merged over the composed ``policy`` node (``{}``: the policy as
    configured); null: ``{current: {}, earlier_form: {action_patch: 1, condition_layers: null}}`` (the state
    policy's denoiser before experiment 23, docs/RESULTS.md). Typed Any, so a command-line mapping merges."""
    baseline: str = "earlier_form"
    """Every other variant is paired against this one."""


CompareConfig._group, CompareConfig._rules = "compare", {
    "variants": lambda v: None if v is None or isinstance(v, Mapping) else "null or a mapping {name: overrides}"}


@dataclass
class SimCheckConfig(TypedConfig):
    """``scripts/sim_check.py``: the scripted experts' success table per unit and a PNG of the units."""

    units: Any = None
    """Units for the expert table, a list or ``"start:stop"``; null: ``robot.train_units`` + ``robot.heldout_units``."""
    episodes: int = 5
    """Expert episodes per (task, unit); reset seeds 0 .. episodes - 1."""
    noise_std: float = 0.0
    """Gaussian noise on the expert's actions, in action units."""
    latency_compensation: bool = False
    """Smith-predicted hand position for the experts (``sim/experts.py``)."""
    render_task: str | None = None
    """Task shown in the PNG; null: the suite's first task."""
    render_units: int = 8
    """How many units the PNG shows (training units first, then held-out)."""
    render_size: int = 160
    """PNG tile size, pixels."""


SimCheckConfig._group, SimCheckConfig._rules = "sim.check", {
    "episodes": POS, "noise_std": number(0), "latency_compensation": boolean, "render_units": POS,
    "render_size": POS}


@dataclass
class SimBenchConfig(TypedConfig):
    """``scripts/bench_sim.py``: env steps per second, state-only and with a camera, and raw ``mj_step`` calls."""

    state_steps: int = 1000
    """Env steps timed state-only, per task."""
    image_steps: int = 300
    """Env steps timed with one camera, per task."""
    image_size: int = 96
    """Rendered image side, pixels."""
    camera: str = "corner"
    """The camera rendered."""
    raw_steps: int = 5000
    """Raw ``mj_step`` calls timed, per task."""
    out: str | None = None
    """JSON path; null: ``<output_dir>/bench_sim.json``."""


SimBenchConfig._group, SimBenchConfig._rules = "sim.bench", {
    "state_steps": POS, "image_steps": POS, "image_size": POS, "raw_steps": POS}


@dataclass
class SimConfig(TypedConfig):
    """Settings of the sim scripts (``scripts/sim_check.py``, ``scripts/bench_sim.py``). The suite comes from
    ``task``, the units from ``robot``, cameras and image size from ``obs``."""

    check: SimCheckConfig = field(default_factory=SimCheckConfig)
    """``scripts/sim_check.py``."""
    bench: SimBenchConfig = field(default_factory=SimBenchConfig)
    """``scripts/bench_sim.py``."""


SimConfig._group, SimConfig._nested = "sim", {"check": SimCheckConfig, "bench": SimBenchConfig}
