"""Per-stage task progress of multi-stage Meta-World tasks: the stage an episode reached, and where failures stall.

For evaluation and analysis only (the simulator's signals; the deployed preset's learner never reads them).

Stages (in order; an episode has *reached* stage ``k`` when the signal of stage ``k`` and of every stage before it
crossed its threshold at some step of the episode, so the stages are cumulative):

====  ==========  =========================================================================================
k     name        Meta-World v3 ``info`` signal (stored per step as ``progress.<signal>``, float32)
====  ==========  =========================================================================================
0     start       -
1     reached     ``near_object`` >= 0.5: the gripper within the task's reach radius of the object
2     grasped     ``grasp_success`` >= 0.5: the object held (closed around it and lifted, per task)
3     carried     ``in_place_reward`` >= 0.5: Meta-World's tolerance reward of the object-to-goal distance at
                  half or more (about half the initial distance closed on the pick-and-place tasks)
4     success     the episode's success (the simulator's verdict)
====  ==========  =========================================================================================

A failed episode *stalls* at the highest stage it reached (0-3). The thresholds and the signals' meaning were
checked on the scripted experts of every task in :data:`STAGED_TASKS` (each expert crosses the stages in order:
``tests/test_stages.py``). Tasks whose ``near_object`` / ``grasp_success`` are not a reach / grasp flag (assembly,
disassemble and hammer, where ``near_object`` is a shaped reward already high at the start; button, drawer and
window tasks, which have no grasp) are not staged: :func:`episode_stage` refuses them by name.

Source of the signals: Meta-World v3's ``evaluate_state`` (``metaworld/envs/sawyer_*_v3.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

STAGE_NAMES: tuple[str, ...] = ("start", "reached", "grasped", "carried", "success")
"""Stage ``k``'s name is ``STAGE_NAMES[k]``."""

STAGE_SIGNALS: tuple[tuple[str, float], ...] = (("progress.near_object", 0.5), ("progress.grasp_success", 0.5),
                                                 ("progress.in_place_reward", 0.5))
"""(store key, threshold) of stages 1-3; stage 4 is the episode's success."""

STAGED_TASKS: frozenset[str] = frozenset({
    "pick-place-v3", "pick-place-wall-v3", "shelf-place-v3", "basketball-v3", "bin-picking-v3", "stick-push-v3",
    "stick-pull-v3", "pick-out-of-hole-v3"})
"""Meta-World v3 tasks whose signals follow reach -> grasp -> carry -> success (their experts cross the stages in
that order)."""


def is_staged(task: str) -> bool:
    """Whether ``task`` has per-stage progress (:data:`STAGED_TASKS`)."""
    return task in STAGED_TASKS


def episode_stage(task: str, progress: Mapping[str, np.ndarray], success: bool) -> int:
    """The stage (0-4, :data:`STAGE_NAMES`) one episode reached.

    Args:
        task: the episode's Meta-World task (one of :data:`STAGED_TASKS`).
        progress: ``{"progress.<signal>": (T,) float array}`` as ``ExperienceStore.load_episode`` returns it;
            must hold the three keys of :data:`STAGE_SIGNALS`.
        success: the episode's success (the simulator's verdict): stage 4.

    Raises:
        ValueError: ``task`` is not staged, or a stage signal is missing or holds a non-finite value.
    """
    if not is_staged(task):
        raise ValueError(f"task {task!r} has no per-stage progress (staged tasks: {sorted(STAGED_TASKS)})")
    if success:
        return len(STAGE_NAMES) - 1
    series = stage_series(task, progress)
    return int(series[-1]) if len(series) else 0


def stage_series(task: str, progress: Mapping[str, np.ndarray]) -> np.ndarray:
    """(T,) int64: the stage (0-3) an episode had reached by each step (inclusive), without the success.

    Raises:
        ValueError: as :func:`episode_stage`.
    """
    if not is_staged(task):
        raise ValueError(f"task {task!r} has no per-stage progress (staged tasks: {sorted(STAGED_TASKS)})")
    reached = None
    for key, thr in STAGE_SIGNALS:
        if key not in progress:
            raise ValueError(f"episode of {task!r}: stage signal {key!r} missing (has {sorted(progress)})")
        x = np.asarray(progress[key], np.float64)
        if x.size and not np.isfinite(x).all():
            raise ValueError(f"episode of {task!r}: stage signal {key!r} holds a non-finite value")
        hit = np.maximum.accumulate(x >= thr) if x.size else np.zeros(0, bool)
        reached = hit[None] if reached is None else np.vstack([reached, hit & reached[-1]])
    return reached.sum(axis=0).astype(np.int64)


class StageLookup:
    """Stages at steps of a store's episodes, each episode's :func:`stage_series` read once (``reader``: an
    ``ExperienceStore``); None for a task without stages. What ``fert.stage_match`` keys retrieval on."""

    def __init__(self, reader) -> None:
        self.reader, self._series = reader, {}

    def __call__(self, episode_id: str, task: str, step: int) -> int | None:
        if not is_staged(task):
            return None
        if episode_id not in self._series:
            keys = [k for k, _ in STAGE_SIGNALS]
            self._series[episode_id] = stage_series(task, self.reader.load_episode(episode_id, keys=keys))
        s = self._series[episode_id]
        return int(s[min(max(int(step), 0), len(s) - 1)]) if len(s) else 0


def stage_at(task: str, progress: Mapping[str, np.ndarray], step: int) -> int:
    """The stage (0-3) an episode had reached by ``step`` (inclusive): :func:`episode_stage` of its first
    ``step + 1`` steps, without the success (the per-step success is not stored).

    Raises:
        ValueError: as :func:`episode_stage`, or a negative ``step``.
    """
    if step < 0:
        raise ValueError(f"stage_at: expected step >= 0, given {step}")
    s = stage_series(task, progress)
    return int(s[min(int(step), len(s) - 1)]) if len(s) else 0


def retrieval_stage_match(retrieved: Mapping[str, Any], reader) -> dict[str, Any]:
    """Whether FERT's retrieved windows start where their failure stalled, per task.

    Args:
        retrieved: one round's ``"retrieved"`` record of its retrieval audit (``fleet.fert.retrieve.Retrieval.to_json``:
            ``contexts`` with ``episode_id``, ``task``, ``onset``; ``entries`` with ``context``, ``episode_id``,
            ``step`` (the window's anchor: it ends there and the supervised continuation starts there), ``weight``).
        reader: the learner's store (``ExperienceStore``) holding those episodes.

    Returns:
        ``{task: {"contexts", "entries", "context_stage": {stage: contexts}, "anchor_stage": {stage: weight},
        "same_stage_weight": the retrieval weight on windows whose anchor is at the failure's stage at its onset,
        "later_stage_weight": at a later stage, "earlier_stage_weight": at an earlier one, "own_retry_weight"}}`` for
        the staged tasks (weights normalised within the task; stages by name).
    """
    stage_of = StageLookup(reader)    # each episode's stages read once
    ctx_stage = [stage_of(str(c["episode_id"]), str(c["task"]), int(c["onset"])) for c in retrieved["contexts"]]
    out: dict[str, Any] = {}
    for e in retrieved["entries"]:
        c = retrieved["contexts"][int(e["context"])]
        cs = ctx_stage[int(e["context"])]
        if cs is None:
            continue
        t = str(c["task"])
        a = stage_of(str(e["episode_id"]), t, int(e["step"]))
        w = float(e["weight"])
        r = out.setdefault(t, {"contexts": set(), "entries": 0, "weight": 0.0,
                               "context_stage": {n: 0 for n in STAGE_NAMES[:-1]},
                               "anchor_stage": {n: 0.0 for n in STAGE_NAMES[:-1]},
                               "same": 0.0, "later": 0.0, "earlier": 0.0, "own": 0.0})
        if int(e["context"]) not in r["contexts"]:
            r["contexts"].add(int(e["context"]))
            r["context_stage"][STAGE_NAMES[cs]] += 1
        r["entries"] += 1
        r["weight"] += w
        r["anchor_stage"][STAGE_NAMES[a]] += w
        r["same" if a == cs else "later" if a > cs else "earlier"] += w
        r["own"] += w * bool(e.get("own_retry"))
    for t, r in out.items():
        tot = r.pop("weight") or 1.0
        out[t] = {"contexts": len(r["contexts"]), "entries": r["entries"], "context_stage": r["context_stage"],
                  "anchor_stage": {k: round(v / tot, 4) for k, v in r["anchor_stage"].items()},
                  "same_stage_weight": round(r["same"] / tot, 4), "later_stage_weight": round(r["later"] / tot, 4),
                  "earlier_stage_weight": round(r["earlier"] / tot, 4), "own_retry_weight": round(r["own"] / tot, 4)}
    return out


def stages_of(reader, episodes: Sequence[Mapping[str, Any]]) -> list[int | None]:
    """Each episode summary's stage (None for a task without stages or an episode without an id), its progress read
    from ``reader`` (an ``ExperienceStore``) by ``episode_id``; success from the summary's ``oracle_success`` when
    present (a detector-labelled episode), else ``success``."""
    keys = [k for k, _ in STAGE_SIGNALS]
    out: list[int | None] = []
    for e in episodes:
        if not is_staged(str(e["task"])) or not e.get("episode_id"):
            out.append(None)
            continue
        ok = bool(e.get("oracle_success", e["success"]))
        out.append(episode_stage(str(e["task"]), reader.load_episode(str(e["episode_id"]), keys=keys), ok))
    return out


def stall_table(arms: Mapping[str, Sequence[Mapping[str, Any]]], reader) -> dict[str, Any]:
    """Where each arm's failed episodes stall, per task: ``{arm: {task: {"trials", "successes", "stall": {stage
    name: failures}}}}`` for the staged tasks among the episodes (others left out).

    Args:
        arms: ``{arm: [episode summary, ...]}`` as ``fleet.experiment.evaluation.evaluate_arms`` returns them.
        reader: the ``ExperienceStore`` the episodes were committed to (the evaluation's ``eval_store``).
    """
    out: dict[str, Any] = {}
    for arm, eps in arms.items():
        stages = stages_of(reader, eps)
        per: dict[str, Any] = {}
        for e, s in zip(eps, stages):
            if s is None:
                continue
            t = per.setdefault(str(e["task"]), {"trials": 0, "successes": 0,
                                                "stall": {n: 0 for n in STAGE_NAMES[:-1]}})
            t["trials"] += 1
            if s == len(STAGE_NAMES) - 1:
                t["successes"] += 1
            else:
                t["stall"][STAGE_NAMES[s]] += 1
        if per:
            out[arm] = per
    return out


def stall_markdown(table: Mapping[str, Any], arms: Iterable[str] | None = None) -> str:
    """A markdown table of :func:`stall_table`'s result: one row per (arm, task), failures by the stage they stalled
    at."""
    names = STAGE_NAMES[:-1]
    lines = ["| arm | task | success | " + " | ".join(f"stalled at {n}" for n in names) + " |",
             "|---|---|---|" + "---|" * len(names)]
    for arm in (arms or table):
        for task, t in sorted(table.get(arm, {}).items()):
            lines.append(f"| {arm} | {task} | {t['successes']}/{t['trials']} | "
                         + " | ".join(str(t["stall"][n]) for n in names) + " |")
    return "\n".join(lines) + "\n"


def write_stall_report(arms: Mapping[str, Sequence[Mapping[str, Any]]], store_url: str | Path,
                       out_dir: str | Path) -> dict[str, Any] | None:
    """Write ``stages.json`` / ``stages.md`` (:func:`stall_table`) into ``out_dir`` when some episode is of a staged
    task and the store exists; returns the table, or None (nothing staged: nothing written)."""
    import json

    if not any(is_staged(str(e["task"])) for eps in arms.values() for e in eps):
        return None
    if not Path(store_url).is_dir():
        return None
    from experience_dict.store import ExperienceStore

    table = stall_table(arms, ExperienceStore.open(str(store_url)))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stages.json").write_text(json.dumps(table, indent=1))
    (out / "stages.md").write_text("# Where failures stall (held-out trials; simulator's stage signals)\n\n"
                                   + stall_markdown(table))
    return table
