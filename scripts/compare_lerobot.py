"""fleetmind's AED diffusion policy against LeRobot's DiffusionPolicy: the same demonstrations, the same held-out
trials, both trained and evaluated by their own tools, in one run.

    python scripts/compare_lerobot.py --out outputs/compare_lerobot                     # mw_mid, 10 demos a task
    python scripts/compare_lerobot.py --out outputs/cl --steps 200 --episodes 4 --tasks reach-v3   # a quick look

Stages (each skipped when its output exists, so an interrupted run resumes):

1. demonstrations: ``scripts/collect_demos.py`` into a store (``--store`` reuses one);
2. the same episodes as a LeRobotDataset v3.0 (``python -m experience_dict.lerobot export``);
3. fleetmind: ``scripts/train.py`` on the store, ``scripts/export.py``, ``python -m lerobot_policy_fleetmind.export``;
4. LeRobot: ``lerobot-train --policy.type=diffusion`` on the dataset, with the ``down_dims`` whose parameter count is
   closest to fleetmind's policy (log ratio), the same steps, batch size and seed, DDIM with the same number of
   denoising steps, horizon 16, 2 observation steps, 8 actions executed per chunk (LeRobot's defaults otherwise);
5. both with LeRobot's ``lerobot-eval`` on fleetmind's units (``--env.type=fleetmind``, held-out units 100-103,
   the same ``--seed``, so episode i of a task is the same trial, unit and reset seed, for both);
6. chunk latency: both policies loaded in this process, ``predict_action_chunk`` at batch 1 timed interleaved.

Writes ``<out>/comparison.json`` and ``<out>/comparison.md``: success per task (Wilson 95 %), the paired difference
(bootstrap 95 %, exact McNemar p; ``fleet.experiment.tables``), training samples/s (steps x batch over the
training command's wall time, each trained alone), parameters and chunk latency.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

from scripts.subproc import REPO, run_logged

BIN = Path(sys.executable).parent
DOWN_DIMS = [[16, 32, 64], [32, 64, 128], [64, 128, 256], [128, 256, 512], [256, 512, 1024]]


def run(cmd: list, log: Path) -> float:
    """Run ``cmd`` (``scripts.subproc.run_logged``) on one CPU thread whose OpenMP workers sleep at barriers, for
    both trainers alike (fleetmind's own setting, policies/threads.py; LeRobot leaves torch's default, which spins
    and collapses beside other load); returns its wall time, s."""
    return run_logged(cmd, log, env={"OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"})


def matching_down_dims(params: int, state_dim: int, env_dim: int, action_dim: int, steps: int) -> tuple[list, dict]:
    """LeRobot DiffusionPolicy ``down_dims`` of :data:`DOWN_DIMS` whose parameter count is closest to ``params``
    (log ratio), with the counts of every candidate."""
    import numpy as np
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    counts = {}
    for dims in DOWN_DIMS:
        cfg = DiffusionConfig(input_features={"observation.state": PolicyFeature(FeatureType.STATE, (state_dim,)),
                                              "observation.environment_state": PolicyFeature(FeatureType.ENV,
                                                                                             (env_dim,))},
                              output_features={"action": PolicyFeature(FeatureType.ACTION, (action_dim,))},
                              down_dims=tuple(dims), crop_shape=None, num_inference_steps=steps,
                              noise_scheduler_type="DDIM", pretrained_backbone_weights=None, device="cpu")
        counts[str(dims)] = sum(p.numel() for p in DiffusionPolicy(cfg).parameters())
    best = min(DOWN_DIMS, key=lambda d: abs(np.log(counts[str(d)] / params)))
    return best, counts


def lerobot_eval(policy_dir: Path, task: str, args, out: Path) -> list[bool]:
    """``lerobot-eval`` of ``policy_dir`` on ``task`` -> per-episode success, in episode order."""
    if not (out / "eval_info.json").exists():
        run([BIN / "lerobot-eval", f"--policy.path={policy_dir}", "--policy.device=cpu", "--env.type=fleetmind",
             f"--env.task={task}", f"--env.units={json.dumps(args.units)}", f"--env.episode_length={args.episode_length}",
             f"--eval.n_episodes={args.episodes}", f"--eval.batch_size={args.eval_batch}", f"--seed={args.eval_seed}",
             f"--output_dir={out}"], out.with_suffix(".log"))
    info = json.loads((out / "eval_info.json").read_text())
    return [bool(s) for s in info["per_task"][0]["metrics"]["successes"]]


def chunk_latency(ours_dir: Path, lerobot_dir: Path, repeats: int = 30) -> dict:
    """Median ms of one ``predict_action_chunk`` at batch 1 for each policy, timed interleaved in this process."""
    import statistics

    import torch
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy
    from lerobot_policy_fleetmind import FleetmindPolicy

    torch.set_num_threads(1)
    ours = FleetmindPolicy.from_pretrained(ours_dir, config=PreTrainedConfig.from_pretrained(ours_dir))
    theirs = DiffusionPolicy.from_pretrained(lerobot_dir)
    theirs.eval()
    obs = {"observation.state": torch.zeros(1, 4), "observation.environment_state": torch.zeros(1, 17)}
    theirs_batch = {k: v[:, None].repeat(1, theirs.config.n_obs_steps, 1) for k, v in obs.items()}
    times = {"fleetmind": [], "lerobot": []}
    with torch.inference_mode():
        for i in range(repeats + 3):
            for name, fn in (("fleetmind", lambda: ours.predict_action_chunk(obs)),
                             ("lerobot", lambda: theirs.diffusion.generate_actions(theirs_batch))):
                t0 = time.perf_counter()
                fn()
                if i >= 3:
                    times[name].append(1e3 * (time.perf_counter() - t0))
    return {k: round(statistics.median(v), 2) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--task-suite", default="mw_mid", help="the fleetmind task group the demonstrations come from")
    ap.add_argument("--tasks", nargs="*", default=None, help="tasks to compare (default: the suite's)")
    ap.add_argument("--store", default=None, help="an existing demonstration store (default: collect one)")
    ap.add_argument("--demos-per-task", type=int, default=10)
    ap.add_argument("--steps", type=int, default=2000, help="training steps for both (fleetmind's default: 2000)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ddim-steps", type=int, default=10)
    ap.add_argument("--episodes", type=int, default=50, help="held-out episodes per task and policy")
    ap.add_argument("--eval-batch", type=int, default=4)
    ap.add_argument("--eval-seed", type=int, default=1000)
    ap.add_argument("--units", type=int, nargs="+", default=[100, 101, 102, 103])
    ap.add_argument("--episode-length", type=int, default=150)
    args = ap.parse_args(argv)
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    if args.tasks is None:
        from omegaconf import OmegaConf
        args.tasks = list(OmegaConf.load(REPO / "configs" / "task" / f"{args.task_suite}.yaml").tasks)
    tasks_override = f"task.tasks=[{','.join(args.tasks)}]"
    res: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}

    store = args.store or str(out / "demos")
    if args.store is None and not (out / "demos").exists():
        print("[1/6] demonstrations", flush=True)
        run([py, "scripts/collect_demos.py", f"task={args.task_suite}", tasks_override, f"store.url={store}",
             f"store.demos.per_task={args.demos_per_task}", f"hydra.run.dir={out / 'logs' / 'demos'}"],
            out / "collect_demos.log")
    dataset = out / "lerobot_dataset"
    if not dataset.exists():
        print("[2/6] the same episodes as a LeRobotDataset", flush=True)
        run([py, "-m", "experience_dict.lerobot", "export", store, dataset, "--no-video"], out / "export_dataset.log")

    ours_train, ours_export, ours_lr = out / "fleetmind_train", out / "fleetmind_export", out / "fleetmind_lerobot"
    if not (ours_train / "train_summary.json").exists() and not ours_lr.exists():
        print("[3/6] fleetmind: train, export", flush=True)
        res["fleetmind_train_wall_s"] = run(
            [py, "scripts/train.py", f"task={args.task_suite}", tasks_override, f"store.url={store}",
             f"train.out_dir={ours_train}", f"train.steps={args.steps}", f"train.batch_size={args.batch_size}",
             f"train.seed={args.seed}", f"policy.num_inference_steps={args.ddim_steps}",
             f"hydra.run.dir={out / 'logs' / 'train'}"], out / "fleetmind_train.log")
        (out / "fleetmind_wall.json").write_text(json.dumps({"wall_s": res["fleetmind_train_wall_s"]}))
    if not ours_lr.exists():
        run([py, "scripts/export.py", f"deploy.export.checkpoint={ours_train}", f"deploy.export.out_dir={ours_export}",
             "deploy.export.overwrite=true", f"hydra.run.dir={out / 'logs' / 'export'}"], out / "fleetmind_export.log")
        run([py, "-m", "lerobot_policy_fleetmind.export", ours_export, ours_lr, "--no-critic", "--overwrite"],
            out / "fleetmind_lerobot.log")
    meta = json.loads((ours_export / "export.json").read_text())
    res["fleetmind_train_wall_s"] = json.loads((out / "fleetmind_wall.json").read_text())["wall_s"]
    res["fleetmind_parameters"] = int(meta["parameters"])

    theirs_out = out / "lerobot_train"
    theirs_dir = theirs_out / "checkpoints" / "last" / "pretrained_model"
    dims, counts = matching_down_dims(res["fleetmind_parameters"], 4, 17, 4, args.ddim_steps)
    res.update(lerobot_down_dims=dims, lerobot_parameters=counts[str(dims)], lerobot_candidates=counts)
    if not theirs_dir.exists():
        print(f"[4/6] LeRobot DiffusionPolicy, down_dims {dims} ({counts[str(dims)]:,} parameters)", flush=True)
        shutil.rmtree(theirs_out, ignore_errors=True)
        wall = run([BIN / "lerobot-train", f"--dataset.repo_id=local/{dataset.name}", f"--dataset.root={dataset}",
                    "--policy.type=diffusion", f"--policy.down_dims={json.dumps(dims)}", "--policy.crop_shape=null",
                    "--policy.noise_scheduler_type=DDIM", f"--policy.num_inference_steps={args.ddim_steps}",
                    "--policy.device=cpu", "--policy.push_to_hub=false", f"--steps={args.steps}",
                    f"--batch_size={args.batch_size}", f"--seed={args.seed}", f"--save_freq={args.steps}",
                    "--log_freq=100", "--num_workers=0", "--wandb.enable=false", f"--output_dir={theirs_out}"],
                   out / "lerobot_train.log")
        (out / "lerobot_wall.json").write_text(json.dumps({"wall_s": wall}))
    res["lerobot_train_wall_s"] = json.loads((out / "lerobot_wall.json").read_text())["wall_s"]
    for k in ("fleetmind", "lerobot"):
        res[f"{k}_train_samples_per_s"] = round(args.steps * args.batch_size / res[f"{k}_train_wall_s"], 1)

    print("[5/6] lerobot-eval of both on the same held-out trials", flush=True)
    from fleet.experiment.tables import paired_differences, paired_markdown, success_table, table_markdown

    episodes: dict[str, list] = {"fleetmind": [], "lerobot": []}
    for task in args.tasks:
        for name, pdir in (("fleetmind", ours_lr), ("lerobot", theirs_dir)):
            succ = lerobot_eval(pdir, task, args, out / "eval" / name / task)
            episodes[name] += [{"task": task, "unit_id": args.units[i % args.eval_batch % len(args.units)],
                                "seed": i, "success": s} for i, s in enumerate(succ)]
    res["success"] = success_table(episodes)
    res["paired"] = paired_differences(episodes, [("fleetmind", "lerobot")])
    print("[6/6] chunk latency", flush=True)
    res["chunk_latency_ms_batch1"] = chunk_latency(ours_lr, theirs_dir)
    (out / "comparison.json").write_text(json.dumps(res, indent=1, default=float))
    md = ["| | fleetmind (AED diffusion) | LeRobot DiffusionPolicy |", "|---|---|---|",
          f"| parameters | {res['fleetmind_parameters']:,} | {res['lerobot_parameters']:,} (down_dims {dims}) |",
          (f"| training samples/s (CPU, {args.steps} steps x {args.batch_size}) | "
           f"{res['fleetmind_train_samples_per_s']} | {res['lerobot_train_samples_per_s']} |"),
          (f"| chunk latency, batch 1, ms ({args.ddim_steps} DDIM steps) | "
           f"{res['chunk_latency_ms_batch1']['fleetmind']} | {res['chunk_latency_ms_batch1']['lerobot']} |"),
          "", "Held-out success, the same trials for both (`lerobot-eval --env.type=fleetmind`):", "",
          table_markdown(res["success"]), "", paired_markdown(res["paired"])]
    (out / "comparison.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
