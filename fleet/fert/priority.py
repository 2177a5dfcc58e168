"""Task priority of the failure contexts: which tasks' failures a round's retrieval weighs most.

Priority (the choice, documented): per-task *learnability* ``p (1 - p)`` with ``p`` the task's success rate
over its most recent episodes (Beta(1, 1)-smoothed), plus a small floor. It is largest for tasks the policy
solves about half the time, small for tasks it already solves and for tasks it never solves (where the
retrieved supervision has least chance to help), after the learnability curricula of Tzannetos et al.,
"Proximal Curriculum for RL Agents" (TMLR 2023) and Foster & Foerster, "Learning to Reason at the Frontier of
Learnability" (2025). UCB over individual failure contexts was not chosen: a context is never re-tried, so
it has no reward of its own to estimate; a task's success rate is observed with every episode. Within a
task, contexts from newer policy versions weigh more (``2 ** -(v_max - v)``): those are the failures the
current policy still makes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from fleet.fert.contexts import commit_order


# ----------------------------------------------------------------------------------------- priority
class TaskPriority:
    """Per-task priority from recent success statistics (see the module docstring for the choice).

    ``p_task = (successes + 1) / (episodes + 2)`` over the last ``window`` episodes of the task
    (Beta(1, 1) posterior mean); priority ``p (1 - p) + floor`` for ``method="learnability"``, ``1`` for
    ``method="uniform"``.

    Args:
        method: ``"learnability"`` or ``"uniform"``.
        window: recent episodes per task kept (>= 1).
        floor: added to every task's learnability so no task is starved (>= 0).
        exclude_units: units whose episodes :meth:`observe` ignores (held-out units).
    """

    def __init__(self, method: str = "learnability", window: int = 50, floor: float = 0.02,
                 exclude_units: Iterable[int] = ()):
        if method not in ("learnability", "uniform"):
            raise ValueError(f"priority method: expected 'learnability' or 'uniform', given {method!r}")
        if window < 1 or floor < 0:
            raise ValueError(f"window >= 1 and floor >= 0 expected, given window={window}, floor={floor}")
        self.method, self.window, self.floor = method, window, floor
        self.exclude_units = {int(u) for u in exclude_units}
        self.recent: dict[str, deque] = {}
        self.seen: set[str] = set()

    def update(self, task: str, success: bool) -> None:
        """Record one episode outcome of ``task``."""
        self.recent.setdefault(task, deque(maxlen=self.window)).append(bool(success))

    def observe(self, reader) -> int:
        """Update from the store's non-demo episodes not seen yet (oldest first); returns how many."""
        new = [m for m in reader.episodes(is_demo=False)
               if m.episode_id not in self.seen and int(m.unit_id) not in self.exclude_units]
        new.sort(key=commit_order)
        for m in new:
            self.seen.add(m.episode_id)
            self.update(m.task, m.success)
        return len(new)

    def success_rate(self, task: str) -> float:
        """Smoothed recent success rate of ``task`` (0.5 with no data)."""
        r = self.recent.get(task, ())
        return (sum(r) + 1.0) / (len(r) + 2.0)

    def priority(self, task: str) -> float:
        """Unnormalised priority of ``task``."""
        if self.method == "uniform":
            return 1.0
        p = self.success_rate(task)
        return p * (1.0 - p) + self.floor

    def probs(self, tasks: Sequence[str]) -> np.ndarray:
        """(len(tasks),) float64 sampling probabilities over ``tasks`` (sum 1)."""
        w = np.array([self.priority(t) for t in tasks], dtype=np.float64)
        return w / w.sum() if len(w) else w

    def state_dict(self) -> dict:
        """JSON-able state (for the learner's checkpoint)."""
        return {"recent": {t: list(map(bool, d)) for t, d in self.recent.items()}, "seen": sorted(self.seen)}

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict` output."""
        self.recent = {t: deque(v, maxlen=self.window) for t, v in state["recent"].items()}
        self.seen = set(state["seen"])


