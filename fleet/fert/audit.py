"""Retrieval audit, written with every FERT round (after "Beyond End-Task Success": a retrieval-driven result
reports which stored experiences were selected, and the best single experience in hindsight beside random
selection and the rule itself).

What is measured, concretely (per task, and pooled over tasks where it makes sense)
----------------------------------------------------------------------------------
1. Selection distribution. A *selection* is one (failure context, retrieved window) pair of the round; its
   *source* is the successful episode the window comes from. Over the selection counts ``n_e`` of the
   source episodes:

   * ``entropy`` (nats) of ``n_e / sum n``; ``effective_number = exp(entropy)`` (1 = one source only);
   * ``top1_share`` = the most-selected source's share of all selections;
   * ``gini`` over *all indexed* successful episodes of the task (unselected ones count 0): 0 = every
     candidate selected equally, -> 1 = all selections on one candidate;
   * ``coverage`` = selected sources / indexed candidates;
   * selections per source unit (``per_unit``) and per task.

2. Hindsight comparison on a retrieval-quality proxy. The true quantity - the success of a policy trained
   on one fixed experience - would need one training run per candidate and is not available inside a round.
   The proxy, on the scale the rule itself optimises, is *how well a choice matches the failure contexts*:
   the mean over the task's contexts of the cosine similarity between the context and the best-matching
   window of the choice.

   * ``rule_top1``: the rule's own best neighbour per context (= ``max`` over all indexed windows);
   * ``rule_topk_weighted``: the softmax-weighted mean similarity of the k windows the rule supervises with;
   * ``best_single_selected``: in hindsight, the one *selected* source episode that alone would have served
     all contexts of the task best: ``argmax_e mean_c max_{w in e} sim(c, w)``, with its id, unit and score;
   * ``best_single_any``: the same over every indexed episode of the task;
   * ``random_single``: the expected score of one source episode drawn uniformly from the indexed ones
     (exact mean over candidates of ``mean_c max_{w in e} sim(c, w)``);
   * ``random_window``: the expected similarity of one window drawn uniformly from the index (exact:
     ``mean_c q_c . mean_w x_w``, embeddings being L2-normalised).

   ``rule_top1 >= best_single_any >= random_single`` always holds; the gaps say how much per-context
   retrieval buys over one fixed experience and over chance.

3. Outcome (optional). ``outcomes`` from :func:`round_outcomes`: success of the episodes the fleet collected
   with the policy versions trained on this round, per task, with 95% Wilson intervals - the end-task success
   of the rule, reported beside the proxy above, not mixed into it.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from experience_dict.stats import wilson_interval
from fleet.fert.index import SuccessIndex
from fleet.fert.retrieve import Retrieval


def concentration(counts: Iterable[float], n_candidates: int | None = None) -> dict[str, float]:
    """Concentration metrics of selection counts (see the module docstring).

    Args:
        counts: selections per selected source (> 0 entries; zeros are ignored for entropy / top-1).
        n_candidates: size of the candidate pool for ``gini`` and ``coverage`` (>= number of sources);
            None = the selected sources only.

    Returns:
        ``{"selections", "sources", "entropy", "effective_number", "top1_share", "gini", "coverage"}``
        (NaN-free; an empty selection gives zeros).

    Raises:
        ValueError: negative counts or ``n_candidates`` smaller than the number of sources.
    """
    arr = np.asarray(list(counts), np.float64)
    if np.any(arr < 0):
        raise ValueError(f"counts: expected non-negative selection counts, given min {arr.min()}")
    c = arr[arr > 0]
    n = len(c) if n_candidates is None else int(n_candidates)
    if n < len(c):
        raise ValueError(f"n_candidates: expected >= {len(c)} (selected sources), given {n}")
    total = c.sum()
    if total == 0:
        return {"selections": 0.0, "sources": 0, "entropy": 0.0, "effective_number": 0.0, "top1_share": 0.0,
                "gini": 0.0, "coverage": 0.0}
    p = c / total
    ent = float(-(p * np.log(p)).sum())
    full = np.sort(np.concatenate([c, np.zeros(n - len(c))]))
    ranks = np.arange(1, n + 1)
    gini = float((2 * (ranks * full).sum()) / (n * full.sum()) - (n + 1) / n) if n > 1 else 0.0
    return {"selections": float(total), "sources": len(c), "entropy": ent,
            "effective_number": float(math.exp(ent)), "top1_share": float(p.max()), "gini": max(gini, 0.0),
            "coverage": float(len(c) / n)}


def round_outcomes(reader, min_version: int, exclude_units: Iterable[int] = (),
                   max_version: int | None = None) -> dict[str, dict]:
    """Success per task of non-demo episodes collected with ``min_version <= policy_version <= max_version``
    on units outside ``exclude_units``: ``{task: {"successes", "episodes", "rate", "ci95": [lo, hi]}}``."""
    excl = {int(u) for u in exclude_units}
    tally: dict[str, list[int]] = {}
    for m in reader.episodes(is_demo=False):
        v = int(m.policy_version)
        if int(m.unit_id) in excl or v < min_version or (max_version is not None and v > max_version):
            continue
        t = tally.setdefault(m.task, [0, 0])
        t[0] += int(bool(m.success))
        t[1] += 1
    return {task: {"successes": s, "episodes": n, "rate": s / n, "ci95": list(wilson_interval(s, n))}
            for task, (s, n) in sorted(tally.items())}


def _hindsight(retrieval: Retrieval, index: SuccessIndex, task: str, ctx: np.ndarray,
               selected: set[str], chunk: int = 1 << 15) -> dict:
    """Similarity-proxy comparison of the rule, best single experience and random choice for one task.

    Reads the task's faiss index in chunks of ``chunk`` windows, so memory stays O(contexts x chunk)."""
    q = retrieval.query[ctx]                                            # (C, E)
    ti = index.tasks[task]
    ep_pos = np.asarray(ti.episode, np.int64)                           # (N,) windows of an episode are contiguous
    eps, dense = np.unique(ep_pos, return_inverse=True)
    best_in_ep = np.full((len(q), len(eps)), -np.inf, np.float32)       # (C, n_episodes)
    l2 = getattr(index, "metric", "ip") == "l2"
    # similarity: cosine for the absolute key; minus the distance in metres for the relative (L2) key
    sim = (lambda q_, x_: -np.sqrt(np.maximum(((q_[:, None, :] - x_[None]) ** 2).sum(-1), 0.0))) if l2 \
        else (lambda q_, x_: q_ @ x_.T)
    x_sum = np.zeros(ti.index.d, np.float64)
    sim_sum = np.zeros(len(q), np.float64)
    for a in range(0, ti.index.ntotal, chunk):
        x = ti.index.reconstruct_n(a, min(chunk, ti.index.ntotal - a))  # (n, E)
        x_sum += x.sum(axis=0)
        s_qx = sim(q, x)
        sim_sum += s_qx.sum(axis=1)
        d = dense[a:a + len(x)]
        starts = np.flatnonzero(np.r_[True, d[1:] != d[:-1]])
        m = np.maximum.reduceat(s_qx, starts, axis=1)                   # per episode within the chunk
        best_in_ep[:, d[starts]] = np.maximum(best_in_ep[:, d[starts]], m)
    score = best_in_ep.mean(axis=0)                                     # (n_episodes,)
    ids = [index.episode_ids[e] for e in eps]
    sel = np.array([i in selected for i in ids])
    rows = np.isin(retrieval.context, ctx)
    topk = []
    for c in ctx:
        r = retrieval.context == c
        w = retrieval.weight[r]
        topk.append(float((w * retrieval.similarity[r]).sum() / w.sum()) if w.sum() > 0 else float("nan"))

    def best(mask):
        if not mask.any():
            return None
        j = int(np.flatnonzero(mask)[np.argmax(score[mask])])
        return {"episode_id": ids[j], "unit_id": int(index.meta[ids[j]].unit_id), "score": float(score[j])}

    return {"contexts": len(ctx), "candidates": len(eps), "windows": int(ti.index.ntotal),
            "selections": int(rows.sum()),
            "rule_top1": float(best_in_ep.max(axis=1).mean()),
            "rule_topk_weighted": float(np.nanmean(topk)) if np.isfinite(topk).any() else None,
            "best_single_selected": best(sel), "best_single_any": best(np.ones(len(eps), bool)),
            "random_single": float(score.mean()),
            "random_window": float((sim_sum / ti.index.ntotal).mean()),
            "similarity": "minus L2 distance, metres" if l2 else "cosine"}


def retrieval_audit(retrieval: Retrieval, index: SuccessIndex, round_idx: int = 0,
                    outcomes: Mapping[str, Mapping] | None = None) -> dict:
    """The audit record of one FERT round (JSON-able dict; see the module docstring for every field)."""
    if retrieval.query is None:
        raise ValueError("retrieval.query: the audit needs the context embeddings (retrieve() keeps them)")
    per_task = {}
    tasks = sorted({c.task for c in retrieval.contexts})
    for task in tasks:
        ctx = np.array([i for i, c in enumerate(retrieval.contexts) if c.task == task], np.int64)
        rows = np.flatnonzero(np.isin(retrieval.context, ctx))
        counts = Counter(retrieval.episode_id[r] for r in rows)
        units = Counter(int(retrieval.source_unit[r]) for r in rows)
        n_cand = len({index.episode_ids[p] for p in index.tasks[task].episode}) if task in index.tasks else 0
        entry = {"concentration": concentration(list(counts.values()), max(n_cand, len(counts))),
                 "per_unit": {str(u): n for u, n in sorted(units.items())},
                 "context_units": dict(sorted(Counter(str(retrieval.contexts[i].unit_id) for i in ctx).items())),
                 "top_sources": [{"episode_id": e, "unit_id": int(index.meta[e].unit_id), "selections": n}
                                 for e, n in counts.most_common(5)]}
        if retrieval.distance is not None and len(rows):
            dist = retrieval.distance[rows]
            entry["neighbour_distance"] = {
                "unit": "metres (relative key)" if getattr(index, "metric", "ip") == "l2" else "1 - cosine",
                "median": float(np.nanmedian(dist)), "mean": float(np.nanmean(dist)), "max": float(np.nanmax(dist))}
        if retrieval.gain is not None and len(rows) and np.isfinite(retrieval.gain[rows]).any():
            entry["segment_gain_mean"] = float(np.nanmean(retrieval.gain[rows]))
        if retrieval.own_retry is not None and len(rows):
            entry["own_retry_share"] = float(retrieval.own_retry[rows].mean())
        if index.size(task) and len(rows):
            entry["hindsight"] = _hindsight(retrieval, index, task, ctx, set(counts))
        if task in index.tasks:   # exact (flat) or approximate (IVF, above SuccessIndex.approx_above) search
            ti = index.tasks[task]
            entry["index"] = {"kind": "ivf" if ti.approx else "exact", "windows": int(ti.index.ntotal),
                              "recall_at_8": index.recall(task, retrieval.query[ctx[:64]], 8) if len(ctx) else None}
        per_task[task] = entry
    all_counts = Counter(retrieval.episode_id)
    n_all = len(index.episode_ids)
    return {"round": int(round_idx),
            "definitions": "see fleet/fert/audit.py module docstring",
            "contexts": len(retrieval.contexts), "selections": len(retrieval),
            "overall": {"concentration": concentration(list(all_counts.values()), max(n_all, len(all_counts))),
                        "per_unit": {str(u): int(n) for u, n in sorted(Counter(retrieval.source_unit.tolist()).items())},
                        "per_task": dict(sorted(Counter(retrieval.source_task).items()))},
            "per_task": per_task,
            "outcomes": dict(outcomes) if outcomes is not None else None}


def plot_audit(audit: Mapping, path: str | Path) -> Path:
    """Small PNG: selections per source unit per task (stacked) and the hindsight similarity comparison."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(audit["per_task"])
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    units = sorted({u for t in tasks for u in audit["per_task"][t]["per_unit"]}, key=int)
    bottom = np.zeros(len(tasks))
    for u in units:
        h = np.array([audit["per_task"][t]["per_unit"].get(u, 0) for t in tasks], float)
        a.bar(tasks, h, bottom=bottom, label=f"unit {u}")
        bottom += h
    a.set_title(f"round {audit['round']}: selections per source unit")
    a.set_ylabel("selections")
    if units:
        a.legend(fontsize=7)
    arms = [("rule_top1", "rule top-1"), ("best_single_any", "best single (any)"),
            ("best_single_selected", "best single (selected)"), ("random_single", "random episode"),
            ("random_window", "random window")]
    width = 0.8 / len(arms)
    for j, (key, label) in enumerate(arms):
        vals = []
        for t in tasks:
            h = audit["per_task"][t].get("hindsight") or {}
            v = h.get(key)
            vals.append((v or {}).get("score", np.nan) if isinstance(v, dict) or v is None else v)
        b.bar(np.arange(len(tasks)) + j * width, vals, width, label=label)
    b.set_xticks(np.arange(len(tasks)) + 0.4 - width / 2, tasks)
    b.set_ylabel("mean cosine similarity to failure contexts")
    b.set_title("hindsight comparison (proxy)")
    b.legend(fontsize=7)
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def write_retrieval_audit(retrieval: Retrieval, index: SuccessIndex, out_dir: str | Path, round_idx: int,
                          outcomes: Mapping[str, Mapping] | None = None, tokenizer_range: dict | None = None) -> dict:
    """Write ``<out_dir>/retrieval_audit_round_<NNN>.json`` and ``.png``; returns the audit dict (with the
    two paths under ``"files"`` and, under ``"retrieved"``, :meth:`Retrieval.to_json`: every failure context and
    the windows it retrieved). ``tokenizer_range``: the round's :meth:`ActionTokenizer.range_report` of the
    fleet's new actions (how many action groups the AED tokenizer clipped), kept under that key."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    audit = retrieval_audit(retrieval, index, round_idx, outcomes)
    if tokenizer_range is not None:
        audit["tokenizer_range"] = tokenizer_range
    stem = out / f"retrieval_audit_round_{round_idx:03d}"
    png = plot_audit(audit, stem.with_suffix(".png"))
    audit["files"] = {"json": str(stem.with_suffix(".json")), "png": str(png)}
    audit["retrieved"] = retrieval.to_json()   # every failure context and its retrieved windows (fleet/stages.py reads it)
    stem.with_suffix(".json").write_text(json.dumps(audit, indent=1))
    return audit
