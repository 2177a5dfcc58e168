"""Evaluation tables: success rates with Wilson 95% intervals, per task and on average, per arm.

Writes the same table as Markdown and JSON, and plots success per FERT round per arm. Imports neither Ray
nor MuJoCo, so it serves `scripts/run.py`, `scripts/eval.py` and notebooks alike.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from experience_dict.stats import Z_95, wilson_interval  # noqa: F401  (re-exported)


def success_table(results: Mapping[str, Iterable[Mapping]]) -> dict:
    """Aggregate episode results into a per-arm, per-task success table.

    Args:
        results: ``{arm name: [episode result, ...]}``; each result is a mapping with at least ``task`` (str)
            and ``success`` (bool).

    Returns:
        JSON-able dict ``{"arms": {arm: {"tasks": {task: {"successes", "trials", "rate", "ci95"}},
        "average": {...}}}, "tasks": [sorted task names]}``. The average pools all episodes of the arm
        (tasks weighted by their trial counts; equal when every task has the same number of trials).
    """
    table: dict = {"arms": {}, "tasks": []}
    tasks: set[str] = set()
    for arm, episodes in results.items():
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for ep in episodes:
            counts = per_task[str(ep["task"])]
            counts[0] += int(bool(ep["success"]))
            counts[1] += 1
        tasks.update(per_task)
        arm_row = {"tasks": {}}
        total_s = total_n = 0
        for task, (s, n) in sorted(per_task.items()):
            arm_row["tasks"][task] = _cell(s, n)
            total_s += s
            total_n += n
        arm_row["average"] = _cell(total_s, total_n)
        table["arms"][arm] = arm_row
    table["tasks"] = sorted(tasks)
    return table


def paired_differences(results: Mapping[str, Iterable[Mapping]], pairs: Sequence[tuple[str, str]],
                       n_boot: int = 10_000, seed: int = 0) -> dict:
    """Trial-by-trial success differences between arms that ran the same evaluation plan.

    Episodes are matched on ``(task, unit_id, seed)`` (:func:`fleet.evaluation.evaluation_plan` gives every arm
    the same trials), so the initial-state variance cancels out of the difference. For each pair
    ``(arm, baseline)`` and each task (and pooled over tasks): the mean difference ``success(arm) -
    success(baseline)`` over matched trials, its 95% interval from a paired bootstrap (trials resampled with
    replacement, within each task for the pooled value; percentile interval, Efron & Tibshirani 1993), the
    discordant counts (``wins``: arm succeeded and baseline failed, ``losses``: the reverse) and the exact
    McNemar p-value (two-sided binomial test on the discordant pairs; ``scipy.stats.binomtest``).

    Args:
        results: ``{arm: [episode result with task, unit_id, seed, success]}``.
        pairs: ``[(arm, baseline), ...]``; pairs naming an arm not in ``results`` are skipped.
        n_boot: bootstrap resamples; seed: bootstrap RNG seed.

    Returns:
        ``{"pairs": [{"arm", "baseline", "tasks": {task: cell}, "average": cell}], "tasks": [...]}`` with cells
        ``{"pairs": n, "diff": float, "ci95": [lo, hi], "wins": int, "losses": int, "p_mcnemar": float}``
        (``diff`` in success-rate units, -1..1).

    Raises:
        ValueError: an arm has two episodes with the same ``(task, unit_id, seed)``.
    """
    import numpy as np
    from scipy.stats import binomtest

    def keyed(arm: str) -> dict:
        out = {}
        for ep in results[arm]:
            k = (str(ep["task"]), int(ep["unit_id"]), int(ep["seed"]))
            if k in out:
                raise ValueError(f"paired_differences: arm {arm!r} has two episodes of task {k[0]}, unit {k[1]}, "
                                 f"seed {k[2]}")
            out[k] = int(bool(ep["success"]))
        return out

    rng = np.random.default_rng(seed)
    out: dict = {"pairs": [], "tasks": []}
    tasks_all: set[str] = set()
    for arm, base in pairs:
        if arm not in results or base not in results:
            continue
        a, b = keyed(arm), keyed(base)
        common = sorted(set(a) & set(b))
        by_task: dict[str, np.ndarray] = {}
        for task in sorted({k[0] for k in common}):
            by_task[task] = np.array([a[k] - b[k] for k in common if k[0] == task], np.float64)
        tasks_all.update(by_task)
        row = {"arm": arm, "baseline": base, "tasks": {}, "average": None}
        boots = []
        for task, d in by_task.items():
            idx = rng.integers(0, len(d), size=(n_boot, len(d)))
            boots.append(d[idx].sum(1))
            row["tasks"][task] = _paired_cell(d, d[idx].mean(1), binomtest)
        d_all = np.concatenate(list(by_task.values())) if by_task else np.zeros(0)
        row["average"] = _paired_cell(d_all, (np.sum(boots, 0) / max(len(d_all), 1)) if boots else np.zeros(0),
                                      binomtest)
        out["pairs"].append(row)
    out["tasks"] = sorted(tasks_all)
    return out


def _paired_cell(d, boot, binomtest) -> dict:
    import numpy as np

    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    p = float(binomtest(min(wins, losses), wins + losses, 0.5).pvalue) if wins + losses else 1.0
    lo, hi = (np.percentile(boot, [2.5, 97.5]).tolist() if len(boot) else [float("nan")] * 2)
    return {"pairs": len(d), "diff": float(d.mean()) if len(d) else float("nan"), "ci95": [lo, hi],
            "wins": wins, "losses": losses, "p_mcnemar": p}


def paired_markdown(paired: Mapping) -> str:
    """Render :func:`paired_differences` output as Markdown: one row per ``arm − baseline`` pair, cells
    ``+x.x [lo, hi] pts (wins/losses, p)`` in percentage points."""
    return _markdown("arm − baseline", paired["tasks"],
                     [(f"{row['arm']} − {row['baseline']}", row["tasks"], row["average"]) for row in paired["pairs"]],
                     _fmt_paired)


def _fmt_paired(cell: Mapping | None) -> str:
    if not cell or not cell["pairs"]:
        return "–"
    lo, hi = cell["ci95"]
    return (f"{100 * cell['diff']:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] pts "
            f"({cell['wins']}/{cell['losses']}, p={cell['p_mcnemar']:.2g})")


def _cell(s: int, n: int) -> dict:
    lo, hi = wilson_interval(s, n)
    return {"successes": s, "trials": n, "rate": (s / n) if n else float("nan"), "ci95": [lo, hi]}


def table_markdown(table: Mapping) -> str:
    """Render :func:`success_table` output as a Markdown table: rows are arms, columns tasks + average.

    Each cell reads ``rate [low, high] (n)`` in percent.
    """
    return _markdown("arm", table["tasks"], [(arm, row["tasks"], row["average"]) for arm, row in table["arms"].items()],
                     _fmt)


def _markdown(first: str, tasks, rows, fmt) -> str:
    """A Markdown table: column ``first``, one column per task, ``average``; ``rows`` are ``(label, {task:
    cell}, average cell)``, each cell rendered by ``fmt``."""
    tasks = list(tasks)
    lines = [f"| {first} | " + " | ".join(tasks) + " | average |", "|---|" + "---|" * (len(tasks) + 1)]
    for label, cells, avg in rows:
        lines.append(f"| {label} | " + " | ".join([fmt(cells.get(t)) for t in tasks] + [fmt(avg)]) + " |")
    return "\n".join(lines) + "\n"


def _fmt(cell: Mapping | None) -> str:
    if not cell or not cell["trials"]:
        return "–"
    lo, hi = cell["ci95"]
    return f"{100 * cell['rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] (n={cell['trials']})"


def write_table(table: Mapping, out_dir: str | Path, name: str = "results") -> tuple[Path, Path]:
    """Write ``<name>.md`` and ``<name>.json`` into ``out_dir``; returns both paths."""
    return _write(table_markdown(table), table, out_dir, name)


def _write(markdown: str, obj: Mapping, out_dir: str | Path, name: str) -> tuple[Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(markdown)
    js.write_text(json.dumps(obj, indent=2))
    return md, js


def write_paired(paired: Mapping, out_dir: str | Path, name: str = "paired") -> tuple[Path, Path]:
    """Write :func:`paired_differences` output as ``<name>.md`` and ``<name>.json`` into ``out_dir``."""
    return _write(paired_markdown(paired), paired, out_dir, name)


def plot_success_per_round(history: Mapping[str, Sequence[Mapping]], path: str | Path,
                           title: str = "success rate per FERT round", x: str = "round",
                           xlabel: str | None = None) -> Path:
    """Plot success rate (with Wilson 95% band) against round (or another integer ``x``), one line per arm.

    Args:
        history: ``{arm: [{x: int, "successes": int, "trials": int}, ...]}`` (``x`` = "round" by default;
            "fleet_size" for the fleet-size sweep of scripts/run.py).
        path: output PNG path.
        title: plot title.
        x: the key of each point plotted on the horizontal axis.
        xlabel: axis label (default: ``x`` with underscores as spaces).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for arm, points in history.items():
        if not points:
            continue
        rounds = [p[x] for p in points]
        rates = [p["successes"] / max(p["trials"], 1) for p in points]
        bands = [wilson_interval(p["successes"], p["trials"]) for p in points]
        line = ax.plot(rounds, rates, marker="o", label=arm)[0]
        ax.fill_between(rounds, [b[0] for b in bands], [b[1] for b in bands], alpha=0.15,
                        color=line.get_color())
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel or x.replace("_", " "))
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
