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

    Episodes are matched on ``(task, unit_id, seed)`` (:func:`fleet.experiment.evaluation.evaluation_plan` gives every arm
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
    return _save(fig, path)


def paired_over_seeds(results_by_seed: Mapping[int, Mapping[str, Iterable[Mapping]]],
                      pairs: Sequence[tuple[str, str]], n_boot: int = 10_000, seed: int = 0) -> dict:
    """Paired differences between arms over several experiment seeds, bootstrapped over seeds, then trials.

    Each experiment seed redraws the demonstrations' noise, the base policy, the fleet, the retries and every
    arm's fine-tuning; every seed evaluates every arm on the same held-out trials. A single seed's paired
    interval counts trial noise only; changing only the fine-tuning seed moved one arm by 5.8 points, so the
    interval here resamples the seeds with replacement and then, within each drawn seed, its matched trials
    within each task (a two-stage cluster bootstrap, Davison & Hinkley 1997, section 3.8; percentile interval).
    With one seed it reduces to :func:`paired_differences`' trial bootstrap.

    Args:
        results_by_seed: ``{experiment seed: {arm: [episode results with task, unit_id, seed, success]}}``.
        pairs: ``[(arm, baseline), ...]``; a pair is reported when both arms ran in every seed.
        n_boot: bootstrap resamples; seed: bootstrap RNG seed.

    Returns:
        ``{"pairs": [{"arm", "baseline", "tasks": {task: cell}, "average": cell, "per_seed": {s: diff}}],
        "tasks": [...], "seeds": [...]}``; cells as :func:`paired_differences` (``pairs`` counts every matched
        trial over all seeds) plus ``"seeds"``.

    Raises:
        ValueError: no seeds, or an arm with two episodes of one trial within a seed.
    """
    import numpy as np
    from scipy.stats import binomtest

    seeds = sorted(results_by_seed)
    if not seeds:
        raise ValueError("paired_over_seeds: no seeds")
    rng = np.random.default_rng(seed)
    out: dict = {"pairs": [], "tasks": [], "seeds": seeds}
    tasks_all: set[str] = set()
    for arm, base in pairs:
        if not all(arm in results_by_seed[s] and base in results_by_seed[s] for s in seeds):
            continue
        diffs: dict[int, dict[str, np.ndarray]] = {}
        for s in seeds:
            a = {(str(e["task"]), int(e["unit_id"]), int(e["seed"])): int(bool(e["success"]))
                 for e in results_by_seed[s][arm]}
            b = {(str(e["task"]), int(e["unit_id"]), int(e["seed"])): int(bool(e["success"]))
                 for e in results_by_seed[s][base]}
            common = sorted(set(a) & set(b))
            diffs[s] = {t: np.array([a[k] - b[k] for k in common if k[0] == t], np.float64)
                        for t in sorted({k[0] for k in common})}
        tasks = sorted(set().union(*[set(d) for d in diffs.values()]))
        tasks_all.update(tasks)
        choice = rng.integers(0, len(seeds), size=(n_boot, len(seeds)))     # seeds drawn per resample
        row = {"arm": arm, "baseline": base, "tasks": {}, "average": None,
               "per_seed": {str(s): (float(np.concatenate(list(diffs[s].values())).mean()) if diffs[s] else None)
                            for s in seeds}}
        sums_all, counts_all = np.zeros((len(seeds), n_boot)), np.zeros(len(seeds))
        for t in tasks:
            sums, counts = np.zeros((len(seeds), n_boot)), np.zeros(len(seeds))
            for i, s in enumerate(seeds):
                d = diffs[s].get(t, np.zeros(0))
                if len(d):
                    sums[i] = d[rng.integers(0, len(d), size=(n_boot, len(d)))].sum(1)
                counts[i] = len(d)
            sums_all += sums
            counts_all += counts
            boot = _seed_boot(sums, counts, choice)
            d_all = np.concatenate([diffs[s].get(t, np.zeros(0)) for s in seeds])
            row["tasks"][t] = {**_paired_cell(d_all, boot, binomtest), "seeds": len(seeds)}
        d_all = np.concatenate([d for s in seeds for d in diffs[s].values()]) if tasks else np.zeros(0)
        row["average"] = {**_paired_cell(d_all, _seed_boot(sums_all, counts_all, choice), binomtest),
                          "seeds": len(seeds)}
        out["pairs"].append(row)
    out["tasks"] = sorted(tasks_all)
    return out


def _seed_boot(sums, counts, choice):
    """Pooled mean difference per resample: sum over the drawn seeds of their resampled trial sums / trials."""
    import numpy as np

    b = np.arange(choice.shape[0])
    tot = sums[choice, b[:, None]].sum(1)
    n = counts[choice].sum(1)
    return tot / np.maximum(n, 1)


def plot_arms(table: Mapping, path: str | Path, title: str = "held-out success per arm",
              rounds: Mapping[str, Sequence[Mapping]] | None = None) -> Path:
    """Every arm's held-out success side by side: pooled over tasks (and seeds) with its Wilson 95% interval
    (left), and per task (middle); with ``rounds`` (``{label: [{"round", "successes", "trials"}]}``) holding
    more than one round, a third panel shows them per policy version (``"round"``: the version acting: the fleet on
    training units, and the main job's learning curve: each version on the held-out plan), its y axis fitted to
    the rates shown.

    Args:
        table: :func:`success_table` output. path: output PNG path. title: figure title.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    arms, tasks = list(table["arms"]), list(table["tasks"])
    show_rounds = bool(rounds) and any(len(p) > 1 for p in rounds.values())
    n_panels = 3 if show_rounds else 2
    fig, axes = plt.subplots(1, n_panels, figsize=(4 + 0.9 * len(arms) + 4 + 4 * (n_panels - 2), 4.4), dpi=120,
                             squeeze=False)
    cmap = plt.get_cmap("tab10")
    colors = [cmap(i % 10) for i in range(len(arms))]
    ax = axes[0][0]
    rates = np.array([table["arms"][a]["average"]["rate"] for a in arms])
    lo = np.array([table["arms"][a]["average"]["ci95"][0] for a in arms])
    hi = np.array([table["arms"][a]["average"]["ci95"][1] for a in arms])
    xs = np.arange(len(arms))
    ax.bar(xs, rates, color=colors)
    ax.errorbar(xs, rates, yerr=[rates - lo, hi - rates], fmt="none", ecolor="black", capsize=4)
    for x, r, h in zip(xs, rates, hi):
        ax.text(x, min(h + 0.02, 0.96), f"{100 * r:.1f}", ha="center", fontsize=8)
    ax.set_xticks(xs, arms, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("held-out success rate (Wilson 95%)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax = axes[0][1]
    width = 0.8 / max(len(arms), 1)
    for i, a in enumerate(arms):
        r = [table["arms"][a]["tasks"].get(t, {}).get("rate", np.nan) for t in tasks]
        ax.bar(np.arange(len(tasks)) + (i - (len(arms) - 1) / 2) * width, r, width, color=colors[i], label=a,
               edgecolor="white", linewidth=0.5)
    ax.set_xticks(np.arange(len(tasks)), tasks, fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.set_title("per task", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    # below the axes: inside, it covered the bars of a task every arm solves (drawer-close at 100%)
    ax.legend(fontsize=7, ncol=min(len(arms), 4), loc="upper center", bbox_to_anchor=(0.5, -0.09), frameon=False)
    if show_rounds:
        ax2 = axes[0][2]
        shown = []
        for label, pts in rounds.items():
            if pts:
                ys = [p["successes"] / max(p["trials"], 1) for p in pts]
                shown += ys
                ax2.plot([p["round"] for p in pts], ys, marker="o", label=label)
        ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax2.set_xlabel("policy version acting (v1 = the base)")
        ax2.set_ylabel("success rate")
        lo, hi = min(shown, default=0.0), max(shown, default=1.0)   # a 71-100 % curve is not squashed into 0-100
        pad = max(0.05, 0.1 * (hi - lo))
        ax2.set_ylim(max(0.0, lo - pad), min(1.02, hi + pad))
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=7, loc="lower right")
        ax2.set_title("per round: the fleet (training units), the learning curve (held-out)", fontsize=9)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    """Tight layout, write ``path`` (parents created), close the figure; returns the path."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, bbox_inches="tight")   # keeps a legend placed outside the axes
    plt.close(fig)
    return path
