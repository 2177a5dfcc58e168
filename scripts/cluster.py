"""The fleet on a real multi-node Ray cluster on this machine, with a node lost mid-run.

    python scripts/cluster.py                                     # 2 nodes, 4 units spread, node 1 killed
    python scripts/cluster.py +cluster.kill_after_episodes=null   # no node loss
    python scripts/cluster.py +cluster.units=8 +cluster.episodes_per_unit=6 \
        fleet.checkpoint=outputs/ckpt                             # a trained policy instead of the scripted expert

Starts a head and a second node as separate ``ray start`` process trees (``fleet.cluster.LocalRayCluster``; the
head offers the ``learner`` resource, as a GPU node would), spreads the units over both
(``fleet.placement=spread``), runs a fixed plan of trials and, once ``kill_after_episodes`` episodes are
committed, SIGKILLs the second node's raylet and workers. Ray re-places that node's units on the head; the
coordinator re-runs the trials that were cut off, and takes from the store any trial a dying worker had
already committed. Prints the run's summary and writes ``<output dir>/cluster.json``: the node loss (which
node, which units, when), where every unit ran last, committed episodes, lost (reported committed but not in
the store) and duplicated (unit, seed) trials, and whether the store verifies.

Exit status 0 when nothing was lost or duplicated and the store verifies, else 1. On real machines run the
same ``ray start`` commands one per machine and ``scripts/rollout.py fleet.ray_address=<head>:6379``
(docs/CLUSTER.md).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.progress import calm_progress
from policies.threads import passive_wait

passive_wait()   # before torch loads: OpenMP's idle threads sleep instead of spinning (policies/threads.py)
calm_progress()  # off a terminal, a progress bar redraws every 30 s, not 15 times a second (fleet/progress.py)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

DEFAULTS = {"nodes": [{"num_cpus": 1, "resources": {"learner": 1}}, {"num_cpus": 1}], "units": 4,
            "episodes_per_unit": 4, "kill_after_episodes": 4, "task": "reach-v3", "max_episode_steps": 80}


def run(cfg: DictConfig) -> dict:
    """Run the fleet on a local two-node cluster, lose a node (optional); returns the report (see module doc)."""
    import ray

    from experience_dict.store import ExperienceStore
    from fleet.cluster import LocalRayCluster
    from fleet.coordinator import Fleet, _plain
    from sim import unit_lists

    cl = {**DEFAULTS, **(OmegaConf.to_container(cfg.cluster, resolve=True) if "cluster" in cfg else {})}
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    c = _plain(cfg)
    c["task"].update(tasks=[cl["task"]], max_episode_steps=int(cl["max_episode_steps"]))
    units = list(range(int(cl["units"])))
    c["robot"]["train_units"] = sorted(set(units) | set(unit_lists(c["robot"])[0]))   # a list or a "start:stop" range
    c["store"] = {**c["store"], "url": str(out / "store")}
    cpus = sum(float(n.get("num_cpus", 1)) for n in cl["nodes"])
    c["fleet"].update(placement="spread", worker_cpus=min(1.0, cpus / len(units)) / 2,
                      max_restarts=max(int(c["fleet"].get("max_restarts", 3)), 3))
    plan = [{"task": cl["task"], "unit_id": u, "seed": 1000 * u + k}
            for k in range(int(cl["episodes_per_unit"])) for u in units]
    reported: list[str] = []
    kill = cl.get("kill_after_episodes")
    killed_pids: list[int] = []
    with LocalRayCluster(cl["nodes"], log_dir=out / "cluster_logs") as cluster:
        c["fleet"]["ray_address"] = cluster.address
        print(f"cluster up at {cluster.address}: {len(cl['nodes'])} nodes, logs in {out / 'cluster_logs'}", flush=True)
        try:
            with Fleet(c, policy=c["fleet"].get("checkpoint") or "expert", units=units) as fleet:
                placed = dict(fleet.unit_nodes)
                print("units per node: " + str(dict(Counter(n[:8] for n in placed.values()))), flush=True)
                box: dict = {}
                th = threading.Thread(target=lambda: box.update(r=fleet.run(
                    plan=plan, on_episode=lambda s: reported.append(s["episode_id"]))), daemon=True)
                th.start()
                if kill is not None and len(cl["nodes"]) > 1:
                    while len(reported) < int(kill) and th.is_alive():
                        time.sleep(0.1)
                    if th.is_alive():
                        killed_pids = cluster.kill_node(len(cl["nodes"]) - 1)
                        print(f"[cluster] SIGKILLed node {len(cl['nodes']) - 1} ({len(killed_pids)} processes) after "
                              f"{len(reported)} episodes", flush=True)
                th.join()
                result = box["r"]
        finally:
            ray.shutdown()
    store = ExperienceStore.open(c["store"]["url"])
    eps = store.episodes(quarantined=None)
    pairs = Counter((int(m.unit_id), int(m.seed)) for m in eps)
    missing = sorted({(t["unit_id"], t["seed"]) for t in plan} - set(pairs))
    report = {"nodes": cl["nodes"], "units": units, "plan_trials": len(plan), "placed": placed,
              "node_losses": result.node_losses, "unit_nodes": result.unit_nodes, "killed_pids": killed_pids,
              "restarts": result.restarts, "episodes_committed": len(eps),
              "recovered_from_store": result.recovered_from_store,
              "lost": sorted(set(reported) - {m.episode_id for m in eps}), "missing_trials": missing,
              "duplicated_unit_seed": {f"{u}:{s}": n for (u, s), n in pairs.items() if n > 1},
              "verify_ok": bool(store.verify()["ok"]), "summary": result.summary(), "wall_s": result.wall_s}
    (out / "cluster.json").write_text(json.dumps(report, indent=1))
    return report


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    from configs.schema import check_or_exit

    check_or_exit(cfg)   # every value against its rule, before any work
    r = run(cfg)
    print(f"\n{r['summary']}")
    print(f"{r['episodes_committed']} of {r['plan_trials']} planned trials committed; lost {len(r['lost'])}, "
          f"missing {len(r['missing_trials'])}, duplicated (unit, seed) {len(r['duplicated_unit_seed'])}; "
          f"verify ok={r['verify_ok']}; report in {Path(cfg.output_dir) / 'cluster.json'}")
    if r["lost"] or r["missing_trials"] or r["duplicated_unit_seed"] or not r["verify_ok"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
