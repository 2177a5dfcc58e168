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


def _cell(s: int, n: int) -> dict:
    lo, hi = wilson_interval(s, n)
    return {"successes": s, "trials": n, "rate": (s / n) if n else float("nan"), "ci95": [lo, hi]}


def table_markdown(table: Mapping) -> str:
    """Render :func:`success_table` output as a Markdown table: rows are arms, columns tasks + average.

    Each cell reads ``rate [low, high] (n)`` in percent.
    """
    tasks = list(table["tasks"])
    header = "| arm | " + " | ".join(tasks) + " | average |"
    sep = "|---|" + "---|" * (len(tasks) + 1)
    lines = [header, sep]
    for arm, row in table["arms"].items():
        cells = [_fmt(row["tasks"].get(t)) for t in tasks] + [_fmt(row["average"])]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _fmt(cell: Mapping | None) -> str:
    if not cell or not cell["trials"]:
        return "–"
    lo, hi = cell["ci95"]
    return f"{100 * cell['rate']:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] (n={cell['trials']})"


def write_table(table: Mapping, out_dir: str | Path, name: str = "results") -> tuple[Path, Path]:
    """Write ``<name>.md`` and ``<name>.json`` into ``out_dir``; returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / f"{name}.md", out / f"{name}.json"
    md.write_text(table_markdown(table))
    js.write_text(json.dumps(table, indent=2))
    return md, js


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
