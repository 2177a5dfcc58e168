"""fleetmind sim: MuJoCo worlds as Gymnasium envs (Meta-World v3), robot units, scripted experts, rendering.

Importing ``sim`` chooses the offscreen GL backend (``MUJOCO_GL``: egl, else osmesa) before mujoco is imported;
see ``sim.gl``.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sim.gl import select_backend as _select_backend

GL_BACKEND = _select_backend()

from sim.experts import ScriptedExpert
from sim.experts import make_expert as _make_mw_expert
from sim.metaworld_env import CONTROL_HZ, PROGRESS_KEYS, MetaWorldEnv
from sim.metaworld_env import _all_tasks as _mw_tasks
from sim.metaworld_env import make_env as _make_mw_env
from sim.so100 import TASKS as SO100_TASKS
from sim.units import CAMERAS, RobotUnit, as_dict, demo_unit_list, unit_lists


@dataclass(frozen=True)
class Suite:
    """A family of simulated tasks on one embodiment, registered with :func:`register_suite`.

    Attributes:
        name: suite name (``metaworld``, ``so100``, ...).
        embodiment: the robot it simulates (recorded with every episode; ``sawyer``, ``so100``).
        tasks: () -> the task names it owns (disjoint from every other suite's).
        make_env: (task, unit_id, robot_cfg, obs_cfg, task_cfg, render_mode) -> a Gymnasium env meeting the
            env contract of docs/INTERFACES.md (``env.task``, ``env.unit``, ``spec_dict()``, ``info["progress"]``).
        make_expert: (env, noise_std, seed, latency_compensation) -> its scripted expert (``act(obs)``).
    """

    name: str
    embodiment: str
    tasks: Callable[[], list[str]]
    make_env: Callable[..., Any]
    make_expert: Callable[..., Any]


_SUITES: dict[str, Suite] = {}


def register_suite(name: str, embodiment: str, tasks: Callable[[], list[str]], make_env: Callable[..., Any],
                   make_expert: Callable[..., Any]) -> Suite:
    """Register a task suite: its tasks then work everywhere a task name is taken (``make_env``,
    ``make_expert``, ``task.tasks`` of a config, the fleet, evaluation). Returns the suite.

    Raises:
        ValueError: the name is taken, or a task name is already owned by another suite.
    """
    if name in _SUITES:
        raise ValueError(f"register_suite: suite {name!r} is already registered")
    suite = Suite(name, embodiment, tasks, make_env, make_expert)
    taken = {t: s.name for s in _SUITES.values() for t in s.tasks()}
    clash = sorted(t for t in tasks() if t in taken)
    if clash:
        raise ValueError(f"register_suite {name!r}: tasks {clash} already belong to suite {taken[clash[0]]!r}")
    _SUITES[name] = suite
    return suite


def suites() -> dict[str, Suite]:
    """The registered suites by name."""
    return dict(_SUITES)


def suite_of(task: str) -> Suite:
    """The suite owning ``task``.

    Raises:
        ValueError: no suite owns it (the message lists every valid task by suite).
    """
    for s in _SUITES.values():
        if task in s.tasks():
            return s
    valid = "; ".join(f"{s.name}: {', '.join(s.tasks())}" for s in _SUITES.values())
    raise ValueError(f"unknown task {task!r}; valid tasks: {valid}")


def check_task(task: str) -> None:
    """Raise ValueError listing every valid task unless a registered suite owns ``task``."""
    suite_of(task)


def list_tasks(task_cfg=None) -> list[str]:
    """The 50 Meta-World v3 task names (Meta-World's order; other suites' tasks: ``suites()``) or a task
    config's ``tasks`` (names of any registered suite), validated.

    Raises:
        ValueError: a suite names an unknown task or has no tasks.
    """
    if task_cfg is None:
        return _mw_tasks()
    tasks = list(as_dict(task_cfg).get("tasks") or [])
    if not tasks:
        raise ValueError(f"task config {as_dict(task_cfg).get('name', '?')!r} lists no tasks")
    for t in tasks:
        check_task(t)
    return tasks


def make_env(task: str, unit_id: int = 0, robot_cfg=None, obs_cfg=None, task_cfg=None, render_mode=None):
    """The Gymnasium env of ``task`` on robot unit ``unit_id``, built by the suite that owns the task
    (``so100-*``: the SO-100 twin ``sim.so100.SO100Env``, embodiment ``"so100"``; Meta-World v3 names:
    ``sim.metaworld_env.make_env``). Raises ValueError for an unknown task, listing every valid one."""
    return suite_of(task).make_env(task, unit_id, robot_cfg, obs_cfg, task_cfg, render_mode)


def make_expert(env, noise_std: float = 0.0, seed: int = 0, latency_compensation: bool = False):
    """The scripted expert of ``env``'s task, from the suite that owns it (``env.task``)."""
    task = getattr(env, "unwrapped", env).task
    return suite_of(task).make_expert(env, noise_std=noise_std, seed=seed, latency_compensation=latency_compensation)


def _make_so100_env(*args):
    from sim.so100 import make_so100_env  # MuJoCo + mink: only when an SO-100 task is made

    return make_so100_env(*args)


def _make_so100_expert(env, noise_std: float = 0.0, seed: int = 0, latency_compensation: bool = False):
    from sim.so100 import make_so100_expert

    return make_so100_expert(env, noise_std=noise_std, seed=seed)


register_suite("metaworld", "sawyer", _mw_tasks, _make_mw_env, _make_mw_expert)
register_suite("so100", "so100", lambda: list(SO100_TASKS), _make_so100_env, _make_so100_expert)

__all__ = [
    "CAMERAS",
    "CONTROL_HZ",
    "GL_BACKEND",
    "PROGRESS_KEYS",
    "SO100_TASKS",
    "MetaWorldEnv",
    "RobotUnit",
    "ScriptedExpert",
    "Suite",
    "check_task",
    "demo_unit_list",
    "list_tasks",
    "make_env",
    "make_expert",
    "register_suite",
    "suite_of",
    "suites",
    "unit_lists",
]
