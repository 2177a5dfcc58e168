"""The fleet's typed config: Hydra's config group ``fleet``, and the one place its defaults live.

:class:`FleetConfig` is registered in Hydra's ConfigStore as ``fleet/default`` (:mod:`configs.typed`): an unknown
key or a wrong type is refused while composing, a value out of range by ``configs.schema.check``. The Ray runtime
(``fleet.coordinator.Fleet``, its supervisor, workers, policy server and budgets) reads it through
:meth:`FleetConfig.from_dict`, so a key a caller leaves out takes the value below. ``fleet.ray_address=auto``
joins a running cluster; the default is a local Ray instance on this machine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from configs.rules import POS, POS_NUMBER, TypedConfig, boolean, integer, number, one_of, optional


@dataclass
class FleetConfig(TypedConfig):
    """The simulated fleet on Ray (``fleet/coordinator.py``): one Ray actor per robot unit, each with its envs,
    its store writer and its acting policy, optionally one policy server for batched inference.

    Raises:
        configs.rules.ConfigError: (a ``ValueError``) listing every value out of its range,
            ``fleet.<key>: expected ..., given ...``, or naming an unknown key.
    """

    ray_address: str | None = None
    """null: start a local Ray instance; ``"auto"``: join a running cluster; or ``"ray://host:port"``."""
    runtime_env: Any = None
    """A cluster only, e.g. ``{working_dir: .}`` when the nodes lack the code."""
    num_cpus: int | None = None
    """CPUs for the local Ray instance (null: all)."""
    log_to_driver: bool = True
    """Forward the workers' stdout / stderr to the driver."""
    head_lost_after_s: float = 10.0
    """A joined cluster (``ray_address`` set): the head unreachable this long ends the run at once, with one line,
    the partial results and the resume command (exit 3), seconds; 0: never watch."""
    units: int = 16
    """Training units run at once (the first N of ``robot.train_units``; the main job's fleet: 16 units x
    ``job.fleet_episodes_per_unit``, docs/RESULTS.md experiment 14)."""
    tasks_per_unit: int | None = None
    """null: every unit runs every task of the suite; k: k tasks per unit, spread evenly."""
    episodes_per_unit: int | None = 4
    """Budget per unit (``scripts/rollout.py``); null: run on ``wall_time_s`` alone."""
    wall_time_s: float | None = None
    """No new episode starts after this many seconds (null: no limit)."""
    episode_timeout_s: float | None = 120.0
    """A unit whose episode takes longer is killed and restarted (the episode dropped), seconds (null: never)."""
    shard_wait_s: float = 30.0
    """A unit whose store shard is held by another live process waits this long, then refuses (WriterBusyError:
    one line, exit 2), seconds; a killed predecessor's lock frees in a few seconds."""
    max_restarts: int = 3
    """Ray restarts of a worker / the policy server before the coordinator re-creates it (-1: unlimited)."""
    max_recreates: int = 2
    """Re-creations of a unit's worker by the coordinator before the unit is given up."""
    max_trial_faults: int = 3
    """Trials in a row that commit nothing (an error in the env or the policy, a NaN at step 0): the unit is given
    up."""
    trial_retries: int = 1
    """A planned trial that committed nothing is run again this many times, then counted failed."""
    worker_cpus: float | None = None
    """Ray CPUs per worker (null: min(1, cluster CPUs / units), so N units fit on few cores)."""
    worker_resources: dict[str, float] = field(default_factory=dict)
    """Custom Ray resources each worker asks for (a cluster: e.g. ``{sim: 1}`` on the simulation nodes)."""
    placement: str = "pack"
    """pack: Ray's default placement | spread: workers spread over the cluster's nodes."""
    torch_threads: int = 1
    """Torch threads per worker (local inference)."""
    expert_noise_std: float = 0.0
    """Gaussian noise on the scripted expert's actions, in action units."""
    registry_url: str = "outputs/registry"
    """The checkpoint registry the fleet acts from and the learner publishes to."""
    checkpoint: str | None = None
    """A checkpoint directory to act with (null: the registry)."""
    policy_version: Any = "latest"
    """Registry version to act with: ``"latest"`` follows new versions between episodes; or an int."""
    cache_dir: str = "/tmp/fleet_cache"
    """Where workers unpack fetched checkpoints."""
    device: str = "cpu"
    """Local inference device of the workers."""
    policy_server: Any = "auto"
    """Batch inference in one actor instead of per worker: true | false | auto (a server when ``server_device``
    resolves to cuda; on CPU per-worker inference, whose noise follows the episode seed, so fleet episodes are
    reproducible)."""
    server_device: str = "auto"
    """The policy server's device (auto: cuda when present)."""
    server_max_batch: int = 64
    """The policy server's largest batch."""
    server_max_wait_ms: float = 1.0
    """How long a batch's first request waits for company, milliseconds."""
    server_retry_s: float = 60.0
    """How long a worker retries while the policy server restarts, seconds."""


FleetConfig._group, FleetConfig._rules = "fleet", {
    "num_cpus": optional(POS), "log_to_driver": boolean, "head_lost_after_s": number(0), "units": POS,
    "tasks_per_unit": optional(POS), "episodes_per_unit": optional(POS), "wall_time_s": optional(POS_NUMBER),
    "episode_timeout_s": optional(POS_NUMBER), "shard_wait_s": number(0), "max_restarts": integer(-1),
    "max_recreates": integer(0), "max_trial_faults": POS, "trial_retries": integer(0),
    "worker_cpus": optional(POS_NUMBER),
    "worker_resources": lambda v: None if isinstance(v, Mapping) else "a mapping {resource: amount}",
    "placement": one_of("pack", "spread"), "torch_threads": POS, "expert_noise_std": number(0),
    "policy_version": lambda v: None if v == "latest" or integer(1)(v) is None else "'latest' or an integer >= 1",
    "policy_server": lambda v: None if v in (True, False, "auto") else "true, false or 'auto'",
    "server_max_batch": POS, "server_max_wait_ms": number(0), "server_retry_s": number(0)}
