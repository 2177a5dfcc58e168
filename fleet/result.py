"""What a fleet run produced: :class:`FleetResult` (returned by ``fleet.coordinator.Fleet.run``,
``collect`` and ``evaluate``; filled by ``fleet.supervisor.RunSupervisor`` as episodes commit).

Its own module: the coordinator returns it and the supervisor fills it, so both import it from here and the
supervisor does not import the coordinator.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FleetResult:
    """What a fleet run produced.

    ``episodes``: per-episode summaries (``task``, ``unit_id``, ``success``, ``length``, ``policy_version``,
    ``episode_id``, ``seed``, ``is_demo``, ``wall_s``, ``return``), in commit order. ``restarts``: unit ->
    worker restarts; ``failures``: one line per failed call; ``interrupted``: stopped by Ctrl-C or
    ``should_stop``; ``wall_s``: seconds; ``steps``: env steps committed.
    """

    episodes: list[dict] = field(default_factory=list)
    restarts: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    interrupted: bool = False
    wall_s: float = 0.0
    dropped_units: list[int] = field(default_factory=list)
    faulted: list[dict] = field(default_factory=list)     # trials that committed nothing (error, NaN at step 0)
    # tasks given up on a unit (its env kept failing): [{"unit", "task", "trials_not_run", "why"}]
    dropped_tasks: list[dict] = field(default_factory=list)
    terminations: dict[str, int] = field(default_factory=dict)   # why every trial ended, counted
    # Ray nodes lost during the run: [{"node_id", "units" (the units it ran), "at_s" (seconds into the run)}]
    node_losses: list[dict] = field(default_factory=list)
    # unit -> Ray node id where each unit ran last (a unit re-placed after a node loss shows its new node)
    unit_nodes: dict[int, str] = field(default_factory=dict)
    # plan trials whose worker died after committing: found in the store, counted once, not run again
    recovered_from_store: int = 0

    def summary(self) -> str:
        """One paragraph: committed episodes, terminations, faulted trials and given-up units, and why."""
        parts = [f"{len(self.episodes)} episodes committed ({self.steps} steps)",
                 "terminations " + ", ".join(f"{k} {v}" for k, v in sorted(self.terminations.items()))]
        if self.faulted:
            errs = Counter(f.get("error") or f["termination"] for f in self.faulted)
            parts.append(f"{len(self.faulted)} trials committed nothing: " +
                         "; ".join(f"{n} x {e[:160]}" for e, n in errs.most_common(3)))
        if self.dropped_tasks:
            parts.append("tasks given up: " + ", ".join(f"{d['task']} on unit {d['unit']}" for d in self.dropped_tasks))
        if self.dropped_units:
            parts.append(f"units given up: {self.dropped_units}")
        for loss in self.node_losses:
            moved = {u: self.unit_nodes.get(u, "?")[:8] for u in loss["units"]}
            parts.append(f"node {loss['node_id'][:8]} lost at {loss['at_s']:.0f} s; its units {loss['units']} "
                         f"re-placed on {moved}")
        if self.recovered_from_store:
            parts.append(f"{self.recovered_from_store} episodes committed by a worker that then died were "
                         "taken from the store (not run again)")
        return "; ".join(parts)

    @property
    def steps(self) -> int:
        return sum(e["length"] for e in self.episodes)

    def success_by(self, key: str) -> dict[Any, tuple[int, int]]:
        """``{value of key: (successes, episodes)}``, e.g. ``success_by("task")`` or ``success_by("unit_id")``."""
        out: dict[Any, list[int]] = defaultdict(lambda: [0, 0])
        for e in self.episodes:
            out[e[key]][0] += int(bool(e["success"]))
            out[e[key]][1] += 1
        return {k: (s, n) for k, (s, n) in sorted(out.items())}

    def table(self, key: str) -> str:
        """A plain-text success table by ``key`` with a total row."""
        rows = self.success_by(key)
        w = max([len(str(k)) for k in rows] + [len(key), 5])
        lines = [f"{key:<{w}}  episodes  successes  success_rate", "-" * (w + 36)]
        for k, (s, n) in rows.items():
            lines.append(f"{k!s:<{w}}  {n:8d}  {s:9d}  {s / max(n, 1):12.3f}")
        s_all, n_all = sum(s for s, _ in rows.values()), sum(n for _, n in rows.values())
        lines.append(f"{'total':<{w}}  {n_all:8d}  {s_all:9d}  {s_all / max(n_all, 1):12.3f}")
        return "\n".join(lines)
