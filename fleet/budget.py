"""Budget strategies of a fleet run: what each free unit is handed next, and when the run has done enough.

``Fleet.run`` picks one (``make_budget``) and its supervisor (``fleet.supervisor.RunSupervisor``) asks it for
work whenever a unit is free:

- ``PlanBudget``: exactly these trials (``[{"task", "unit_id", "seed", "explore"?}, ...]``), each unit running its
  own in order; a trial that failed is put back in front (held-out evaluation, failure retries);
- ``TaskBudget``: ``episodes_per_task`` episodes of every task in total, handed to whichever free unit runs the
  task whose remaining count (minus those in flight) is largest (demonstration collection);
- ``UnitBudget``: ``episodes_per_unit`` episodes on every unit, its tasks round-robin (``None``: unbounded, for
  a run bounded by wall time only).

Every strategy also stops handing out work after ``deadline`` (``time.monotonic()`` seconds) or once
``stop()`` was called; episodes in flight then finish.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Mapping, Sequence

from fleet.fleet_config import FleetConfig


class Budget:
    """Base of the strategies: the wall-time deadline and the graceful stop.

    ``next_trial(unit)`` returns the trial to hand to ``unit`` (``{"task": str | None, "unit_id", "seed": int |
    None, "explore": dict | None}``; ``task=None``: the worker's own round-robin) or ``None`` when the unit gets
    no more work; ``returned(unit, trial)`` is called when the trial's call came back (whatever happened);
    ``spent(unit, summary)`` for each committed episode; ``requeue(unit, trial)`` for a trial to run again.
    """

    total: int | None = None   # episodes the run is expected to commit (progress bar), None: unknown

    def __init__(self, deadline: float | None = None):
        self.deadline = deadline
        self.stopped = False

    def stop(self) -> None:
        """No new work from now on; episodes in flight finish."""
        self.stopped = True

    def open(self) -> bool:
        """Whether new work may start (not stopped, deadline not passed)."""
        return not self.stopped and (self.deadline is None or time.monotonic() < self.deadline)

    def next_trial(self, unit: int) -> dict | None:
        raise NotImplementedError

    def returned(self, unit: int, trial: dict) -> None:
        """The call running ``trial`` came back (committed, failed or faulted)."""

    def spent(self, unit: int, summary: Mapping) -> None:
        """One committed episode counts against the budget."""

    def requeue(self, unit: int, trial: dict) -> None:
        """Run ``trial`` again (plans only; elsewhere the budget is simply not spent)."""

    def leftover(self) -> dict[int, int]:
        """unit -> trials planned but never run (plans only)."""
        return {}

    def drop_task(self, unit: int, task: str) -> tuple[int, bool]:
        """``unit`` runs ``task`` no more (its env keeps failing): ``(trials of it not run, whether the unit has any
        task left)``."""
        raise NotImplementedError


class PlanBudget(Budget):
    """Exactly the given trials, each unit running its own in order; a failed trial is run again first.

    Raises:
        ValueError: a trial names a unit this fleet does not run, or a task that unit does not run.
    """

    def __init__(self, plan: Sequence[Mapping], unit_tasks: Mapping[int, Sequence[str]], deadline: float | None = None):
        super().__init__(deadline)
        self.queues: dict[int, deque] = {int(u): deque() for u in unit_tasks}
        for trial in plan:
            u, t = int(trial["unit_id"]), str(trial["task"])
            if u not in self.queues or t not in unit_tasks[u]:
                raise ValueError(f"Fleet.run plan: trial {dict(trial)} names unit {u} / task {t!r}, but this fleet "
                                 f"runs units {sorted(self.queues)} with tasks {list(unit_tasks.get(u, []))}")
            self.queues[u].append({"task": t, "unit_id": u, "seed": int(trial["seed"]),
                                   "explore": dict(trial["explore"]) if trial.get("explore") else None})
        self.total = sum(len(q) for q in self.queues.values())

    def next_trial(self, unit: int) -> dict | None:
        if not self.open() or not self.queues[unit]:
            return None
        return self.queues[unit].popleft()

    def requeue(self, unit: int, trial: dict) -> None:
        self.queues[unit].appendleft(trial)

    def leftover(self) -> dict[int, int]:
        return {u: len(q) for u, q in self.queues.items() if q}

    def drop_task(self, unit: int, task: str) -> tuple[int, bool]:
        q = self.queues[unit]
        keep = [t for t in q if t["task"] != task]
        dropped = len(q) - len(keep)
        self.queues[unit] = deque(keep)
        if self.total is not None:
            self.total -= dropped
        return dropped, bool(keep)


class TaskBudget(Budget):
    """``per_task`` episodes of each task in total, on whichever free unit runs it (the task with the most
    episodes still to hand out first)."""

    def __init__(self, per_task: int, unit_tasks: Mapping[int, Sequence[str]], deadline: float | None = None):
        super().__init__(deadline)
        self.unit_tasks = unit_tasks
        self.left = {t: int(per_task) for ts in unit_tasks.values() for t in ts}
        self.reserved: Counter = Counter()   # task -> episodes in flight
        self.total = sum(self.left.values())

    def next_trial(self, unit: int) -> dict | None:
        if not self.open():
            return None
        open_tasks = [t for t in self.unit_tasks[unit] if self.left[t] - self.reserved[t] > 0]
        if not open_tasks:
            return None
        t = max(open_tasks, key=lambda t: self.left[t] - self.reserved[t])
        self.reserved[t] += 1
        return {"task": t, "unit_id": unit, "seed": None, "explore": None}

    def returned(self, unit: int, trial: dict) -> None:
        self.reserved[trial["task"]] -= 1

    def spent(self, unit: int, summary: Mapping) -> None:
        self.left[summary["task"]] -= 1

    def drop_task(self, unit: int, task: str) -> tuple[int, bool]:
        self.unit_tasks = {**self.unit_tasks, unit: [t for t in self.unit_tasks[unit] if t != task]}
        dropped = 0
        if not any(task in ts for ts in self.unit_tasks.values()):   # no unit runs it any more
            dropped, self.left[task] = max(self.left[task] - self.reserved[task], 0), self.reserved[task]
        return dropped, bool(self.unit_tasks[unit])


class UnitBudget(Budget):
    """``per_unit`` episodes on every unit (its tasks round-robin in the worker); ``None``: unbounded (a run
    bounded by its deadline or ``stop()``). Once a task is dropped on a unit (``drop_task``) that unit is handed
    its other tasks by name, in turn."""

    def __init__(self, per_unit: int | None, unit_tasks: Mapping[int, Sequence[str]], deadline: float | None = None):
        super().__init__(deadline)
        self.unit_tasks = {int(u): list(ts) for u, ts in unit_tasks.items()}
        self.left = {u: (int(per_unit) if per_unit is not None else None) for u in self.unit_tasks}
        self.total = int(per_unit) * len(self.left) if per_unit is not None else None
        self.dropped: dict[int, set[str]] = {}
        self.turn: Counter = Counter()

    def next_trial(self, unit: int) -> dict | None:
        if not self.open() or (self.left[unit] is not None and self.left[unit] <= 0):
            return None
        if unit not in self.dropped:
            return {"task": None, "unit_id": unit, "seed": None, "explore": None}
        tasks = [t for t in self.unit_tasks[unit] if t not in self.dropped[unit]]
        if not tasks:
            return None
        self.turn[unit] += 1
        return {"task": tasks[self.turn[unit] % len(tasks)], "unit_id": unit, "seed": None, "explore": None}

    def drop_task(self, unit: int, task: str) -> tuple[int, bool]:
        self.dropped.setdefault(unit, set()).add(task)
        return 0, any(t not in self.dropped[unit] for t in self.unit_tasks[unit])

    def spent(self, unit: int, summary: Mapping) -> None:
        if self.left[unit] is not None:
            self.left[unit] -= 1


def make_budget(unit_tasks: Mapping[int, Sequence[str]], fleet_cfg: FleetConfig | Mapping, episodes_per_unit: int | None = None,
                wall_time_s: float | None = None, episodes_per_task: int | None = None,
                plan: Sequence[Mapping] | None = None) -> Budget:
    """The strategy ``Fleet.run``'s arguments ask for: a plan first, else ``episodes_per_task``, else
    ``episodes_per_unit`` (each optionally bounded by ``wall_time_s``, seconds from now). With no budget given,
    ``fleet.episodes_per_unit`` / ``fleet.wall_time_s`` from ``fleet_cfg`` are used.

    Raises:
        ValueError: no budget given or configured; a plan trial this fleet cannot run (``PlanBudget``).
    """
    if plan is None and episodes_per_unit is None and wall_time_s is None and episodes_per_task is None:
        fleet_cfg = FleetConfig.from_dict(fleet_cfg)
        episodes_per_unit, wall_time_s = fleet_cfg.episodes_per_unit, fleet_cfg.wall_time_s
        if episodes_per_unit is None and wall_time_s is None:
            raise ValueError("Fleet.run: give episodes_per_unit, episodes_per_task or wall_time_s")
    deadline = time.monotonic() + float(wall_time_s) if wall_time_s is not None else None
    if plan is not None:
        return PlanBudget(plan, unit_tasks, deadline)
    if episodes_per_task is not None:
        return TaskBudget(int(episodes_per_task), unit_tasks, deadline)
    return UnitBudget(episodes_per_unit, unit_tasks, deadline)
