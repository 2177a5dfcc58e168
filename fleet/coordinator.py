"""Coordinator: starts the robot workers on Ray, hands out episodes, watches them, restarts the failed.

    from fleet.coordinator import Fleet, collect, evaluate
    with Fleet(cfg, policy="expert") as fleet:                       # cfg: the composed Hydra config
        result = fleet.run(episodes_per_unit=4)                      # or wall_time_s=..., episodes_per_task=...
    result.episodes  # [{"task", "unit_id", "success", "length", "policy_version", "episode_id", ...}, ...]

Local laptop: ``fleet.ray_address=null`` starts a local Ray instance (``num_cpus=fleet.num_cpus``, no
dashboard); a cluster: ``fleet.ray_address=auto`` joins the running one. The same code runs both.

Fault tolerance: each episode is one Ray call. A call that fails because its worker died (SIGKILL, OOM),
raised (an exception inside the env) or ran past ``episode_timeout_s`` (the worker is then killed) is handed
out again; the worker is restarted by Ray (``max_restarts``) or, once those are spent, re-created here (up
to ``max_recreates`` times per unit). The restarted worker re-opens its store shard, which drops the
half-written episode; committed episodes are never touched. The other units keep running meanwhile.
Ctrl-C stops the fleet: running episodes are dropped, every committed episode stays in the store.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fleet.budget import make_budget
from fleet.fleet_config import FleetConfig
from fleet.result import FleetResult
from fleet.supervisor import RunSupervisor
from fleet.worker import RobotWorker, writer_id

REPO_ROOT = str(Path(__file__).resolve().parents[1])


FLEET_CFG_KEYS = ("robot", "obs", "task", "store", "fleet", "policy", "eval", "seed")


def _plain(cfg) -> dict:
    """The parts of a Hydra/OmegaConf config (or dict) the fleet uses (``FLEET_CFG_KEYS``), as a plain,
    resolved dict (other keys, e.g. ``output_dir: ${hydra:...}``, are not resolved, so composed configs work)."""
    from omegaconf import DictConfig, OmegaConf

    out = {}
    for k in FLEET_CFG_KEYS:
        if k in cfg:
            v = cfg[k]
            out[k] = OmegaConf.to_container(v, resolve=True) if isinstance(v, DictConfig) else v
    for k in ("robot", "obs", "task", "store", "fleet"):
        if k not in out:
            raise KeyError(f"fleet config lacks group {k!r} (have {sorted(out)})")
    return out


def ensure_ray(fleet_cfg: FleetConfig | Mapping) -> None:
    """Start or join Ray once per process.

    ``fleet_cfg.ray_address``: ``None`` starts a new local instance (even when a ``ray start`` cluster runs
    on this machine) with ``num_cpus`` (``None``: all cores), no
    dashboard, ``RAY_AUTH_MODE=disabled`` unless set, and the repo on the workers' ``PYTHONPATH``; ``"auto"``
    or ``"ray://host:port"`` joins a cluster (``fleet_cfg.runtime_env`` is passed through, e.g.
    ``{"working_dir": "."}`` when the nodes lack the code).
    """
    import ray

    if ray.is_initialized():
        return
    from policies.threads import passive_wait

    passive_wait()   # the workers Ray starts inherit it: their OpenMP threads sleep when idle (policies/threads.py)
    fleet_cfg = FleetConfig.from_dict(fleet_cfg)
    address = fleet_cfg.ray_address
    if address:
        ray.init(address=address, runtime_env=fleet_cfg.runtime_env or None, logging_level="WARNING")
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if REPO_ROOT not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, *paths])
    # address="local": always a new instance of this process's own, never a cluster that another job on this
    # machine started with `ray start` (which a bare ray.init() would join)
    ray.init(address="local", num_cpus=fleet_cfg.num_cpus, include_dashboard=False, logging_level="WARNING",
             log_to_driver=bool(fleet_cfg.log_to_driver))


HEAD_LOST_EXIT = 3   # the process's exit status when the Ray head of a joined cluster is lost (HeadWatch)


def head_address(fleet_cfg: FleetConfig | Mapping) -> str | None:
    """``host:port`` of the joined cluster's head to watch (its GCS; for ``ray://host:port`` the client server's
    port), or None for a local instance. Call after ``ensure_ray``."""
    address = FleetConfig.from_dict(fleet_cfg).ray_address
    if not address:
        return None
    if str(address).startswith("ray://"):
        return str(address)[len("ray://"):]
    import ray

    try:
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - an older Ray: the address as given, when it names a host
        return None if str(address) == "auto" else str(address)


class HeadWatch:
    """Ends the process when a joined Ray cluster's head becomes unreachable, before Ray does it its own way.

    When the head (its GCS) goes away mid-run, Ray's driver either aborts in a native check (``WrongClusterID``,
    a C++ stack trace, once a new head answers at the address) or exits 1 after its 60 s reconnect timeout with
    no word about the run. This thread opens a TCP connection to the head every ``probe_s`` seconds; once it has
    failed for ``lost_after_s`` seconds in a row it calls ``on_lost(down_s)`` (which writes what the run has and
    says so in one line) and ends the process with ``HEAD_LOST_EXIT`` (``os._exit``: Ray's own threads could
    otherwise abort first). Committed episodes are in the store already; re-running the same command resumes.

    Args:
        address: ``host:port`` of the head's GCS.
        on_lost: called once from the watch thread with the seconds the head has been unreachable.
        lost_after_s: how long the head must stay unreachable (seconds; > 0).
        probe_s: seconds between probes.
        exit: called with ``HEAD_LOST_EXIT`` after ``on_lost`` (``os._exit``; a test passes its own).
    """

    def __init__(self, address: str, on_lost: Callable[[float], None], lost_after_s: float = 10.0,
                 probe_s: float = 1.0, exit: Callable[[int], None] = os._exit):
        host, _, port = str(address).rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"HeadWatch: expected the head's address as host:port, given {address!r}")
        if lost_after_s <= 0:
            raise ValueError(f"HeadWatch: lost_after_s must be > 0 seconds, given {lost_after_s}")
        self.host, self.port, self.on_lost = host, int(port), on_lost
        self.lost_after_s, self.probe_s, self._exit = float(lost_after_s), float(probe_s), exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fleetmind-head-watch", daemon=True)

    def start(self) -> HeadWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def reachable(self) -> bool:
        """Whether a TCP connection to the head opens within ``probe_s`` seconds."""
        import socket

        try:
            with socket.create_connection((self.host, self.port), timeout=max(self.probe_s, 0.5)):
                return True
        except OSError:
            return False

    def _run(self) -> None:
        down_since: float | None = None
        while not self._stop.wait(self.probe_s):
            if self.reachable():
                down_since = None
                continue
            now = time.monotonic()
            down_since = now if down_since is None else down_since
            if now - down_since >= self.lost_after_s and not self._stop.is_set():
                try:
                    self.on_lost(now - down_since)
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    self._exit(HEAD_LOST_EXIT)
                return


def policy_spec(cfg: dict, policy: Any = None) -> dict:
    """Normalise the acting-policy choice to the worker's spec dict.

    ``policy``: ``"expert"`` | ``"random"`` | ``"latest"`` (newest registry version, followed between
    episodes) | an ``int`` registry version (fixed) | a checkpoint directory path | a full spec dict |
    ``None``: from the config (``cfg.policy.type`` expert/random, else ``cfg.fleet.checkpoint`` or
    ``cfg.fleet.policy_version`` from ``cfg.fleet.registry_url``).

    Raises:
        ValueError: an unknown policy string that is not an existing directory.
    """
    fleet = cfg.get("fleet", {})
    base = {"registry_url": fleet.get("registry_url"), "cache_dir": fleet.get("cache_dir"),
            "device": fleet.get("device", "cpu"), "noise_std": float(fleet.get("expert_noise_std", 0.0))}
    if isinstance(policy, dict):
        return {**base, **policy}
    if policy is None:
        ptype = cfg.get("policy", {}).get("type", "expert")
        if ptype in ("expert", "random"):
            return {**base, "kind": ptype, "noise_std": float(cfg["policy"].get("noise_std", base["noise_std"]))}
        policy = fleet.get("checkpoint") or fleet.get("policy_version", "latest")
    if isinstance(policy, int) or (isinstance(policy, str) and policy.isdigit()):
        return {**base, "kind": "checkpoint", "version": int(policy)}
    if policy in ("expert", "random"):
        return {**base, "kind": policy}
    if policy == "latest":
        return {**base, "kind": "checkpoint", "version": "latest"}
    if isinstance(policy, (str, Path)) and Path(policy).is_dir():
        return {**base, "kind": "checkpoint", "path": str(policy)}
    raise ValueError(f"policy {policy!r}: expected 'expert', 'random', 'latest', a registry version (int) or an "
                     "existing checkpoint directory")


def server_wanted(fleet_cfg: FleetConfig | Mapping) -> bool:
    """Whether a fleet serves its trained policy from one batched ``PolicyServer`` (``fleet.policy_server``):
    ``true`` / ``false`` as given; ``"auto"``: when the server's device (``fleet.server_device``) resolves to
    CUDA, i.e. a GPU is visible here. On CPU the default stays per-worker inference: it draws each episode's
    denoising noise from the episode seed (the fleet's episodes are reproducible), and a server's batches
    are not (``scripts/bench_fleet.py +bench.server_vs_local=true`` measures both at 1, 8 and 16 units).

    Raises:
        ValueError: any other value.
    """
    fleet_cfg = FleetConfig.from_dict(fleet_cfg)
    v = fleet_cfg.policy_server
    if isinstance(v, bool):
        return v
    if v == "auto":
        from fleet.acting import resolve_device

        return resolve_device(fleet_cfg.server_device) == "cuda"
    raise ValueError(f"fleet.policy_server: expected true, false or 'auto', given {v!r}")


def unit_tasks(unit_index: int, tasks: list[str], tasks_per_unit: int | None) -> list[str]:
    """Tasks of the ``unit_index``-th unit: all of them, or ``tasks_per_unit`` consecutive ones (wrapping),
    so units cover the suite evenly."""
    if not tasks_per_unit or tasks_per_unit >= len(tasks):
        return list(tasks)
    k = int(tasks_per_unit)
    return [tasks[(unit_index * k + j) % len(tasks)] for j in range(k)]


class Fleet:
    """A set of ``RobotWorker`` actors for chosen units, sharing one store and one acting-policy choice.

    Args:
        cfg: composed Hydra config (or the same as a dict): uses ``robot``, ``obs``, ``task``, ``store``,
            ``fleet``, ``policy`` and ``seed``.
        policy: see ``policy_spec`` (``"expert"``, ``"random"``, ``"latest"``, a version, a path, a spec).
        units: unit ids to run (default: the first ``fleet.units`` of ``robot.train_units``).
        tasks: task names (default: ``task.tasks``); unit ``i`` gets ``unit_tasks(i, tasks, fleet.tasks_per_unit)``.
        store_url: experience store URL (default ``store.url``).
        is_demo: committed with every episode.
        faults: test hook, unit id -> ``RobotWorker`` fault dict.
        use_server: serve a trained policy from one batched ``PolicyServer`` (default: ``server_wanted(cfg.fleet)``).
        on_head_lost: on a joined cluster (``fleet.ray_address``), called as ``on_head_lost(result, address,
            down_s)`` from ``HeadWatch``'s thread when the head has been unreachable ``fleet.head_lost_after_s``
            seconds (``result``: the running ``FleetResult`` so far, or None before ``run``); the process then
            exits with ``HEAD_LOST_EXIT``. Default: one line on stderr.
    Raises:
        ValueError: more units requested than ``robot.train_units`` holds, or no units.
    """

    def __init__(self, cfg, policy: Any = None, units: list[int] | None = None, tasks: list[str] | None = None,
                 store_url: str | None = None, is_demo: bool = False, faults: dict[int, dict] | None = None,
                 use_server: bool | None = None,
                 on_head_lost: Callable[[FleetResult | None, str, float], None] | None = None):
        self.cfg = _plain(cfg)
        self.fcfg = FleetConfig.from_dict(self.cfg["fleet"])
        if units is None:
            from sim import unit_lists

            train_units, _ = unit_lists(self.cfg["robot"])
            n = int(self.fcfg.units or len(train_units))
            if n > len(train_units):
                raise ValueError(f"fleet.units={n} but robot.train_units has only {len(train_units)} units "
                                 f"({train_units}); list more, e.g. robot.train_units='0:{n}'")
            units = train_units[:n]
        if not units:
            raise ValueError("Fleet: no units to run")
        self.units = [int(u) for u in units]
        self.tasks = list(tasks or self.cfg["task"]["tasks"])
        self.store_url = str(store_url or self.cfg["store"]["url"])
        self.policy = policy_spec(self.cfg, policy)
        self.is_demo, self.faults = is_demo, faults or {}
        self.use_server = server_wanted(self.fcfg) if use_server is None else bool(use_server)
        self.unit_tasks = {u: unit_tasks(i, self.tasks, self.fcfg.tasks_per_unit) for i, u in enumerate(self.units)}
        self.actors: dict[int, Any] = {}
        self.pids: dict[int, int] = {}  # unit -> worker process id (a restarted worker has a new one)
        self.server = None
        self.recreates: Counter = Counter()
        self.unit_nodes: dict[int, str] = {}   # unit -> Ray node id of its worker
        self._reader = None
        self.on_head_lost = on_head_lost
        self.head_watch: HeadWatch | None = None
        self.result: FleetResult | None = None   # the running (or last) run's result, filled as episodes commit

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Fleet:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def start(self) -> None:
        """Start Ray (if needed), the policy server (if used) and one worker actor per unit."""
        import ray

        ensure_ray(self.fcfg)
        address, lost_after = head_address(self.fcfg), float(self.fcfg.head_lost_after_s or 0)
        if address and lost_after > 0 and self.head_watch is None:
            self.head_watch = HeadWatch(address, lambda down_s: self._head_lost(address, down_s), lost_after).start()
        self._prepare_store()
        if self.use_server and self.policy["kind"] == "checkpoint":
            from fleet.policy_server import make_policy_server

            self.server = make_policy_server(self.fcfg, registry_url=self.policy.get("registry_url"),
                                             path=self.policy.get("path"),
                                             cache_dir=str(Path(self.policy.get("cache_dir") or "/tmp/fleet_cache") / "server"),
                                             device=self.fcfg.server_device)
            self.policy = {**self.policy, "server": self.server}
        total = ray.cluster_resources().get("CPU", 1.0)
        self.worker_cpus = float(self.fcfg.worker_cpus or min(1.0, total / len(self.units)))
        try:
            for u in self.units:
                self.actors[u] = self._make_actor(u)
            # wait until every worker has built its env and opened its shard (surfaces config errors here)
            ready = dict(zip(self.actors, ray.get([a.ready.remote() for a in self.actors.values()])))
            refused = {u: r["refusal"] for u, r in ready.items() if r["refusal"] is not None}
            if refused:
                raise _refusal(refused, self.store_url)
        except BaseException:
            self.shutdown()   # no worker outlives a failed start (each holds a store shard)
            raise
        self.pids = {u: r["pid"] for u, r in ready.items()}
        self.unit_nodes = {u: r["node"] for u, r in ready.items()}

    def _prepare_store(self) -> None:
        """Create the store once, from the driver, before workers open their shards (avoids a creation race)."""
        from experience_dict.store import ExperienceStore
        from experience_dict.store.config import store_layout
        from sim import make_env

        env = make_env(task=self.tasks[0], unit_id=self.units[0], robot_cfg=self.cfg["robot"], obs_cfg=self.cfg["obs"],
                       task_cfg=self.cfg["task"])
        spec = env.spec_dict()
        ExperienceStore.create_or_open(self.store_url, spec=spec, control_hz=float(spec.get("control_hz", 80.0)),
                                       **store_layout(self.cfg.get("store") or {}))
        env.close()

    def _make_actor(self, unit: int):
        import ray

        placement = str(self.fcfg.placement or "pack")
        if placement not in ("pack", "spread"):
            raise ValueError(f"fleet.placement={placement!r}: expected 'pack' or 'spread'")
        opts = {"scheduling_strategy": "SPREAD"} if placement == "spread" else {}
        if self.fcfg.worker_resources:
            opts["resources"] = {str(k): float(v) for k, v in dict(self.fcfg.worker_resources).items()}
        cls = ray.remote(RobotWorker).options(
            max_restarts=int(self.fcfg.max_restarts), max_task_retries=0, num_cpus=self.worker_cpus,
            max_concurrency=2, **opts,
        )
        return cls.remote(unit, self.unit_tasks[unit], self.cfg, self.store_url, self.policy, self.is_demo,
                          self.faults.get(unit))

    def shutdown(self, wait_s: float = 30.0) -> None:
        """Kill the workers and the policy server and wait until they are gone (so their store shards can be
        reopened at once); committed episodes are in the store already."""
        import ray
        from ray.exceptions import RayActorError

        if self.head_watch is not None:
            self.head_watch.stop()
            self.head_watch = None
        actors = list(self.actors.values()) + ([self.server] if self.server is not None else [])
        for a in actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already dead
                pass
        deadline = time.monotonic() + wait_s
        for a in actors:
            while time.monotonic() < deadline:
                try:
                    ray.get(a.pid.remote(), timeout=max(deadline - time.monotonic(), 0.1))
                    time.sleep(0.1)
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    break
        self.actors.clear()
        self.server = None

    def _recreate(self, unit: int, result: FleetResult) -> bool:
        """Replace a dead worker by a new actor; False (unit given up) after ``max_recreates``."""
        import ray

        try:
            ray.kill(self.actors[unit], no_restart=True)
        except Exception:  # noqa: BLE001 - already dead
            pass
        if self.recreates[unit] >= int(self.fcfg.max_recreates):
            result.dropped_units.append(unit)
            return False
        self.recreates[unit] += 1
        self.actors[unit] = self._make_actor(unit)
        return True

    def _committed_in_store(self, trial: Mapping, counted: set[str]) -> dict | None:
        """The summary of a plan trial that a worker committed before it died (its answer lost), read back from
        the store; None when the store holds no such episode. Matched on this hand-out's token (``trial["_token"]``,
        which the worker keeps in the episode's ``extra["trial"]``: the store's own record, whatever the hosts'
        clocks say), unit, task, reset seed, demo flag and retry tags, and not already counted. This keeps a node
        loss from running a committed trial twice."""
        from experience_dict.store import ExperienceStore

        if self._reader is None:
            self._reader = ExperienceStore.open(self.store_url)
        self._reader.refresh()
        ex = trial.get("explore") or {}
        for m in self._reader.episodes(unit_id=int(trial["unit_id"]), task=str(trial["task"]), quarantined=None):
            if (int(m.seed) == int(trial["seed"]) and bool(m.is_demo) == bool(self.is_demo)
                    and m.extra.get("trial") == trial.get("_token") and m.episode_id not in counted
                    and m.extra.get("retry_of") == ex.get("retry_of") and m.extra.get("attempt") == ex.get("attempt")):
                out = {"episode_id": m.episode_id, "unit_id": int(m.unit_id), "task": m.task, "seed": int(m.seed),
                       "success": bool(m.success), "length": int(m.length), "policy_version": int(m.policy_version),
                       "is_demo": bool(m.is_demo), "episode_index": None, "wall_s": None, "return": None,
                       "staleness": None, "termination": m.termination, "from_store": True}
                if ex:
                    out.update({k: m.extra.get(k) for k in ("retry_of", "attempt", "exploration")})
                return out
        return None

    # ------------------------------------------------------------------ running
    def run(self, episodes_per_unit: int | None = None, wall_time_s: float | None = None,
            episodes_per_task: int | None = None, progress: bool = True,
            should_stop: Callable[[], bool] | None = None,
            on_episode: Callable[[dict], None] | None = None, policy: Any = None,
            plan: Sequence[Mapping] | None = None) -> FleetResult:
        """Run episodes until the budget is spent; returns a ``FleetResult``.

        Budgets (at least one): ``episodes_per_unit`` (each unit runs that many, its tasks round-robin),
        ``episodes_per_task`` (that many per task in total, handed to whichever unit runs the task and is
        free), ``plan`` (exactly these trials: ``[{"task", "unit_id", "seed", "explore"?}, ...]``, each unit running
        its own in order; a trial whose episode fails is run again; see ``fleet.experiment.evaluation.evaluation_plan``;
        ``explore``: a failure retry's exploration, ``fleet.worker.Exploration``),
        ``wall_time_s`` (no new episode starts after it; running ones finish). With none given,
        ``fleet.episodes_per_unit`` / ``fleet.wall_time_s`` from the config are used.
        ``policy`` (see ``policy_spec``) switches the acting policy for this run and later ones (held-out
        evaluation of several arms on one set of workers); it is handed to the workers with every episode.
        ``should_stop()`` is polled (~2 Hz) to end early (e.g. a learner asks for a new round): no new
        episode starts, running ones finish; ``on_episode(summary)`` is called for each committed episode.

        A failed episode (worker died, raised, or hung past ``fleet.episode_timeout_s``) is run again by the
        restarted worker; ``result.restarts`` counts failures per unit.
        Ctrl-C (KeyboardInterrupt) stops the workers and returns with ``interrupted=True``; committed
        episodes stay in the store, the running ones are dropped.

        A trial that raised inside the env or the policy, or hit a NaN/inf, is not a crash: the worker records
        it (``termination``; a fault's finite prefix is committed as a failed episode) and goes on; one that
        committed nothing goes to ``result.faulted`` and is tried again (a plan trial once,
        ``fleet.trial_retries``); after ``fleet.max_trial_faults`` such trials in a row the unit is given up.

        Raises:
            fleet.registry.RegistryError / experience_dict.store.StoreError (not WriterBusyError): a missing
                or tampered checkpoint, or data that does not fit the store; restarting cannot fix those.
            fleet.worker.PolicyLoadError: the acting policy cannot be built (e.g. a checkpoint of the wrong
                shape): raised once, not retried.
            ValueError: no budget given or configured; a plan trial names a unit this fleet does not run or a
                task that unit does not run.
        """
        if not self.actors:
            self.start()
        if policy is not None:
            self.policy = policy_spec(self.cfg, policy)
        budget = make_budget(self.unit_tasks, self.fcfg, episodes_per_unit, wall_time_s, episodes_per_task, plan)
        result = self.result = FleetResult(restarts={u: 0 for u in self.units})
        return RunSupervisor(self, budget, result, progress, should_stop, on_episode).run()

    def _head_lost(self, address: str, down_s: float) -> None:
        """``HeadWatch``'s callback: the user's ``on_head_lost``, or one line on stderr."""
        if self.on_head_lost is not None:
            self.on_head_lost(self.result, address, down_s)
            return
        n = len(self.result.episodes) if self.result is not None else 0
        print(f"\nfleet: the Ray head at {address} was lost (unreachable for {down_s:.0f} s); the {n} episodes this "
              f"run committed to {self.store_url} are kept; re-run the same command to resume", file=sys.stderr)

    def server_stats(self, reset: bool = False) -> dict | None:
        """The policy server's batch-size and latency report (``PolicyServer.stats``; ``reset``: start counting
        afresh after it), or None without a server."""
        import ray

        return ray.get(self.server.stats.remote(reset)) if self.server is not None else None


# ---------------------------------------------------------------------------------------------------- helpers
def _refusal(refused: dict[int, Exception], store_url: str) -> Exception:
    """The one exception that says why the store refused these units (the first unit's, its type kept; a
    ``WriterBusyError`` says what to do about the other fleet)."""
    from experience_dict.store import WriterBusyError

    u, err = next(iter(sorted(refused.items())))
    more = f" (and units {sorted(refused)[1:]})" if len(refused) > 1 else ""
    if isinstance(err, WriterBusyError):
        return WriterBusyError(f"unit {u}{more}: {err}; another fleet is writing this store: wait for it to end, "
                               f"stop it, or give this run its own store.url (not {store_url!r})")
    return type(err)(f"unit {u}{more}: {err}")


def collect(cfg, policy: Any = "expert", is_demo: bool = True, episodes_per_task: int = 10,
            units: list[int] | None = None, store_url: str | None = None, progress: bool = True) -> FleetResult:
    """Collect ``episodes_per_task`` episodes of every task of ``cfg.task`` on the fleet, in parallel.

    Meant for ``scripts/collect_demos.py``: the scripted expert on the training units, committed with
    ``is_demo=True`` and ``policy_version=-1`` (``fleet.acting.EXPERT_VERSION``). Every unit runs every
    task; the episodes of a task go to whichever unit is free.
    """
    c = _plain(cfg)
    c["fleet"] = {**c["fleet"], "tasks_per_unit": None}
    with Fleet(c, policy=policy, units=units, store_url=store_url, is_demo=is_demo) as fleet:
        return fleet.run(episodes_per_task=episodes_per_task, progress=progress)


def evaluate(cfg, policy: Any, units: list[int] | None = None, episodes_per_task: int | None = None,
             store_url: str | None = None, progress: bool = True) -> FleetResult:
    """Evaluate a fixed policy (registry version ``int``, checkpoint path, or ``"expert"``) on held-out units.

    Args:
        units: default ``robot.heldout_units``.
        episodes_per_task: default ``eval.trials_per_task``; spread over the units.
        store_url: where the evaluation episodes are committed (default ``<store.url>-eval``, apart from the
            training store so held-out experience never reaches training).
    Returns:
        ``FleetResult``; ``result.episodes`` carry task, unit_id, success, length and policy_version.
    """
    c = _plain(cfg)
    c["fleet"] = {**c["fleet"], "tasks_per_unit": None}
    if policy == "latest":
        raise ValueError("evaluate: give a fixed policy version or path, not 'latest'")
    units = list(units if units is not None else c["robot"]["heldout_units"])
    n = int(episodes_per_task if episodes_per_task is not None else c.get("eval", {}).get("trials_per_task", 10))
    store_url = store_url or f"{str(c['store']['url']).rstrip('/')}-eval"
    with Fleet(c, policy=policy, units=units, store_url=store_url, is_demo=False) as fleet:
        return fleet.run(episodes_per_task=n, progress=progress)


__all__ = ["Fleet", "FleetResult", "collect", "ensure_ray", "evaluate", "policy_spec", "unit_tasks", "writer_id"]
