"""Benchmark the fleet: aggregate env steps/s with 1, 2, 4 Ray workers and the policy server's throughput.

    python scripts/bench_fleet.py                                   # writes outputs/bench/bench_fleet.json
    python scripts/bench_fleet.py +bench.workers=[1,2,4,8] +bench.episodes=8 +bench.out=/tmp/b.json
    python scripts/bench_fleet.py +bench.cluster=true      # 32 units on a two-node cluster: outputs/bench/bench_cluster.json
    python scripts/bench_fleet.py +bench.server_vs_local=true   # fleets of 1/8/16 units: server vs per-worker inference
    python scripts/bench_fleet.py +bench.round=true         # the main job's batched fleet vs the env alone: bench_round.json

Workers are the real ``RobotWorker`` actors with the scripted expert, committing every episode to a Zarr
store in a temporary directory (state-only, then one 96x96 camera). The baseline is the same ``RobotWorker``
code run in this process, measured in the same run; scaling efficiency = aggregate / (workers x single).
Policy server: a small real ``AEDDiffusionPolicy`` (random weights: speed does not depend on them) served by one
``PolicyServer`` actor; ``batch`` requests are kept in flight at once, so each forward pass sees ``batch``
samples; throughput is executed actions/s (chunks/s x n_action_steps) and latency is per request, beside the
same forward pass called in this process.

Cluster mode (``+bench.cluster=true``): a real two-node Ray cluster on this machine (``fleet.cluster``, the
machine's cores split between the nodes), one unit and then ``bench.cluster_units`` (32) state-only units spread
over both nodes, all acting through the batched policy server with the small AED policy, in the same run:
episodes/s of the fleet against (cluster CPUs) x (one unit's episodes/s) (target >= 0.8), the server's batch-size
distribution and the store's commit latency (p50/p95 of every episode's commit).

Round mode (``+bench.round=true``, ``outputs/bench/bench_round.json``): what one fleet round of the main job costs
to act. The env alone (random actions, one env at a time in this process, on the round's tasks and units) against
the protocol's batched fleet (``fleet.experiment.protocol.VectorFleet``: ``fleet.units`` units, ``bench.round_episodes``
episodes each, tasks round-robin, ``eval.processes`` processes, waves of ``eval.batch_size``) acting with the default
policy (``configs/policy``; random weights, so every episode runs to ``max_episode_steps``), once alone (K = 1) and
once with a success critic choosing among ``fert.critic.candidates`` chunks; the same run measures all three.
Figures: env steps/s of each and the fleet's ratio to the env alone (the target: a fleet acting at >= 500 env
steps/s on 2 cores).

Server against per-worker inference (``+bench.server_vs_local=true``, ``outputs/bench/bench_server_vs_local.json``):
for each fleet size in ``bench.svl_units`` (1, 8, 16), the same units run the same episodes with the small AED
policy twice in one run, once with every worker running its own forward passes (batch 1, ``fleet.torch_threads``
threads each) and once through one batched ``PolicyServer`` (``fleet.server_max_wait_ms``), alternating
``bench.svl_repeats`` times; the figure is the fleet's episodes/s through the server over episodes/s with local
inference (the issue's target: above 1 from 8 units up on CPU). Random weights: every episode runs to
``max_episode_steps``, so both sides do the same number of steps and forward passes.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig, OmegaConf

import configs.typed  # noqa: F401 - registers the typed config groups before Hydra composes
from fleet.coordinator import _plain, ensure_ray
from fleet.worker import RobotWorker

DEFAULTS = {"workers": [1, 2, 4], "episodes": 6, "task": "reach-v3", "max_episode_steps": 100,
            "server_batches": [1, 8, 32], "server_rounds": 20, "out": "outputs/bench/bench_fleet.json",
            "cluster": False, "cluster_units": 32, "cluster_episodes": 2, "single_episodes": 6,
            "cluster_out": "outputs/bench/bench_cluster.json",
            "server_vs_local": False, "svl_units": [1, 8, 16], "svl_episodes": 2, "svl_repeats": 2,
            "svl_out": "outputs/bench/bench_server_vs_local.json",
            "round": False, "round_episodes": 3, "round_env_episodes": 6, "round_out": "outputs/bench/bench_round.json"}


def _cfg(base: dict, images: bool, bench: dict) -> dict:
    c = json.loads(json.dumps(base))
    c["obs"].update(images=images, image_size=96, cameras=["corner"])
    c["task"].update(tasks=[bench["task"]], max_episode_steps=int(bench["max_episode_steps"]))
    return c


def bench_single(cfg: dict, n_episodes: int, store: str) -> float:
    """Env steps/s of one RobotWorker in this process (expert, store writes included)."""
    w = RobotWorker(999, cfg["task"]["tasks"], cfg, store, {"kind": "expert"})
    w.run_episodes(1)  # warm-up (env, renderer, store arrays)
    t = time.perf_counter()
    steps = sum(s["length"] for s in w.run_episodes(n_episodes))
    dt = time.perf_counter() - t
    w.close()
    return steps / dt


def bench_workers(cfg: dict, k: int, n_episodes: int, store: str) -> float:
    """Aggregate env steps/s of ``k`` RobotWorker actors running ``n_episodes`` each at once."""
    import ray

    actor = ray.remote(RobotWorker).options(num_cpus=0.01, max_concurrency=2)
    workers = [actor.remote(u, cfg["task"]["tasks"], cfg, store, {"kind": "expert"}) for u in range(k)]
    ray.get([w.run_episodes.remote(1) for w in workers])  # warm-up
    t = time.perf_counter()
    results = ray.get([w.run_episodes.remote(n_episodes) for w in workers])
    dt = time.perf_counter() - t
    for w in workers:
        ray.kill(w)
    return sum(s["length"] for r in results for s in r) / dt


def small_policy_checkpoint(path: str) -> str:
    """A small real AED diffusion policy (dim 64, 2 layers, horizon 16, 10 DDIM steps, AED on)."""
    import torch

    from experience_dict.tokenizer import ActionTokenizer
    from policies.aed_diffusion import AEDConfig, AEDDiffusionConfig, AEDDiffusionPolicy, MTLossConfig

    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    acts = [np.clip(np.cumsum(rng.normal(0, 0.1, (80, 4)), 0), -1, 1).astype(np.float32) for _ in range(8)]
    tok = ActionTokenizer.fit(acts, r=4, relative_dims=[0, 1, 2], absolute_dims=[3], vocab_size=256)
    stats = {"observation.state": {"min": [-0.5, 0.3, 0.0, 0.0], "max": [0.5, 0.9, 0.3, 1.0]},
             "observation.environment_state": {"min": [-1.0] * 17, "max": [1.0] * 17},
             "action": {"min": [-1.0] * 4, "max": [1.0] * 4}}
    cfg = AEDDiffusionConfig(dim=64, n_layers=2, n_heads=4, state_hidden=64, horizon=16, n_action_steps=8,
                             action_patch=1, condition_layers=None,  # the denoiser form the benchmark was measured on
                             num_inference_steps=10, aed=AEDConfig(history_actions=8, group_size=4),
                             mt_loss=MTLossConfig(weight=0.0))
    policy = AEDDiffusionPolicy(cfg, stats, tok)
    policy.save_pretrained(path)
    return path, sum(p.numel() for p in policy.parameters())


def bench_server(ckpt: str, batches: list[int], rounds: int, max_wait_ms: float = 5.0) -> dict:
    """Policy-server throughput/latency with ``batch`` requests in flight, beside in-process forward passes."""
    import ray
    import torch

    from fleet.acting import ObservationHistory, load_checkpoint
    from fleet.policy_server import PolicyServer

    torch.set_num_threads(1)
    server = ray.remote(PolicyServer).options(num_cpus=0.01, max_concurrency=1000).remote(
        path=ckpt, device="auto", max_batch=max(batches), max_wait_ms=max_wait_ms)
    info = ray.get(server.info.remote(None))
    hist = ObservationHistory(info["window_spec"], info["action_dim"])
    rng = np.random.default_rng(0)
    for _ in range(10):
        hist.push_obs({"observation.state": rng.normal(size=4).astype(np.float32),
                       "observation.environment_state": rng.normal(size=17).astype(np.float32)})
        hist.push_action(rng.uniform(-1, 1, 4).astype(np.float32))
    sample = hist.sample()
    model, _ = load_checkpoint(ckpt, "cpu")
    out = {"n_action_steps": info["n_action_steps"], "horizon": info["horizon"], "max_wait_ms": max_wait_ms,
           "per_batch": {}}
    for b in batches:
        ray.get([server.predict_chunk.remote(sample, info["version"]) for _ in range(b)])  # warm-up
        ray.get(server.stats.remote(True))
        lat = []
        t = time.perf_counter()
        for _ in range(rounds):
            t0 = time.perf_counter()
            ray.get([server.predict_chunk.remote(sample, info["version"]) for _ in range(b)])
            lat.append(time.perf_counter() - t0)
        dt = time.perf_counter() - t
        st = ray.get(server.stats.remote(True))
        batch = {k: torch.as_tensor(np.stack([sample[k]] * b)) for k in sample}
        with torch.no_grad():
            model.predict_action_chunk(batch)
            t1 = time.perf_counter()
            for _ in range(max(rounds // 4, 3)):
                model.predict_action_chunk(batch)
            local = (time.perf_counter() - t1) / max(rounds // 4, 3)
        out["per_batch"][str(b)] = {
            "chunks_per_s": b * rounds / dt,
            "actions_per_s": b * rounds * info["n_action_steps"] / dt,
            "latency_ms_p50": float(np.percentile(lat, 50) * 1e3),
            "latency_ms_p95": float(np.percentile(lat, 95) * 1e3),
            "server_mean_batch": st["mean_batch"],
            "server_forward_ms": st["forward_ms_mean"],
            "in_process_forward_ms": local * 1e3,
            "in_process_actions_per_s": b * info["n_action_steps"] / local,
            "server_vs_in_process": (b * rounds / dt) / (b / local),
        }
    out["device"] = st["device"]
    ray.kill(server)
    return out


def _fleet_rate(c: dict, ckpt: str, units: list[int], episodes: int, use_server: bool = True) -> dict:
    """Episodes/s of a fleet of ``units`` acting through the policy server (``use_server=False``: each worker runs
    its own forward passes), after one warm-up episode each."""
    from fleet.coordinator import Fleet

    with Fleet(c, policy=ckpt, units=units, use_server=use_server) as fleet:
        fleet.run(episodes_per_unit=1, progress=False)           # warm-up: envs, policy loads, store arrays
        fleet.server_stats(reset=True)
        t = time.perf_counter()
        res = fleet.run(episodes_per_unit=episodes, progress=len(units) > 1)
        dt = time.perf_counter() - t
        server = fleet.server_stats()
        nodes = sorted(set(fleet.unit_nodes.values()))
    commits = np.array([e["commit_s"] for e in res.episodes if e.get("commit_s") is not None]) * 1e3
    return {"units": len(units), "episodes": len(res.episodes), "wall_s": dt, "episodes_per_s": len(res.episodes) / dt,
            "steps_per_s": res.steps / dt, "nodes_used": len(nodes), "server": server,
            "commit_ms_p50": float(np.percentile(commits, 50)) if commits.size else None,
            "commit_ms_p95": float(np.percentile(commits, 95)) if commits.size else None}


def bench_cluster(base: dict, bench: dict) -> dict:
    """The large simulated fleet on a two-node cluster against one unit, measured in the same run."""
    from fleet.cluster import LocalRayCluster

    cores = os.cpu_count() or 2
    nodes = bench.get("cluster_nodes") or [{"num_cpus": max(cores // 2, 1)}, {"num_cpus": max(cores - cores // 2, 1)}]
    n_units = int(bench["cluster_units"])
    with tempfile.TemporaryDirectory() as tmp, LocalRayCluster(nodes, log_dir=f"{tmp}/cluster") as cluster:
        c = _cfg(base, False, bench)
        c["fleet"].update(ray_address=cluster.address, placement="spread", server_device="cpu", policy_server=True,
                          worker_cpus=sum(n["num_cpus"] for n in nodes) / n_units)
        ensure_ray(c["fleet"])
        import ray

        ckpt, n_params = small_policy_checkpoint(f"{tmp}/policy")
        cpus = ray.cluster_resources().get("CPU")
        c["store"] = {**c["store"], "url": f"{tmp}/one"}
        one = _fleet_rate(c, ckpt, [0], int(bench["single_episodes"]))
        c["store"] = {**c["store"], "url": f"{tmp}/many"}
        many = _fleet_rate(c, ckpt, list(range(n_units)), int(bench["cluster_episodes"]))
        ray.shutdown()
    ratio = many["episodes_per_s"] / (cpus * one["episodes_per_s"])
    return {"nodes": nodes, "cluster_cpus": cpus, "policy": "AEDDiffusionPolicy dim=64 layers=2 horizon=16 ddim=10 "
            "(random weights) via the batched policy server", "parameters": n_params, "one_unit": one,
            "fleet": many, "fleet_vs_cpus_x_one_unit": ratio, "target": 0.8, "meets_target": bool(ratio >= 0.8),
            "loadavg": os.getloadavg()}


def bench_server_vs_local(base: dict, bench: dict) -> dict:
    """Fleets of ``bench.svl_units`` units with the small AED policy: the batched policy server against per-worker
    (local) inference, alternated ``svl_repeats`` times in this run; per size the median of each side."""
    c = _cfg(base, False, bench)
    c["fleet"].update(server_device="cpu", device="cpu")
    ensure_ray({**c["fleet"], "log_to_driver": bool(bench.get("log_to_driver", False))})
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, n_params = small_policy_checkpoint(f"{tmp}/policy")
        for n in bench["svl_units"]:
            runs: dict[str, list[dict]] = {"local": [], "server": []}
            for r in range(int(bench["svl_repeats"])):
                for side in ("local", "server"):
                    c["store"] = {**c["store"], "url": f"{tmp}/n{n}-{side}-{r}"}
                    runs[side].append(_fleet_rate(c, ckpt, list(range(int(n))), int(bench["svl_episodes"]),
                                                  use_server=side == "server"))
            med = {side: float(np.median([x["episodes_per_s"] for x in xs])) for side, xs in runs.items()}
            rows[str(n)] = {"local_episodes_per_s": med["local"], "server_episodes_per_s": med["server"],
                            "server_vs_local": med["server"] / med["local"],
                            "runs": {side: [x["episodes_per_s"] for x in xs] for side, xs in runs.items()},
                            "server": runs["server"][-1]["server"]}
            print(f"{n} unit(s): local {med['local']:.3f} episodes/s, server {med['server']:.3f} episodes/s: "
                  f"server/local {med['server'] / med['local']:.2f}", flush=True)
    return {"policy": "AEDDiffusionPolicy dim=64 layers=2 horizon=16 n_action_steps=8 ddim=10 (random weights)",
            "parameters": n_params, "cpu_count": os.cpu_count(), "max_episode_steps": c["task"]["max_episode_steps"],
            "episodes_per_unit": int(bench["svl_episodes"]), "server_max_wait_ms": c["fleet"].get("server_max_wait_ms"),
            "worker_torch_threads": c["fleet"].get("torch_threads"), "per_fleet_size": rows,
            "target": "server_vs_local > 1 from 8 units up", "loadavg": os.getloadavg()}


def default_policy_checkpoint(base: dict, path: str, spec: dict) -> str:
    """The job's default AED policy (``base["policy"]``, the composed Hydra node) with random weights, statistics
    spanning [-1, 1] and a tokenizer fitted on random-walk actions, saved to ``path``."""
    import torch

    from experience_dict.tokenizer import ActionTokenizer
    from policies.aed_diffusion import AEDDiffusionConfig, AEDDiffusionPolicy

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    pc = {k: v for k, v in base["policy"].items() if k not in ("type", "input_keys", "images")}
    shapes = {k: list(v["shape"]) for k, v in spec.items()
              if k.startswith("observation.") and isinstance(v, dict) and len(v["shape"]) == 1}
    cfg = AEDDiffusionConfig.from_dict({**pc, "input_shapes": shapes})
    acts = [np.clip(np.cumsum(rng.normal(0, 0.1, (80, cfg.action_dim)), 0), -1, 1).astype(np.float32) for _ in range(8)]
    tok = ActionTokenizer.fit(acts, r=cfg.aed.group_size, relative_dims=list(cfg.relative_action_dims),
                              absolute_dims=list(cfg.absolute_action_dims), vocab_size=256)
    stats = {k: {"min": [-1.0] * s[0], "max": [1.0] * s[0], "mean": [0.0] * s[0], "std": [1.0] * s[0]}
             for k, s in {**shapes, "action": [cfg.action_dim]}.items()}
    AEDDiffusionPolicy(cfg, stats, tok).save_pretrained(path)
    return path


def bench_round(base: dict, bench: dict) -> dict:
    """``+bench.round=true``: the env alone vs the batched fleet acting alone and with a critic (module docstring)."""
    from fleet.experiment.protocol import VectorFleet, fleet_plan
    from policies.critic import SuccessCritic, save_critic
    from sim import make_env, unit_lists

    c = json.loads(json.dumps(base))
    units = unit_lists(c["robot"])[0][: int(c["fleet"]["units"])]
    tasks = list(c["task"]["tasks"])
    rng = np.random.default_rng(0)
    t_env, steps = 0.0, 0
    spec = None
    for i in range(int(bench["round_env_episodes"])):
        env = make_env(task=tasks[i % len(tasks)], unit_id=units[i % len(units)], robot_cfg=c["robot"], obs_cfg=c["obs"],
                       task_cfg=c["task"])
        spec = spec or env.spec_dict()
        env.reset(seed=i)
        t = time.perf_counter()
        for _ in range(int(c["task"]["max_episode_steps"])):
            _, _, term, trunc, _ = env.step(rng.uniform(-1, 1, 4).astype(np.float32))
            steps += 1
            if term or trunc:
                break
        t_env += time.perf_counter() - t
        env.close()
    env_rate = steps / t_env
    plan = fleet_plan(tasks, units, int(bench["round_episodes"]), 0, 0)
    report = {"host": {"cpu_count": os.cpu_count(), "loadavg_start": os.getloadavg()}, "tasks": tasks,
              "units": len(units), "episodes": len(plan), "env_alone_steps_per_s": env_rate,
              "batch_size": int(c["eval"]["batch_size"]), "processes": int(c["eval"]["processes"]), "fleet": {}}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = default_policy_checkpoint(c, f"{tmp}/policy", spec)
        k = int(c["fert"]["critic"]["candidates"])
        with_critic = f"{tmp}/policy_critic"
        import shutil

        shutil.copytree(ckpt, with_critic)
        sd = sum(spec[key]["shape"][0] for key in ("observation.state", "observation.environment_state"))
        save_critic(SuccessCritic(sd, 4, int(c["policy"]["n_action_steps"]), state_keys=["observation.state",
                                  "observation.environment_state"]), with_critic, k)
        for name, path in (("policy_alone", ckpt), (f"with_critic_k{k}", with_critic)):
            with VectorFleet(c, path, f"{tmp}/store_{name}", int(c["eval"]["batch_size"]),
                             int(c["eval"]["processes"])) as vf:
                vf.run(plan=plan[: len(units)], progress=False)      # warm-up: processes, envs, policy
                vf.steps = 0
                t = time.perf_counter()
                vf.run(plan=plan[len(units):], progress=False)
                dt = time.perf_counter() - t
                report["fleet"][name] = {"steps_per_s": vf.steps / dt, "vs_env_alone": vf.steps / dt / env_rate,
                                         "episodes": len(plan) - len(units), "seconds": dt}
            print(f"{name}: {vf.steps / dt:.0f} env steps/s ({vf.steps / dt / env_rate:.2f} x the env alone, "
                  f"{env_rate:.0f} steps/s)", flush=True)
    report["host"]["loadavg_end"] = os.getloadavg()
    report["target"] = "the fleet acting at >= 500 env steps/s on 2 cores"
    return report


def _write_report(report: dict, path: str) -> Path:
    """Write ``report`` as JSON to ``path`` (parents created) and print it; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print(f"wrote {out}")
    return out


@hydra.main(version_base=None, config_path="../configs", config_name="config")
def main(cfg: DictConfig) -> None:
    bench = {**DEFAULTS, **(OmegaConf.to_container(cfg.bench) if "bench" in cfg else {})}
    base = _plain(cfg)
    base["robot"]["train_units"] = list(range(1000))  # bench units 0.. and the in-process unit 999
    base["robot"]["heldout_units"] = []
    if bench["server_vs_local"]:
        _write_report(bench_server_vs_local(base, bench), bench["svl_out"])
        return
    if bench["round"]:
        _write_report(bench_round(OmegaConf.to_container(cfg, resolve=True), bench), bench["round_out"])
        return
    if bench["cluster"]:
        report = bench_cluster(base, bench)
        out = _write_report(report, bench["cluster_out"])
        print(f"cluster: {report['fleet']['units']} units {report['fleet']['episodes_per_s']:.2f} episodes/s vs one unit "
              f"{report['one_unit']['episodes_per_s']:.3f} x {report['cluster_cpus']:g} CPUs: "
              f"ratio {report['fleet_vs_cpus_x_one_unit']:.2f} (target 0.8); wrote {out}")
        return
    ensure_ray({**base["fleet"], "log_to_driver": bool(bench.get("log_to_driver", False))})
    import ray

    report = {"host": {"cpu_count": os.cpu_count(), "ray_cpus": ray.cluster_resources().get("CPU"),
                       "loadavg_start": os.getloadavg()},
              "task": bench["task"], "episodes_per_worker": bench["episodes"], "policy": "scripted expert",
              "env": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, images in (("state", False), ("camera96", True)):
            c = _cfg(base, images, bench)
            # the in-process baseline is measured before and after the Ray runs (the host may be shared)
            before = bench_single(c, bench["episodes"], f"{tmp}/{name}-single")
            aggs = {k: bench_workers(c, k, bench["episodes"], f"{tmp}/{name}-fleet{k}") for k in bench["workers"]}
            after = bench_single(c, bench["episodes"], f"{tmp}/{name}-single")
            single = (before + after) / 2
            rows = {str(k): {"aggregate_steps_per_s": a, "scaling_efficiency": a / (k * single)} for k, a in aggs.items()}
            report["env"][name] = {"single_env_steps_per_s": single, "single_before_after": [before, after],
                                   "workers": rows}
            print(f"{name}: single env {single:.0f} steps/s; "
                  + "; ".join(f"{k} workers {a:.0f} steps/s (eff {a / (k * single):.2f})" for k, a in aggs.items()),
                  flush=True)
        ckpt, n_params = small_policy_checkpoint(f"{tmp}/policy")
        report["policy_server"] = {"policy": "AEDDiffusionPolicy dim=64 layers=2 horizon=16 ddim=10",
                                   "parameters": n_params,
                                   **bench_server(ckpt, list(bench["server_batches"]), int(bench["server_rounds"]))}
    report["host"]["loadavg_end"] = os.getloadavg()
    _write_report(report, bench["out"])


if __name__ == "__main__":
    main()
