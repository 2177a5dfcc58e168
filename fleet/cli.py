"""The ``fleetmind`` command: one entry point for the scripts (each a Hydra app; overrides as usual).

    fleetmind run                                  # = python scripts/run.py (the main job)
    fleetmind train policy=mlp_chunk train.steps=2000
    fleetmind eval eval.checkpoints='{base: outputs/.../pretrained_model}'
    fleetmind fleet fleet.units=4
    fleetmind export deploy.export.checkpoint=outputs/train_quick deploy.export.out_dir=exports/quick
    fleetmind deploy deploy.robot.type=fleetmind_so100_sim
    fleetmind --help
    fleetmind eval --help                          # a command's usage: its examples and the config groups
    fleetmind eval --cfg job                       # every key with its value (Hydra's full dump)

Each command runs ``scripts/<name>.py`` as ``__main__`` (``runpy``), so ``fleetmind X args`` and
``python scripts/X.py args`` are the same program. Installed by ``pip install ".[fleet]"`` as a console script
(``[project.scripts]`` in ``pyproject.toml``).
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("task", "obs", "policy", "robot", "experiment")   # the config groups picked by name (group=choice)

COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("scripts.run", "the main job: demonstrations, bases, fleet rounds with FERT, arms, held-out evaluation"),
    "train": ("scripts.train", "train a policy on the experience store"),
    "eval": ("scripts.eval", "evaluate checkpoints on held-out units, paired"),
    "fleet": ("scripts.rollout", "run a simulated fleet that commits episodes to the store"),
    "export": ("scripts.export", "export a checkpoint or registry version for the lean runtime"),
    "deploy": ("scripts.deploy", "run an exported policy on a LeRobot robot (needs the lerobot extra)"),
    "ablate": ("scripts.ablate", "fine-tune arm variants on a frozen fleet store and evaluate them paired"),
    "compare": ("scripts.compare_policies", "train policy variants as bases on the same demonstrations, evaluate paired"),
    "collect-demos": ("scripts.collect_demos", "scripted-expert demonstrations into the store"),
    "sim-check": ("scripts.sim_check", "check the simulated tasks and units"),
    "chaos": ("scripts.chaos", "SIGKILL workers, server and learner while the fleet runs; audit what survived"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: fleetmind <command> [key=value ...]  (Hydra overrides, as for python scripts/<command>.py)", "",
             "commands:"]
    lines += [f"  {name.ljust(width)}  {desc}" for name, (_, desc) in COMMANDS.items()]
    return "\n".join(lines)


def command_help(cmd: str) -> str:
    """``fleetmind <cmd> --help``: what the command does, its examples (from its script's docstring, read without
    importing it: no torch, no Hydra), the config groups it composes and their choices, and where the full config is.
    """
    module, desc = COMMANDS[cmd]
    script = ROOT / (module.replace(".", "/") + ".py")
    doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    name = script.name
    examples = [ln.strip().replace(f"python scripts/{name}", f"fleetmind {cmd}") for ln in doc.splitlines()
                if f"python scripts/{name}" in ln]
    lines = [f"usage: fleetmind {cmd} [key=value ...]   ({desc})", ""]
    if examples:
        lines += ["examples:", *(f"  {e}" for e in examples), ""]
    lines.append("config groups (group=choice; configs/<group>/<choice>.yaml):")
    for g in GROUPS:
        choices = sorted(p.stem for p in (ROOT / "configs" / g).glob("*.yaml"))
        lines.append(f"  {g:<10} {' | '.join(choices)}")
    lines += ["", f"every key and its value: fleetmind {cmd} --cfg job   (Hydra; one key: --cfg job --package <group>)",
              f"the script: {script.relative_to(ROOT)}; the keys' rules and defaults: configs/ (typed groups)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``fleetmind <command> [overrides]``; returns the exit status (2: unknown command).

    Raises:
        SystemExit: as the script raises it (a bad config exits 1 with one line per problem).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"fleetmind: unknown command {cmd!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if any(a in ("-h", "--help") for a in rest):   # a short usage, not Hydra's 567-line dump of every key
        print(command_help(cmd))
        return 0
    module = COMMANDS[cmd][0]
    try:
        __import__("hydra")
    except ModuleNotFoundError:
        print(f"fleetmind {cmd}: this install has the lean runtime only; install the fleet extra: "
              "pip install 'fleetmind[fleet]'", file=sys.stderr)
        return 1
    sys.argv = [f"fleetmind {cmd}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
