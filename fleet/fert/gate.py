"""FERT's validation gate: before a round's weights are published, they and the version the fleet runs play
the same fixed plan of training-unit trials, and the round is published unless it is worse, overall or on a
task, by a paired margin that an exact one-sided McNemar test confirms (docs/FLEET_LEARNING.md, item 4).

RL-100 (2025) gates its offline-RL iterations before they reach the robots in the same spirit; the paired rule,
the per-task rule and Holm's step-down (Holm, 1979) over the tasks are this project's (docs/RESULTS.md,
experiments 20 and 31-33).
"""

from __future__ import annotations

from pathlib import Path

from fleet.fert.learner_config import LearnerConfig
from fleet.labels_config import LabelsConfig


def p_worse(wins: int, losses: int) -> float:
    """One-sided exact McNemar p-value that the candidate is worse, from its discordant trials (``wins``: only the
    candidate succeeded; ``losses``: only the current version did); 1.0 with none."""
    from scipy.stats import binomtest

    return float(binomtest(wins, wins + losses, 0.5, alternative="less").pvalue) if wins + losses else 1.0


def tasks_lost(tasks: dict, tolerance: float, alpha: float, correction: str = "none") -> list[str]:
    """The tasks a candidate loses: paired success difference below ``-tolerance`` and the one-sided exact
    McNemar test (candidate worse, on the task's discordant trials) significant.

    Args:
        tasks: ``{task: {"diff", "wins", "losses"}}`` (``fleet.experiment.tables.paired_differences``' per-task cells).
        tolerance: a fraction in [0, 1]. alpha: the test's level.
        correction: ``"none"``: each task tested at ``alpha`` (with m tasks and no true loss, some task is
            "lost" by chance in up to 1 - (1 - alpha)^m of the rounds); ``"holm"``: Holm's step-down over the m
            tasks (Holm 1979), the family-wise level ``alpha``.
    Raises:
        ValueError: an unknown ``correction``.
    """
    if correction not in ("none", "holm"):
        raise ValueError(f"learner.validate_task_correction: expected 'none' or 'holm', given {correction!r}")
    p = {t: p_worse(tc["wins"], tc["losses"]) for t, tc in tasks.items()}
    if correction == "none":
        significant = {t for t, pv in p.items() if pv < alpha}
    else:
        significant, m = set(), len(p)
        for i, (t, pv) in enumerate(sorted(p.items(), key=lambda kv: (kv[1], kv[0]))):
            if pv >= alpha / (m - i):
                break
            significant.add(t)
    return [t for t, tc in tasks.items() if tc["diff"] < -tolerance and t in significant]


def make_validator(c: dict, units: list[int], sd: Path, progress: bool = True):
    """The per-version validation gate of the publishing learner (``learner.validate_trials_per_task`` > 0).

    Before a FERT round is published, the version the fleet runs now and the round's candidates (``finetuned``:
    the fine-tuned weights with the new critic; with ``learner.validate_critic_only``, ``critic_only``: the
    current weights with the new critic) play the same fixed plan of training-unit trials (seed stream
    ``7000 + seed``, ``fleet.experiment.evaluation.evaluation_plan``; committed to ``<seed dir>/validation/eval_store``,
    never to the training store; arms ``round_<r>_current`` / ``round_<r>_<candidate>``, a checkpoint that played
    the plan in an earlier round is not run again). The candidate with the most successes is chosen (ties: the
    first, ``finetuned``), and it is published unless it is worse than the current version: its paired success
    difference is below
    ``-learner.validate_tolerance`` *and* the one-sided exact McNemar test (candidate worse) has
    p < ``learner.validate_alpha``. A difference of two trials out of 30 is noise; without the test the gate
    rejected a candidate on 0 wins / 2 losses. The validator returns ``(chosen name or None, record)``; the
    factory returns None when the gate is off. With ``labels.source: detector`` the trials are labelled (and ended)
    by the fleet's success detector, not the simulator: the gate reads no label a deployment would not have."""
    from fleet.experiment.evaluation import evaluate_arms
    from fleet.experiment.tables import paired_differences
    from fleet.registry import CheckpointRegistry

    lc = LearnerConfig.from_dict(c["learner"])
    n = lc.validate_trials_per_task
    if n <= 0:
        return None
    tol, alpha = float(lc.validate_tolerance), float(lc.validate_alpha)
    acting = None   # a fleet labelled by its success detector validates on the detector's labels too
    if LabelsConfig.from_dict(c.get("labels")).source == "detector":
        from fleet.labels import Acting

        acting = Acting("detector", dict(c["labels"]), detector_dir=str(Path(sd) / "detector"))
    task_tol, task_correction = lc.validate_task_tolerance, lc.validate_task_correction

    def validate(candidates: dict, r: int, policy_alone: bool = False) -> tuple[str | None, dict]:
        from fleet.registry import checkpoint_with_critic

        if not candidates or "current" in candidates:
            raise ValueError(f"validation: expected named candidates other than 'current', given {list(candidates)}")
        reg = CheckpointRegistry(c["fleet"]["registry_url"])
        v = reg.latest_version()
        current = reg.fetch(v, sd / "cache" / "validation" / f"v{v:06d}")
        if policy_alone:   # the weights alone (K = 1): the current version without its critic
            current = checkpoint_with_critic(current, sd / "cache" / "validation" / f"v{v:06d}_alone", None)
        cv = {**c, "eval": {**c["eval"], "seed": 7000 + int(c["seed"])}}
        # one directory for every round: the plan is the same each round, so the current version, which played it
        # last round as the candidate (or as the current version, when that round was rejected), is not run again
        # (evaluate_arms reuses a checkpoint's episodes on a plan by fingerprint)
        named = {f"round_{r}_current": str(current), **{f"round_{r}_{k}": str(p) for k, p in candidates.items()}}
        res = evaluate_arms(cv, named, sd / "validation", n, units=units, progress=progress, acting=acting)
        res = {k[len(f"round_{r}_"):]: eps for k, eps in res.items()}
        rate = {k: sum(bool(e["success"]) for e in eps) / max(len(eps), 1) for k, eps in res.items()}
        best = max(candidates, key=lambda k: (rate[k], -list(candidates).index(k)))
        pd = paired_differences(res, [(best, "current")])["pairs"][0]
        cell = pd["average"]

        p_overall = p_worse(cell["wins"], cell["losses"])
        accept = cell["diff"] >= -tol or p_overall >= alpha
        # per task: a task that loses more than validate_task_tolerance, with the one-sided test at alpha (Holm's
        # step-down over the tasks with learner.validate_task_correction: holm), rejects
        lost = []
        if task_tol is not None:
            lost = tasks_lost(pd["tasks"], float(task_tol), alpha, task_correction)
            accept = accept and not lost
        others = ", ".join(f"{k} {100 * rate[k]:.1f}%" for k in candidates if k != best)
        print(f"  validation of round {r} on training units {units}{' (policies alone, K = 1)' if policy_alone else ''}: "
              f"{best} {100 * rate[best]:.1f}% vs v{v} {100 * rate['current']:.1f}% (paired {100 * cell['diff']:+.1f} pts, "
              f"{cell['wins']}/{cell['losses']}, one-sided p={p_overall:.2g}{'; ' + others if others else ''}"
              f"{'; tasks lost: ' + ', '.join(lost) if lost else ''}) -> "
              f"{'publish ' + best if accept else 'REJECTED'}", flush=True)
        return (best if accept else None), {
            "current_version": v, "candidate": rate[best], "current": rate["current"], "chosen": best,
            "rates": {k: rate[k] for k in candidates}, "diff": cell["diff"], "wins": cell["wins"],
            "losses": cell["losses"], "p_worse": p_overall, "accepted": accept, "policy_alone": policy_alone,
            "tasks": {t: {k: tc[k] for k in ("diff", "wins", "losses")} for t, tc in pd["tasks"].items()},
            "tasks_lost": lost}

    return validate
