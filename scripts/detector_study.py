"""Development study of the success detector on a labelled budget: variants x verdict rules, folds by episode.

A labelled budget (``<seed dir>/detector/records``, recorded by ``experiment=deployed``; best with
``labels.budget_full_length=true`` and the cameras to compare) is split into ``--folds`` parts by episode. In each
fold the detector (``policies.success_detector``) is fitted on 75 % of the other parts, its threshold chosen on the
remaining 25 % (the largest balanced accuracy over 0.05..0.95, as ``fleet.labels.fit_from_records`` does) for each
verdict rule, and the held-out part judged. Truth: the person's episode label (``success``).

Verdict rules: ``any`` (what the fleet runs: the first frame judged every ``--every`` steps above the threshold),
``k3`` (three consecutive judged frames above it), ``last`` (the episode's final frame); each also with per-task
thresholds (``<rule>_pt``: each task's own, chosen on its validation episodes). Frame labels (``--label``):
``ever`` (done from the success moment on) or ``now`` (done in that frame: the record's ``done_now``; records made
before it was kept take it from the store's ``progress.obj_to_target`` under Meta-World v3's success cuts).

    python scripts/detector_study.py --records <sd>/detector/records --out detdev.json --label now \\
        --variant all64 --variant grip64

Writes ``--out`` (JSON: per ``variant:label`` and rule, precision / recall / accuracy overall and per task; rerun to
add variants: those present are skipped) and ``<out>_<variant>_<label>.npz`` (each episode's held-out per-frame
probabilities). docs/RESULTS.md, experiment 50.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from policies.threads import passive_wait

passive_wait()   # before torch loads (policies/threads.py)

CAMS = ["corner", "topview", "gripperPOV"]
VARIANTS = {
    "pre64": {"cams": ["corner", "topview"], "size": 64, "updates": 800},
    "grip64": {"cams": ["gripperPOV"], "size": 64, "updates": 800},
    "all64": {"cams": CAMS, "size": 64, "updates": 800},
    "all96": {"cams": CAMS, "size": 96, "updates": 800},
    "all64_2k": {"cams": CAMS, "size": 64, "updates": 2000},
    "all64_nostate": {"cams": CAMS, "size": 64, "updates": 800, "state": False},
    "all96_nostate": {"cams": CAMS, "size": 96, "updates": 800, "state": False},
    # the depth cameras' point cloud (records made with labels.point_cloud=true): alone with proprioception, and
    # beside the wrist camera (experiment 53)
    "pc": {"cams": [], "size": 64, "updates": 800, "cloud": True},
    "pc_2k": {"cams": [], "size": 64, "updates": 2000, "cloud": True},
    "pc_grip64": {"cams": ["gripperPOV"], "size": 64, "updates": 800, "cloud": True},
    # each point with its colour (records made with labels.point_color=true; experiment 55): the reach goal is the
    # scene's one red object
    "pc_rgb": {"cams": [], "size": 64, "updates": 800, "cloud": True, "color": True},
    "pc_rgb_2k": {"cams": [], "size": 64, "updates": 2000, "cloud": True, "color": True},
    # the three cameras beside the coloured cloud (experiment 55's addendum: reach is best seen by the cameras,
    # window-open by the cloud)
    "all64_pc_rgb_2k": {"cams": CAMS, "size": 64, "updates": 2000, "cloud": True, "color": True},
    # experiment 58: the hand's proprioception 2, 4, 6, 8 steps back beside the coloured cloud (reach's success is a
    # moment); the 1,024-point cloud is pc_rgb_2k on records made with labels.num_points=1024
    "pc_rgb_2k_hist": {"cams": [], "size": 64, "updates": 2000, "cloud": True, "color": True, "history": 4},
}
# Meta-World v3's success cuts on info["obj_to_target"] (metaworld/envs/sawyer_*_v3.py), for records without
# per-frame marks
CUTS = {"reach-v3": 0.05, "button-press-topdown-v3": 0.024, "window-open-v3": 0.05}
RULES = ("any", "k3", "last")
HISTORY_EVERY = 2   # steps between a history's samples (the records' interval)


def resize(frames: np.ndarray, size: int) -> np.ndarray:
    """(..., H, W, 3) uint8 -> (..., size, size, 3) uint8 (area interpolation)."""
    import torch

    if frames.shape[-2] == size:
        return frames
    x = torch.as_tensor(frames).reshape(-1, *frames.shape[-3:]).permute(0, 3, 1, 2).float()
    x = torch.nn.functional.interpolate(x, size=(size, size), mode="area")
    return x.round().clamp(0, 255).byte().permute(0, 2, 3, 1).reshape(*frames.shape[:-3], size, size, 3).numpy()


def add_done_now(recs: list[dict], store_url: str) -> None:
    """Give records without ``done_now`` the simulator's per-frame success from the store (Meta-World cuts)."""
    from experience_dict.store import ExperienceStore

    todo = [r for r in recs if "done_now" not in r]
    if not todo:
        return
    reader = ExperienceStore.open(store_url)
    for r in todo:
        if str(r["task"]) not in CUTS:
            raise ValueError(f"record {r['episode_id']}: no per-frame marks and no known success cut for {r['task']}")
        d = reader.load_episode(r["episode_id"], keys=["progress.obj_to_target"])["progress.obj_to_target"]
        r["done_now"] = d[np.asarray(r["step"]) - 1] <= CUTS[str(r["task"])]


def verdict(p: np.ndarray, steps: np.ndarray, rule: str, tau: float, every: int) -> bool:
    """One episode's verdict from its per-frame probabilities ``p`` (K,) at ``steps`` (K,)."""
    judged = steps % every == 0
    q = p[judged] if judged.any() else p
    if rule == "any":
        return bool((q > tau).any())
    if rule == "k3":
        a = (q > tau).astype(int)
        return bool(len(a) >= 3 and np.convolve(a, np.ones(3, int), "valid").max() == 3)
    return bool(p[-1] > tau)


def balanced(pred, truth) -> float:
    from fleet.labels import binary_scores

    s = binary_scores(pred, truth)
    return 0.5 * (s["tp"] / max(s["tp"] + s["fn"], 1) + s["tn"] / max(s["tn"] + s["fp"], 1))


def run_variant(recs: list[dict], tasks: list[str], v: dict, label: str, folds: int, every: int):
    """Held-out verdicts ``{rule: (E,) bool}`` and per-frame probabilities of every episode for one variant."""
    import torch

    from fleet.labels import frame_labels, record_clouds, record_history
    from policies.success_detector import DetectorSpec, fit_detector

    cams = [str(c) for c in recs[0].get("cameras", CAMS)]   # the records' own camera order
    idx = [cams.index(c) for c in v["cams"]]
    cloud, color = bool(v.get("cloud", False)), bool(v.get("color", False))
    ch = 6 if color else 3

    def clouds_of(r):   # a coloured record's clouds are (K, N, 6): the colourless variants read the coordinates
        c = record_clouds(r)
        if c.shape[-1] < ch:
            raise ValueError(f"variant with colour: record {r.get('episode_id')} holds clouds without colour (record "
                             "the budget again with labels.point_color=true)")
        return c[..., :ch]

    # "state": False: the detector sees no proprioception (zeros), only the cameras
    R = [{**r, "frames": resize(r["frames"][:, idx], v["size"]),
          **({} if v.get("state", True) else {"state": np.zeros_like(r["state"])})} for r in recs]
    truth = np.array([bool(r["success"]) for r in R])
    parts = np.array_split(np.random.default_rng(0).permutation(len(R)), folds)
    pred = {rule + pt: np.zeros(len(R), bool) for rule in RULES for pt in ("", "_pt")}
    task_of = np.array([str(r["task"]) for r in R])
    traces: list = [None] * len(R)
    grid = np.round(np.arange(0.05, 0.96, 0.05), 2)

    H = int(v.get("history", 0))
    hists = [record_history(r, H, HISTORY_EVERY) if H else None for r in R]

    def stack(ids):
        sel = [R[i] for i in ids]
        return (torch.as_tensor(np.concatenate([r["frames"] for r in sel])),
                torch.as_tensor(np.concatenate([r["state"] for r in sel])),
                torch.as_tensor(np.concatenate([np.full(len(r["step"]), tasks.index(str(r["task"]))) for r in sel])),
                torch.as_tensor(np.concatenate([frame_labels(r, label) for r in sel])),
                torch.as_tensor(np.concatenate([clouds_of(r) for r in sel])) if cloud else None,
                torch.as_tensor(np.concatenate([hists[i] for i in ids])) if H else None)

    def probs(model, ids):
        out = []
        for i in ids:
            r = R[i]
            t = torch.full((len(r["step"]),), model.task_index(str(r["task"])))
            out.append(np.concatenate([model.probability(
                torch.as_tensor(r["frames"][a:a + 256]), torch.as_tensor(r["state"][a:a + 256]), t[a:a + 256],
                torch.as_tensor(clouds_of(r)[a:a + 256]) if cloud else None,
                torch.as_tensor(hists[i][a:a + 256]) if H else None).numpy()
                for a in range(0, len(t), 256)]))
        return out

    t0 = time.time()
    for k, held in enumerate(parts):
        rest = np.random.default_rng(k).permutation(np.setdiff1d(np.arange(len(R)), held))
        n_val = round(0.25 * len(rest))
        val, fit = rest[:n_val], rest[n_val:]
        spec = DetectorSpec(tasks=tasks, cameras=v["cams"], image_size=v["size"],
                            state_dim=int(R[0]["state"].shape[-1]),
                            num_points=int(record_clouds(R[0]).shape[1]) if cloud else 0, point_color=color,
                            history=H, history_every=HISTORY_EVERY)
        *data, clouds, hist = stack(fit)
        model, info = fit_detector(spec, *data, clouds=clouds, history=hist, updates=v["updates"], batch_size=64,
                                   seed=k)
        pv, ph = probs(model, val), probs(model, held)
        for p, i in zip(ph, held):
            traces[i] = p

        def best_tau(rule, sel):   # sel: (len(val),) bool
            return max(grid, key=lambda x: (balanced([verdict(p, R[i]["step"], rule, x, every)
                                                      for p, i, s in zip(pv, val, sel) if s], truth[val][sel]),
                                            -abs(x - 0.5)))

        for rule in RULES:
            tau = best_tau(rule, np.ones(len(val), bool))
            pred[rule][held] = [verdict(p, R[i]["step"], rule, tau, every) for p, i in zip(ph, held)]
            # per-task thresholds: each task's own on its validation episodes (the overall one where they hold
            # one class only)
            taus = {}
            for t in tasks:
                sel = task_of[val] == t
                taus[t] = best_tau(rule, sel) if 0 < truth[val][sel].sum() < sel.sum() else tau
            pred[rule + "_pt"][held] = [verdict(p, R[i]["step"], rule, taus[task_of[i]], every)
                                        for p, i in zip(ph, held)]
        print(f"  fold {k}: fitted on {len(fit)} episodes in {time.time() - t0:.0f} s (loss {info['loss']:.3f})",
              flush=True)
    return pred, traces


def main(argv: list[str] | None = None) -> int:
    from fleet.labels import binary_scores, load_records

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", required=True, help="<seed dir>/detector/records")
    ap.add_argument("--store", default=None, help="the seed's store (default: <records>/../../store)")
    ap.add_argument("--out", required=True, help="results JSON (variants already there are skipped)")
    ap.add_argument("--label", choices=["ever", "now"], default="now")
    ap.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="repeatable; default: all")
    ap.add_argument("--folds", type=int, default=3)
    ap.add_argument("--every", type=int, default=5, help="the fleet's judging interval (steps)")
    ap.add_argument("--updates", type=int, default=None, help="override every variant's updates (a quick check)")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    recs = load_records(a.records)
    if a.label == "now":
        add_done_now(recs, a.store or str(Path(a.records).parent.parent / "store"))
    tasks = sorted({str(r["task"]) for r in recs})
    truth = np.array([bool(r["success"]) for r in recs])
    print(f"{len(recs)} labelled episodes ({int(truth.sum())} successes), tasks {tasks}", flush=True)
    out = Path(a.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    for name in a.variant or list(VARIANTS):
        key = f"{name}:{a.label}"
        if key in results:
            continue
        v = {**VARIANTS[name], **({"updates": a.updates} if a.updates else {})}
        pred, traces = run_variant(recs, tasks, v, a.label, a.folds, a.every)
        res = {}
        for rule, p in pred.items():
            per = {t: binary_scores(p[[str(r["task"]) == t for r in recs]], truth[[str(r["task"]) == t for r in recs]])
                   for t in tasks}
            res[rule] = {"all": binary_scores(p, truth), "tasks": per}
            s = res[rule]["all"]
            print(f"{key} {rule}: precision {s['precision'] or 0:.3f} recall {s['recall'] or 0:.3f} accuracy "
                  f"{s['accuracy']:.3f} | " + " ".join(f"{t}: {q['precision'] or 0:.2f}/{q['recall'] or 0:.2f}"
                                                       for t, q in per.items()), flush=True)
        results[key] = res
        out.write_text(json.dumps(results, indent=1))
        np.savez(out.with_name(f"{out.stem}_{name}_{a.label}.npz"), *traces)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
