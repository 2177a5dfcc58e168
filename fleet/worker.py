"""Robot worker: one Ray actor per robot unit, running episodes and committing each one to the store.

A worker owns its unit's envs (one per task, made lazily with ``sim.make_env``), its own store writer shard
(writer id ``unit-<id:04d>``: one writer per shard, as zarr 3 needs) and its acting policy. Episodes are run in
small batches (``run_episodes(n)``) so the coordinator can watch progress, enforce timeouts and restart it.

Restart semantics: a restarted worker (Ray ``max_restarts``, or re-created by the coordinator) re-opens its
writer, which recovers the shard (the half-written episode of the dead process is dropped), and continues its
episode count from the episodes of its unit already committed in the store, so seeds are not repeated and
nothing committed is lost.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from fleet.acting import (
    ChunkQueuePolicy,
    ExpertPolicy,
    RandomPolicy,
    TorchPolicy,
    load_checkpoint,
    policy_input_shapes,
    resolve_device,
)
from fleet.fleet_config import FleetConfig
from fleet.rollout import rollout


class WorkerEpisodeError(RuntimeError):
    """An exception inside a worker's episode (env, policy), carried as text; the episode was dropped."""


class PolicyLoadError(RuntimeError):
    """The unit cannot build its acting policy (e.g. a checkpoint of the wrong shape for this robot's
    features): every trial would fail the same way, so the run stops once, with this message, instead of
    restarting the worker."""


# terminations that are faults (``EpisodeMeta.termination``): such an episode is never a success
FAULTS = ("non_finite_observation", "non_finite_action", "non_finite_reward", "sim_unstable", "error")


def writer_id(unit_id: int) -> str:
    """The store shard / writer id of a unit: ``unit-0003``."""
    return f"unit-{int(unit_id):04d}"


def episode_seed(base_seed: int, unit_id: int, episode_index: int) -> int:
    """Reset seed of a unit's ``episode_index``-th episode; distinct across units (< 10^6 episodes/unit)."""
    return int((int(base_seed) * 1_000_000_007 + int(unit_id) * 1_000_000 + int(episode_index)) % (2**31 - 1))


def retry_noise_seed(seed: int, attempt: int) -> int:
    """Seed of a failure retry's denoising noise: ``seed * 1009 + attempt + 1`` (a retry draws fresh noise, and
    each attempt its own; ``RobotWorker`` seeds torch with it, ``fleet.experiment.evaluation`` a retry's generator)."""
    return int(seed) * 1009 + int(attempt) + 1


class Exploration:
    """Failure-guided exploration of one retry episode: temporally correlated action noise and/or a higher
    temperature of the policy's initial denoising noise.

    The end-effector dimensions (the first ``dims`` of the action) get Gaussian noise of std
    ``action_noise_std`` (action units: 1 = 1 cm per step on Meta-World) that is redrawn every ``hold_steps``
    control steps and held in between, so a retry moves the hand to a different place instead of jittering
    around the policy's own path (a cheap stand-in for the modal-level exploration of SIME, "Enhancing Policy
    Self-Improvement with Modal-level Exploration", 2025). The noise is a function of (reset seed, attempt,
    step): a retry is reproducible. Actions are clipped to [-1, 1] after the noise. The stored action is the
    executed one, noise included.

    ``noise_temperature`` (modal-level exploration): the policy samples every chunk of the episode from initial
    denoising noise scaled by this factor (``AEDDiffusionPolicy.predict_action_chunk(noise_scale=)``), so the
    retry's actions are the denoiser's own outputs, whole chunks drawn farther from its usual mode, rather than
    the policy's action plus noise it never produced (SIME, 2025, explores at the level of modes for this
    reason). 1.0: the trained sampler.

    Args:
        action_noise_std: >= 0, action units. hold_steps: >= 1. retry_of: episode id re-attempted (or None).
        attempt: 0-based attempt number of this retry. dims: leading action dimensions perturbed (>= 0).
        noise_temperature: > 0, the initial denoising noise's scale.

    Raises:
        ValueError: a negative or non-finite std, ``hold_steps < 1``, ``dims < 0`` or a non-positive or
            non-finite temperature.
    """

    def __init__(self, action_noise_std: float = 0.3, hold_steps: int = 8, retry_of: str | None = None,
                 attempt: int = 0, dims: int = 3, noise_temperature: float = 1.0):
        if not np.isfinite(action_noise_std) or action_noise_std < 0:
            raise ValueError(f"exploration action_noise_std: expected a finite value >= 0, given {action_noise_std}")
        if int(hold_steps) < 1 or int(dims) < 0:
            raise ValueError(f"exploration: expected hold_steps >= 1 and dims >= 0, given {hold_steps}, {dims}")
        if not np.isfinite(noise_temperature) or noise_temperature <= 0:
            raise ValueError(f"exploration noise_temperature: expected a finite value > 0, given {noise_temperature}")
        self.std, self.hold, self.retry_of = float(action_noise_std), int(hold_steps), retry_of
        self.attempt, self.dims, self.temperature = int(attempt), int(dims), float(noise_temperature)
        self._noise: np.ndarray | None = None

    @classmethod
    def from_dict(cls, d: dict) -> Exploration:
        """From ``{"action_noise_std", "hold_steps", "retry_of", "attempt", "dims", "noise_temperature"}`` (missing
        keys default).

        Raises ValueError on unknown keys."""
        names = {"action_noise_std", "hold_steps", "retry_of", "attempt", "dims", "noise_temperature"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"exploration: unknown keys {unknown}; expected {sorted(names)}")
        return cls(**d)

    def tags(self) -> dict[str, Any]:
        """Store metadata of the retry: ``{"retry_of", "attempt", "exploration": {"action_noise_std", "hold_steps",
        "noise_temperature"}}``."""
        return {"retry_of": self.retry_of, "attempt": self.attempt,
                "exploration": {"action_noise_std": self.std, "hold_steps": self.hold,
                                "noise_temperature": self.temperature}}

    def perturb(self, action: np.ndarray, step: int, seed: int) -> np.ndarray:
        """(A,) float32 action + the held noise of ``step`` on the first ``dims`` entries, clipped to [-1, 1]."""
        a = np.asarray(action, np.float32).copy()
        if self.std == 0.0:
            return a
        if step % self.hold == 0 or self._noise is None:
            rng = np.random.default_rng([int(seed), self.attempt, int(step) // self.hold, 7919])
            self._noise = rng.normal(0.0, self.std, size=min(self.dims, a.size)).astype(np.float32)
        a[: self._noise.size] += self._noise
        return np.clip(a, -1.0, 1.0)


class RobotWorker:
    """One robot unit (wrap with ``ray.remote``; see ``fleet.coordinator``).

    Args:
        unit_id: the robot unit id (``sim`` draws its variation from it).
        tasks: task names this unit runs (round-robin when ``run_episodes`` is not given a task).
        cfg: plain dict with keys ``robot``, ``obs``, ``task`` (Hydra groups), ``seed`` and ``fleet`` (and
            ``store``, whose ``storage_options`` this process applies).
        store_url: experience store URL (``ExperienceStore.create_or_open``).
        policy: acting policy spec: ``{"kind": "expert" | "random" | "checkpoint", "noise_std": float,
            "registry_url": str | None, "version": "latest" | int, "path": str | None, "server": actor | None,
            "device": str}``. ``kind="checkpoint"`` with ``version="latest"`` follows the registry: the newest
            version is picked up at the next episode boundary.
        is_demo: flag committed with every episode (scripted demonstrations).
        fault: test hook ``{"kind": "raise" | "hang" | "kill" | "sleep", "episode": i, "step": s,
            "once_file": path, "seconds": x}``: raise in the env / sleep forever / SIGKILL itself / sleep ``x``
            seconds at step ``s`` of this unit's ``i``-th episode, once (``once_file`` is created when it fires);
            with ``"after_commit": true`` right after that episode's commit instead; ``{"kind": "clock",
            "seconds": x}``: this host's clock runs ``x`` seconds off (the episodes' ``start_time``); ``{"kind":
            "reset_error", "task": t}``: every reset of task ``t``'s env raises; or a list of such dicts.
    """

    def __init__(self, unit_id: int, tasks: list[str], cfg: dict, store_url: str, policy: dict,
                 is_demo: bool = False, fault: dict | list[dict] | None = None):
        if not tasks:
            raise ValueError(f"RobotWorker unit {unit_id}: empty task list")
        self.unit_id, self.tasks, self.cfg = int(unit_id), list(tasks), cfg
        self.fleet_cfg = FleetConfig.from_dict(cfg.get("fleet"))
        self.policy_cfg, self.is_demo = dict(policy), bool(is_demo)
        self.faults = [fault] if isinstance(fault, dict) else list(fault or [])
        self.clock_offset_s = sum(float(f.get("seconds", 0)) for f in self.faults if f.get("kind") == "clock")
        self.max_steps = int(cfg["task"]["max_episode_steps"])
        self.envs: dict[str, Any] = {}
        self.experts: dict[str, ExpertPolicy] = {}
        self.bad_versions: dict[int, str] = {}   # published versions that could not be loaded: why (said once)
        # every env / GL call runs on this one thread: an EGL context is current in one thread only, and the
        # actor answers progress() on a second thread while an episode runs
        self._sim_thread = ThreadPoolExecutor(1, thread_name_prefix=f"unit{self.unit_id}")
        # a store that refuses this unit (another live fleet holds its shard, a spec that does not fit) is kept and
        # reported by ready(), not raised here: an actor whose constructor raises has Ray print the whole traceback
        # from the worker's log before the coordinator can say the one-line reason
        from experience_dict.store import StoreError

        self.refusal: Exception | None = None
        self.episode_index = 0
        try:
            self._sim_thread.submit(self._open, store_url).result()
        except StoreError as e:
            self.refusal = e
        self.policy = None  # the current trained-policy acting object (None for expert/random)
        self.policy_version: int | None = None
        self.server_info: dict | None = None
        self.rng_policy = RandomPolicy(seed=episode_seed(cfg.get("seed", 0), unit_id, 0))
        self.progress_state = {"episode_index": self.episode_index, "step": 0, "task": None, "in_episode": False}
        self.cache_dir = Path(policy.get("cache_dir") or "/tmp/fleet_cache") / writer_id(self.unit_id)

    def _open(self, store_url: str) -> None:
        from experience_dict.store import ExperienceStore, configure_storage

        configure_storage({**dict(self.cfg.get("store") or {}), "url": store_url})   # this process's storage options
        spec = self._env(self.tasks[0]).spec_dict()
        self.store = ExperienceStore.create_or_open(store_url, spec=spec, control_hz=spec.get("control_hz"))
        self.writer = self._open_writer(float(self.fleet_cfg.shard_wait_s))  # recovers a crashed shard
        # resume the episode count (and so the seeds) from the shard's committed episodes, as they are now that
        # this process holds the shard (another process may have committed while this one waited for the lock)
        self.store.refresh()
        self.episode_index = len(self.store.episodes(shard=writer_id(self.unit_id), quarantined=None))

    def _open_writer(self, wait_s: float = 30.0):
        """The unit's shard writer; waits while a killed predecessor process still holds the shard lock."""
        import logging

        from experience_dict.store import WriterBusyError

        deadline, told = time.monotonic() + wait_s, False
        while True:
            try:
                return self.store.writer(writer_id(self.unit_id))
            except WriterBusyError as e:
                if not told:   # say that it waits, and for whom (the lock holder's pid and host)
                    logging.getLogger("fleetmind.worker").warning("unit %d waits up to %.0f s for its shard: %s",
                                                                  self.unit_id, wait_s, e)
                    told = True
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def _server_call(self, method: str, *args):
        """``ray.get(server.<method>.remote(*args))``, retried while the policy server restarts."""
        import ray
        from ray.exceptions import RayActorError

        deadline = time.monotonic() + float(self.fleet_cfg.server_retry_s)
        while True:
            try:
                return ray.get(getattr(self.policy_cfg["server"], method).remote(*args))
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    def _env(self, task: str):
        if task not in self.envs:
            from sim import make_env

            self.envs[task] = make_env(task=task, unit_id=self.unit_id, robot_cfg=self.cfg["robot"],
                                       obs_cfg=self.cfg["obs"], task_cfg=self.cfg["task"])
        return self.envs[task]

    # ------------------------------------------------------------------ policy
    def _acting_policy(self, task: str, seed: int):
        kind = self.policy_cfg.get("kind", "expert")
        if kind == "expert":
            if task not in self.experts:
                self.experts[task] = ExpertPolicy(self._env(task), noise_std=float(self.policy_cfg.get("noise_std", 0.0)),
                                                  seed=seed)
            self.experts[task].seed = seed
            return self.experts[task]
        if kind == "random":
            self.rng_policy.rng = np.random.default_rng(seed)
            return self.rng_policy
        if kind != "checkpoint":
            raise ValueError(f"policy kind {kind!r} unknown; expected 'expert', 'random' or 'checkpoint'")
        self._refresh_checkpoint()
        self._check_fits(task)
        # the denoising noise follows the episode seed: one policy on one seed acts the same every time
        # (local inference; a policy server draws its own noise)
        import torch

        torch.manual_seed(int(seed))
        return self.policy

    def _check_fits(self, task: str) -> None:
        """Raise ValueError (naming feature, expected and given shapes) unless the loaded policy reads features
        this unit's env has, with the same shapes, and writes actions of the env's width."""
        model = getattr(self.policy, "model", None)
        cfg = getattr(model, "config", None)
        served = getattr(self.policy, "input_shapes", None)   # a policy server's version (its info())
        if (cfg is None and served is None) or getattr(self, "_fits", None) == (self.policy_version, task):
            return
        spec = self._env(task).spec_dict()
        shapes = served if cfg is None else policy_input_shapes(cfg)
        for k, shape in shapes.items():
            if k not in spec:
                raise ValueError(f"the policy reads {k!r}, which task {task!r} on unit {self.unit_id} does not "
                                 f"have (features: {sorted(x for x in spec if x.startswith('observation.'))})")
            if list(spec[k]["shape"]) != list(shape):
                raise ValueError(f"the policy reads {k!r} of shape {list(shape)}; task {task!r} on unit "
                                 f"{self.unit_id} gives {list(spec[k]['shape'])} (a checkpoint trained for "
                                 "another robot or observation config)")
        adim = getattr(cfg, "action_dim", None) if cfg is not None else getattr(self.policy, "action_dim", None)
        if adim is not None and [int(adim)] != list(spec["action"]["shape"]):
            raise ValueError(f"the policy writes {adim}-d actions; the env takes {list(spec['action']['shape'])}")
        self._fits = (self.policy_version, task)

    def _staleness(self, version: int) -> int | None:
        """``latest published version - version`` when following ``"latest"`` (else None; None when the
        registry cannot be read)."""
        if self.policy_cfg.get("kind") != "checkpoint" or self.policy_cfg.get("path") or \
                self.policy_cfg.get("version", "latest") not in (None, "latest"):
            return None
        try:
            latest = self._wanted_version()
        except Exception:  # noqa: BLE001 - the registry or server is unreachable: unknown, not fatal
            return None
        return None if latest is None else max(0, int(latest) - int(version))

    def _wanted_version(self) -> int | None:
        """The version to act with in the next episode (None: a plain checkpoint path)."""
        v = self.policy_cfg.get("version", "latest")
        if self.policy_cfg.get("server") is not None:
            return self._server_call("latest_version") if v in (None, "latest") else int(v)
        if self.policy_cfg.get("path"):
            return None
        if v in (None, "latest"):
            from fleet.registry import CheckpointRegistry, RegistryError

            latest = CheckpointRegistry(self.policy_cfg["registry_url"]).latest_version()
            if latest is None:
                raise RegistryError(f"unit {self.unit_id}: registry {self.policy_cfg['registry_url']!r} has no "
                                   "published policy version yet")
            return latest
        return int(v)

    def _refresh_checkpoint(self) -> None:
        """Switch to the newest (or the configured) version between episodes. A newly published version that
        cannot be loaded (a file that fails its checksum, a critic that does not fit or holds NaN, ...) while the
        unit acts with an earlier one: the unit acts on with the last good version and says so once per bad
        version (the fleet keeps working; the next good version is picked up as usual).

        Raises:
            as :func:`fleet.acting.load_checkpoint`, when no earlier version is loaded or the version is fixed."""
        version = self._wanted_version()
        if self.policy is not None and (version is None or version == self.policy_version
                                        or version in self.bad_versions):
            return
        try:
            self._load_version(version)
        except Exception as e:  # noqa: BLE001 - a bad new version: the last good one acts on, said once
            following = self.policy_cfg.get("version", "latest") in (None, "latest")
            if self.policy is None or version is None or not following or self.policy_cfg.get("server") is not None:
                raise
            self.bad_versions[int(version)] = f"{type(e).__name__}: {e}"
            logging.getLogger("fleetmind.worker").warning(
                "unit %d: published policy version %d cannot be loaded (%s: %s); acting on with version %d until "
                "a newer version loads", self.unit_id, int(version), type(e).__name__, str(e)[:300],
                int(self.policy_version))

    def _load_version(self, version: int | None) -> None:
        """Build the acting policy of ``version`` (None: the configured checkpoint path) or of the policy server."""
        server = self.policy_cfg.get("server")
        if server is not None:
            info = self._server_call("info", version)
            self.policy = ChunkQueuePolicy(server, info["version"], info["window_spec"], info["n_action_steps"],
                                           info["action_dim"], retry_s=float(self.fleet_cfg.server_retry_s))
            self.policy.input_shapes = info.get("input_shapes") or {}   # what _check_fits compares with the env
            self.policy_version = info["version"]
            return
        import torch

        torch.set_num_threads(int(self.fleet_cfg.torch_threads))
        device = resolve_device(self.policy_cfg.get("device", "cpu"))
        if version is None:
            model, self.policy_version = load_checkpoint(self.policy_cfg["path"], device)
        else:
            from fleet.registry import CheckpointRegistry

            local = CheckpointRegistry(self.policy_cfg["registry_url"]).fetch(version, self.cache_dir / f"v{version:06d}")
            model, self.policy_version = load_checkpoint(local, device)
        self.policy = TorchPolicy(model, self.policy_version)

    # ------------------------------------------------------------------ episodes
    def _maybe_fault(self, step: int) -> None:
        for f in self.faults:
            if f.get("episode") == self.episode_index and f.get("step", 0) == step and not f.get("after_commit"):
                self._fire(f, step)

    def _maybe_fault_after_commit(self, length: int) -> None:
        """Faults with ``after_commit: true``: fire once the episode is committed, before its summary returns
        (a worker lost between its commit and its answer: the coordinator must not run the trial again)."""
        for f in self.faults:
            if f.get("after_commit") and f.get("episode") == self.episode_index:
                self._fire(f, length)

    def _fire(self, f: dict, step: int) -> None:
        once = f.get("once_file")
        if once:
            if os.path.exists(once):
                return
            Path(once).touch()
        if f["kind"] == "raise":
            raise RuntimeError(f"injected env fault (unit {self.unit_id}, episode {self.episode_index}, step {step})")
        if f["kind"] == "hang":
            time.sleep(10**6)
        if f["kind"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if f["kind"] == "sleep":  # a slow step: lets a test act mid-episode (e.g. SIGKILL from outside)
            time.sleep(float(f.get("seconds", 5.0)))

    def run_episode(self, task: str | None = None, seed: int | None = None,
                    explore: dict | None = None, trial: str | None = None) -> dict[str, Any]:
        """Run and commit one episode; returns its summary ``{"episode_id", "unit_id", "task", "seed",
        "success", "length", "policy_version", "is_demo", "episode_index", "wall_s", "return", "staleness",
        "termination", "commit_s"}`` (plus ``"error"`` for a trial that raised; ``commit_s``: seconds the store
        commit took, None when nothing was committed).

        ``termination`` says why it ended: ``terminated`` (after the task's success), ``truncated`` /
        ``max_steps`` (out of time), or a fault: ``non_finite_observation`` / ``non_finite_action`` /
        ``non_finite_reward`` (a NaN/inf from the env or the policy: the step is not stored and the episode
        ends), ``sim_unstable`` (the physics diverged, ``sim.stability``), ``error`` (an exception in the env or
        the policy). A fault is never a success. The steps before a fault are committed as a failed episode
        with its termination; with no step to commit (``episode_id`` None) nothing is written and the unit's
        episode count (and so its next seed) does not advance. An ``error`` trial's partial steps are dropped.

        ``staleness``: how many policy versions behind the newest published one the episode was when it was
        committed (``latest - policy_version``; versions published while it ran), for a unit following
        ``"latest"``; None for a fixed version, a checkpoint path, the expert or the random policy. A unit
        switches to the newest version at every episode start, so it is bounded by the versions the learner
        publishes during one episode.

        ``seed`` (the env reset seed) defaults to ``episode_seed(seed, unit, episode_index)``; an explicit one
        lets an evaluation give every policy arm the same initial states (common random numbers). ``trial``: the
        coordinator's token for this hand-out of a planned trial, kept in the store's ``extra["trial"]``, so that a
        trial committed by a worker that then died is found by the store's own record, whatever the hosts' clocks.

        ``explore``: a failure-guided exploration trial (:class:`Exploration` keys ``action_noise_std``,
        ``hold_steps``, ``retry_of``, ``attempt``, ``noise_temperature``): the policy's end-effector actions get
        temporally correlated Gaussian noise and/or its chunks are sampled at a higher denoising-noise
        temperature, and the episode is tagged in the store's ``extra`` with ``retry_of`` (the failed
        episode it re-attempts), ``attempt`` and ``exploration``.

        The stored ``action`` is the command the robot took at that step: clipped to [-1, 1] by the env
        (``info["action"]``), noise included; on a unit with latency L it executes L steps later.

        Raises:
            PolicyLoadError: the acting policy cannot be built (not retryable).
            fleet.registry.RegistryError, experience_dict.store.StoreError: as raised (not retryable).
        """
        from experience_dict.store import StoreError
        from fleet.registry import RegistryError

        task = task or self.tasks[self.episode_index % len(self.tasks)]
        if seed is None:
            seed = episode_seed(self.cfg.get("seed", 0), self.unit_id, self.episode_index)
        seed = int(seed)
        env = self._env(task)
        policy, ex = self._trial_policy(task, seed, explore)
        version = int(policy.version)
        t0 = time.perf_counter()
        extra = {**({"unit": env.unit.to_dict()} if hasattr(env.unit, "to_dict") else {}),
                 **(ex.tags() if ex is not None else {}), **({"trial": str(trial)} if trial else {})}
        self.progress_state.update(task=task, step=0, in_episode=True)
        success, ret, length, termination, error, commit_s, ep_id = False, 0.0, 0, "max_steps", None, None, None
        try:
            if any(f.get("kind") == "reset_error" and f.get("task") == task for f in self.faults):
                raise RuntimeError(f"injected reset fault (unit {self.unit_id}, task {task})")
            obs, info = env.reset(seed=seed)
            policy.reset()
            self.writer.begin_episode(unit_id=self.unit_id, embodiment=str(env.unit.embodiment), task=task,
                                      policy_version=version, seed=seed, is_demo=self.is_demo, extra=extra or None,
                                      control_hz=getattr(env, "control_hz", None) or None,
                                      start_time=time.time() + self.clock_offset_s)
            success, ret, length, termination = self._step_until_done(env, policy, obs, ex, seed)
            success = success and termination not in FAULTS
            ep_id, commit_s = self._commit_or_abort(success, termination, length)
        except (RegistryError, StoreError, KeyboardInterrupt, SystemExit):
            self.writer.abort()
            self.progress_state["in_episode"] = False
            raise
        except Exception as e:  # noqa: BLE001 - an error inside this trial: a failed trial, the unit goes on
            self.writer.abort()
            ep_id, success, termination = None, False, "error"
            error = f"{type(e).__name__}: {e}"
            logging.getLogger("fleetmind.worker").warning(
                "unit %d episode %d (task %s, seed %d) raised at step %d: %s\n%s", self.unit_id, self.episode_index,
                task, seed, self.progress_state.get("step", length), error, traceback.format_exc())
        finally:
            if getattr(policy, "noise_scale", 1.0) != 1.0:
                policy.noise_scale = 1.0   # the next episode samples as trained
        summary = {"episode_id": ep_id, "unit_id": self.unit_id, "task": task, "seed": seed, "success": success,
                   "length": length if ep_id else 0, "policy_version": version, "is_demo": self.is_demo,
                   "episode_index": self.episode_index, "wall_s": time.perf_counter() - t0, "return": ret,
                   "staleness": self._staleness(version) if ep_id else None, "termination": termination,
                   "commit_s": commit_s, **({"error": error} if error is not None else {}),
                   **(ex.tags() if ex is not None else {})}
        if ep_id is not None:
            self.episode_index += 1
        self.progress_state.update(episode_index=self.episode_index, in_episode=False)
        return summary

    def _commit_or_abort(self, success: bool, termination: str, length: int) -> tuple[str | None, float | None]:
        """Commit the open episode (``length`` > 0 steps) or drop it (no step); ``(episode_id, commit seconds)``,
        ``(None, None)`` when dropped."""
        if not length:
            self.writer.abort()
            return None, None
        t_commit = time.perf_counter()
        ep_id = self.writer.commit(success=success, termination=termination)
        commit_s = time.perf_counter() - t_commit
        self._maybe_fault_after_commit(length)
        return ep_id, commit_s

    def _trial_policy(self, task: str, seed: int, explore: dict | None) -> tuple[Any, Exploration | None]:
        """The acting policy for one trial and its exploration (``None``: none): a retry seeds torch from (seed,
        attempt) so it draws fresh denoising noise, and a noise temperature is set on the policy.

        Raises:
            PolicyLoadError: the policy cannot be built, or a temperature is asked of a policy without
                denoising noise.
            fleet.registry.RegistryError, experience_dict.store.StoreError: as raised.
        """
        from experience_dict.store import StoreError
        from fleet.registry import RegistryError

        try:
            policy = self._acting_policy(task, seed)
        except (RegistryError, StoreError):
            raise
        except Exception as e:  # noqa: BLE001 - a policy that cannot be built fails every trial alike
            raise PolicyLoadError(f"unit {self.unit_id}: cannot build the acting policy {self._policy_name()}: "
                                  f"{type(e).__name__}: {e}") from None
        ex = Exploration.from_dict(explore) if explore else None
        if ex is not None:
            import torch

            torch.manual_seed(retry_noise_seed(seed, ex.attempt))  # a retry draws fresh denoising noise too
            if ex.temperature != 1.0:
                if not hasattr(policy, "noise_scale"):
                    raise PolicyLoadError(f"unit {self.unit_id}: exploration noise_temperature={ex.temperature} "
                                          f"needs a checkpoint policy; the acting policy is {self._policy_name()}")
                policy.noise_scale = ex.temperature
        return policy, ex

    def _step_until_done(self, env, policy, obs, ex: Exploration | None, seed: int) -> tuple[bool, float, int, str]:
        """``fleet.rollout.rollout`` of ``policy`` (its actions perturbed by the exploration ``ex``, if any) from
        ``obs``, every finite step written to the open episode. Returns ``(success, return, length,
        termination)``."""
        def act(o, t):
            a = np.asarray(policy.select_action(o), dtype=np.float32)
            return ex.perturb(a, t, seed) if ex is not None else a

        def on_step(length):
            self.progress_state["step"] = length

        r = rollout(env, act, obs, self.max_steps, writer=self.writer, before_step=self._maybe_fault, on_step=on_step)
        return r.success, r.ret, r.length, r.termination

    def _policy_name(self) -> str:
        p = self.policy_cfg
        return str(p.get("path") or (f"version {p.get('version', 'latest')} of {p.get('registry_url')}"
                                     if p.get("kind") == "checkpoint" else p.get("kind")))

    def run_episodes(self, n: int = 1, task: str | None = None, policy: dict | None = None,
                     seed: int | None = None, explore: dict | None = None,
                     trial: str | None = None) -> list[dict[str, Any]]:
        """Run ``n`` episodes (of ``task``, or the unit's tasks round-robin); list of ``run_episode`` summaries.
        ``seed``: the reset seed of an ``n == 1`` call (default: the unit's own seed sequence); ``explore``,
        ``trial``: see :meth:`run_episode`.

        Raises:
            PolicyLoadError, fleet.registry.RegistryError, experience_dict.store.StoreError: as raised (not
                retryable).
            WorkerEpisodeError: any other exception outside the trial itself (type, message and traceback as
                text, so that exceptions holding unpicklable objects, e.g. EGL errors, reach the coordinator).
                An exception inside a trial is not raised: its summary says ``termination="error"``.
        """
        if policy is not None and policy != self.policy_cfg:
            # a new acting policy for this and later calls (the coordinator passes it with every call, so a
            # worker restarted by Ray picks it up again)
            self.policy_cfg, self.policy, self.policy_version = dict(policy), None, None
        if seed is not None and int(n) != 1:
            raise ValueError(f"run_episodes: an explicit seed is for one episode, given n={n}")
        if self.refusal is not None:   # a restarted worker whose shard is still held: the coordinator retries
            raise self.refusal
        return self._sim_thread.submit(self._run_episodes, int(n), task, seed, explore, trial).result()

    def _run_episodes(self, n: int, task: str | None, seed: int | None = None,
                      explore: dict | None = None, trial: str | None = None) -> list[dict[str, Any]]:
        from experience_dict.store import StoreError
        from fleet.registry import RegistryError

        out = []
        for _ in range(n):
            try:
                out.append(self.run_episode(task, seed, explore, trial))
            except (RegistryError, StoreError, PolicyLoadError):
                raise
            except Exception as e:  # noqa: BLE001 - re-raised as text
                raise WorkerEpisodeError(f"unit {self.unit_id} episode {self.episode_index}: {type(e).__name__}: {e}\n"
                                         + traceback.format_exc()) from None
        return out

    def progress(self) -> dict[str, Any]:
        """``{"episode_index", "step", "task", "in_episode", "pid", "bad_versions"}`` (callable while an episode
        runs; ``bad_versions``: published versions this unit could not load, and why)."""
        return {**self.progress_state, "pid": os.getpid(), "bad_versions": dict(self.bad_versions)}

    def pid(self) -> int:
        return os.getpid()

    def ready(self) -> dict[str, Any]:
        """``{"pid", "node", "refusal"}`` once the constructor is done: ``refusal`` is the store's refusal of this
        unit (``experience_dict.store.StoreError``, e.g. ``WriterBusyError`` when another live fleet holds the
        unit's shard past ``fleet.shard_wait_s``) or None."""
        return {"pid": os.getpid(), "node": self.node(), "refusal": self.refusal}

    def node(self) -> str:
        """The Ray node id (hex) this worker runs on (where it was placed, or re-placed after a node loss)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def close(self) -> None:
        """Close the envs (and their renderers) on the sim thread and release the store writer."""
        def _close():
            for env in self.envs.values():
                env.close()
            self.envs.clear()
            self.writer.close()

        self._sim_thread.submit(_close).result()
