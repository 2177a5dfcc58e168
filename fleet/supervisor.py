"""The supervisor of one fleet run: hands out work from a budget (``fleet.budget``), collects the committed
episodes, restarts failed workers, watches for hung episodes and lost Ray nodes.

``Fleet.run`` builds one per call; see its docstring for the contract (budgets, faults, node loss, Ctrl-C).
Every episode is one Ray call ``RobotWorker.run_episodes``; a recovering worker is pinged (``RobotWorker.pid``)
until its new process answers.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fleet.budget import Budget
from fleet.fleet_config import FleetConfig
from fleet.result import FleetResult


class SupervisedFleet(Protocol):
    """What :class:`RunSupervisor` uses of the fleet it runs: its config (``fcfg``: the ``fleet`` group),
    units, Ray actors, worker pids and nodes, acting-policy spec, and three of its operations.

    ``fleet.coordinator.Fleet`` is the one implementation (``Fleet.run`` builds a ``RunSupervisor`` on
    itself). The supervisor names this interface, not the coordinator's class: the coordinator imports the
    supervisor, so the supervisor does not import the coordinator.
    """

    fcfg: FleetConfig
    units: list[int]
    actors: dict[int, Any]
    pids: dict[int, int]
    unit_nodes: dict[int, str]
    policy: dict

    def shutdown(self, wait_s: float = 30.0) -> None: ...

    def _recreate(self, unit: int, result: FleetResult) -> bool: ...

    def _committed_in_store(self, trial: Mapping, counted: set[str]) -> dict | None: ...


class RunSupervisor:
    """One ``Fleet.run``: the event loop over the workers' calls.

    Args:
        fleet: the started ``Fleet`` (its actors, policy spec, store URL).
        budget: what to hand out (``fleet.budget``).
        result: the ``FleetResult`` to fill.
        progress: show a tqdm bar (``budget.total`` episodes when known).
        should_stop: polled about every 0.5 s; True stops handing out work (running episodes finish).
        on_episode: called with each committed episode's summary.
    """

    NODE_GRACE_S = 60.0   # a node still alive this long after a worker on it died lost only that process

    def __init__(self, fleet: SupervisedFleet, budget: Budget, result: FleetResult, progress: bool = True,
                 should_stop: Callable[[], bool] | None = None, on_episode: Callable[[dict], None] | None = None):
        self.fleet, self.budget, self.result = fleet, budget, result
        self.should_stop, self.on_episode = should_stop, on_episode
        self.timeout_s = float(fleet.fcfg.episode_timeout_s or 1e9)
        self.max_faults = int(fleet.fcfg.max_trial_faults)
        self.trial_retries = int(fleet.fcfg.trial_retries)
        self.t_start = time.monotonic()
        self.inflight: dict[Any, tuple[int, str, dict | None, float]] = {}   # ref -> (unit, "episode"|"ping", trial, t0)
        self.ping_at: dict[int, float] = {}            # recovering unit -> when to ask whether it is back
        self.recovering_since: dict[int, float] = {}
        self.active = set(fleet.units)
        self.faults_in_row: Counter = Counter()         # (unit, task) -> trials in a row that committed nothing
        self.terminations: Counter = Counter()
        self.per_unit_done: Counter = Counter()
        self.suspect_nodes: dict[str, float] = {}       # node id -> when a worker on it died (is the node gone?)
        self.lost_nodes: set[str] = set()
        self.pbar = None
        if progress:
            from tqdm.auto import tqdm

            self.pbar = tqdm(total=budget.total, desc="fleet", unit="ep", dynamic_ncols=True)

    def say(self, line: str) -> None:
        if self.pbar is not None:
            self.pbar.write(line)

    # ------------------------------------------------------------------ the loop
    def run(self) -> FleetResult:
        """Hand out work until the budget is spent and every call came back; returns the filled result."""
        import ray

        try:
            for u in self.fleet.units:
                self.submit(u)
            last_poll = last_node_check = time.monotonic()
            while self.inflight or self.ping_at:
                ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=0.2) if self.inflight else ([], [])
                if not self.inflight:
                    time.sleep(0.2)
                for ref in ready:
                    unit, kind, trial, _ = self.inflight.pop(ref)
                    if kind == "ping":
                        self.on_ping(ref, unit)
                    else:
                        self.budget.returned(unit, trial)
                        self.on_episode_call(ref, unit, trial)
                now = time.monotonic()
                self.kill_hung(now)
                self.ping_recovering(now)
                if self.suspect_nodes and now - last_node_check > 0.5:
                    last_node_check = now
                    self.check_nodes()
                if self.should_stop is not None and now - last_poll > 0.5:
                    last_poll = now
                    if self.should_stop():  # graceful: no new episodes; running ones finish and are committed
                        self.budget.stop()
                        self.result.interrupted = True
                        self.ping_at.clear()
        except KeyboardInterrupt:
            self.result.interrupted = True
            self.say("[fleet] interrupted: stopping workers; committed episodes are kept")
            self.fleet.shutdown()
        finally:
            if self.pbar is not None:
                self.pbar.close()
        return self.finish()

    def finish(self) -> FleetResult:
        if self.suspect_nodes:   # a node declared dead by now (its units' restarts usually wait for that)
            self.check_nodes()
        r = self.result
        r.wall_s = time.monotonic() - self.t_start
        r.terminations = dict(self.terminations)
        r.unit_nodes = dict(self.fleet.unit_nodes)
        if not r.interrupted:
            for u, n in self.budget.leftover().items():
                r.failures.append(f"unit {u}: {n} planned trials not run (unit given up)")
        return r

    def submit(self, unit: int) -> None:
        """Hand ``unit`` its next trial, if the budget has one."""
        trial = self.budget.next_trial(unit)
        if trial is None:
            return
        actor, policy = self.fleet.actors[unit], self.fleet.policy
        if trial["seed"] is not None:   # a planned trial: its reset seed and exploration, and this hand-out's token
            trial["_token"] = uuid.uuid4().hex
            ref = actor.run_episodes.remote(1, trial["task"], policy, trial["seed"], trial.get("explore"),
                                            trial["_token"])
        else:
            ref = actor.run_episodes.remote(1, trial["task"], policy)
        self.inflight[ref] = (unit, "episode", trial, time.monotonic())

    # ------------------------------------------------------------------ answers
    def on_ping(self, ref, unit: int) -> None:
        """A recovering worker answered (or not): back to work, wait more, or re-create it."""
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError

        try:
            pid = ray.get(ref)
        except ActorUnavailableError:  # still restarting
            self.ping_at[unit] = time.monotonic() + 0.5
            return
        except (RayActorError, RayTaskError) as err:  # dead for good (restarts spent)
            if self.fleet._recreate(unit, self.result):
                self.ping_at[unit] = time.monotonic()
            else:
                self.active.discard(unit)
                self.say(f"[fleet] unit {unit} given up after repeated failures: {err}")
            return
        # the old process may answer before the kill lands: wait for the new one (unless the process survived
        # a transient error: then go on after 10 s)
        if pid == self.fleet.pids.get(unit) and time.monotonic() - self.recovering_since[unit] < 10:
            self.ping_at[unit] = time.monotonic() + 0.2
            return
        self.fleet.pids[unit] = pid
        try:   # where Ray placed it again (another node after a node loss)
            self.fleet.unit_nodes[unit] = ray.get(self.fleet.actors[unit].node.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - died again: the next call finds out
            pass
        self.submit(unit)

    def on_episode_call(self, ref, unit: int, trial: dict) -> None:
        """An episode call came back: count its episodes, or recover the worker and hand the trial out again.

        Raises:
            fleet.worker.PolicyLoadError, fleet.registry.RegistryError, experience_dict.store.StoreError (not
                WriterBusyError): errors a restart cannot fix.
        """
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        from experience_dict.store import StoreError, WriterBusyError
        from fleet.registry import RegistryError
        from fleet.worker import PolicyLoadError

        try:
            summaries = ray.get(ref)
        except PolicyLoadError:
            raise  # every trial would fail alike: once, clearly
        except (RegistryError, StoreError) as err:
            if not isinstance(err, WriterBusyError):
                raise  # a missing or tampered checkpoint, bad data: restarting cannot help
            self.budget.requeue(unit, trial)
            self.recover(unit, err, kill=True)
            return
        except RayActorError as err:  # the process died or was killed (Ray restarts it)
            self.on_worker_death(unit, trial, err)
            return
        except RayTaskError as err:  # an exception inside the episode (e.g. in the env)
            self.budget.requeue(unit, trial)
            self.recover(unit, err, kill=True)
            return
        gave_up = False
        for s in summaries:
            self.terminations[s.get("termination") or "unknown"] += 1
            if s.get("episode_id") is None:   # the trial committed nothing (error, NaN at step 0)
                gave_up = self.on_fault(unit, trial, s) or gave_up
                continue   # the budget is not spent: handed out again
            self.faults_in_row[(unit, s.get("task"))] = 0
            self.budget.spent(unit, s)
            self.count(unit, s)
        if self.pbar is not None:
            self.update_pbar(sum(s.get("episode_id") is not None for s in summaries))
        if not gave_up:
            self.submit(unit)

    def update_pbar(self, n: int) -> None:
        """Advance the bar by ``n`` committed episodes; postfix: success so far, steps/s, episodes per unit."""
        r = self.result
        succ = sum(bool(e["success"]) for e in r.episodes)
        elapsed = max(time.monotonic() - self.t_start, 1e-9)
        self.pbar.update(n)
        self.pbar.set_postfix_str(
            f"success={succ / max(len(r.episodes), 1):.2f} steps/s={r.steps / elapsed:.0f} "
            + " ".join(f"u{u}:{c}" for u, c in sorted(self.per_unit_done.items())), refresh=False)

    def count(self, unit: int, summary: dict) -> None:
        self.result.episodes.append(summary)
        self.per_unit_done[unit] += 1
        if self.on_episode is not None:
            self.on_episode(summary)

    def on_fault(self, unit: int, trial: dict, s: dict) -> bool:
        """A trial that committed nothing; after ``fleet.max_trial_faults`` in a row of one task on a unit, that
        task is given up on that unit (its failure counted, its remaining trials not run) and the unit goes on with
        its other tasks; True when the unit has none left and is given up."""
        self.result.faulted.append(s)
        task = s.get("task")
        self.faults_in_row[(unit, task)] += 1
        why = s.get("error") or s.get("termination")
        self.say(f"[fleet] unit {unit} trial (task {task}, seed {s['seed']}) committed nothing: {why}")
        n = self.faults_in_row[(unit, task)]
        if n >= self.max_faults:
            not_run, tasks_left = self.budget.drop_task(unit, task)
            self.result.dropped_tasks.append({"unit": unit, "task": task, "trials_not_run": not_run,
                                              "why": str(why)[:300]})
            self.result.failures.append(f"unit {unit}: task {task} given up after {n} trials in a row committed "
                                        f"nothing (last: {why}); {not_run} of its trials not run")
            if not tasks_left:
                self.active.discard(unit)
                self.result.dropped_units.append(unit)
                self.result.failures.append(f"unit {unit}: given up, every task of it failed {n} times in a row")
                return True
            return False
        trial["_faults"] = trial.get("_faults", 0) + 1
        if trial["_faults"] <= self.trial_retries:
            self.budget.requeue(unit, trial)   # once more; then it counts as a failed trial
        return False

    def on_worker_death(self, unit: int, trial: dict, err: BaseException) -> None:
        """The worker's process died: suspect its node; a planned trial it committed before dying is taken from
        the store (not run twice), else handed out again."""
        node = self.fleet.unit_nodes.get(unit)
        if node and node not in self.lost_nodes:
            self.suspect_nodes.setdefault(node, time.monotonic())
        done = None
        if "_token" in trial:
            done = self.fleet._committed_in_store(trial, {e["episode_id"] for e in self.result.episodes})
        if done is not None:   # committed before it died: count it, do not run it twice
            self.result.recovered_from_store += 1
            self.terminations[done.get("termination") or "unknown"] += 1
            self.count(unit, done)
        else:
            self.budget.requeue(unit, trial)
        self.recover(unit, err, kill=False)

    def recover(self, unit: int, err: BaseException | None, kill: bool) -> None:
        """Count the failure and ping the worker until its new process answers (``kill``: it is alive but broken,
        e.g. an exception in the env: Ray restarts it, or it dies and is re-created)."""
        import ray

        if err is not None:
            self.result.restarts[unit] += 1
            first = str(err).strip().splitlines()[-1][:300] if str(err).strip() else ""
            self.result.failures.append(f"unit {unit}: {type(err).__name__}: {first}")
            self.say(f"[fleet] unit {unit} failed ({type(err).__name__}: {first[:120]}); restarting it, its running "
                     "episode is dropped")
        if kill:
            ray.kill(self.fleet.actors[unit], no_restart=False)
        self.ping_at[unit] = time.monotonic()
        self.recovering_since[unit] = time.monotonic()

    # ------------------------------------------------------------------ watching
    def kill_hung(self, now: float) -> None:
        """Kill the workers whose episode ran past ``fleet.episode_timeout_s`` (their call then fails)."""
        import ray

        for ref, (unit, kind, trial, t0) in list(self.inflight.items()):
            if kind == "episode" and now - t0 > self.timeout_s:
                self.inflight[ref] = (unit, kind, trial, float("inf"))
                self.say(f"[fleet] unit {unit} exceeded episode_timeout_s={self.timeout_s:g}; killing it")
                ray.kill(self.fleet.actors[unit], no_restart=False)
                self.recovering_since[unit] = now

    def ping_recovering(self, now: float) -> None:
        for unit, t in list(self.ping_at.items()):
            if now >= t and unit in self.active:
                del self.ping_at[unit]
                self.inflight[self.fleet.actors[unit].pid.remote()] = (unit, "ping", None, now)

    def check_nodes(self) -> None:
        """Record the suspect nodes the cluster has declared dead (a node loss); a node still alive
        ``NODE_GRACE_S`` after a worker on it died lost only that process."""
        import ray

        alive = {n["NodeID"]: bool(n["Alive"]) for n in ray.nodes()}
        for node, since in list(self.suspect_nodes.items()):
            if not alive.get(node, False):
                del self.suspect_nodes[node]
                self.lost_nodes.add(node)
                units = sorted(u for u, n in self.fleet.unit_nodes.items() if n == node)
                self.result.node_losses.append({"node_id": node, "units": units,
                                                "at_s": round(time.monotonic() - self.t_start, 1)})
                self.say(f"[fleet] Ray node {node[:8]} lost; its units {units} are re-placed on the surviving nodes")
            elif time.monotonic() - since > self.NODE_GRACE_S:
                del self.suspect_nodes[node]
