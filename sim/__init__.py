"""fleetmind sim: MuJoCo worlds as Gymnasium envs (Meta-World v3), robot units, scripted experts, rendering.

Importing ``sim`` chooses the offscreen GL backend (``MUJOCO_GL``: egl, else osmesa) before mujoco is imported;
see ``sim.gl``.
"""

from sim.gl import select_backend as _select_backend

GL_BACKEND = _select_backend()

from sim.experts import ScriptedExpert
from sim.experts import make_expert as _make_mw_expert
from sim.metaworld_env import CONTROL_HZ, PROGRESS_KEYS, MetaWorldEnv
from sim.metaworld_env import _all_tasks as _mw_tasks
from sim.metaworld_env import make_env as _make_mw_env
from sim.so100 import TASKS as SO100_TASKS
from sim.units import CAMERAS, RobotUnit, as_dict, unit_lists


def check_task(task: str) -> None:
    """Raise ValueError listing every valid task unless ``task`` is a Meta-World v3 or SO-100 task name."""
    if task not in SO100_TASKS and task not in _mw_tasks():
        raise ValueError(f"unknown task {task!r}; valid tasks: Meta-World v3: {', '.join(_mw_tasks())}; "
                         f"SO-100: {', '.join(SO100_TASKS)}")


def list_tasks(task_cfg=None) -> list[str]:
    """The 50 Meta-World v3 task names (Meta-World's order; the SO-100 tasks are ``SO100_TASKS``) or a suite
    config's ``tasks`` (Meta-World and/or SO-100 names), validated.

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
    """The Gymnasium env of ``task`` on robot unit ``unit_id``: ``so100-*`` tasks build the SO-100 twin
    (``sim.so100.SO100Env``, embodiment ``"so100"``), others Meta-World (``sim.metaworld_env.make_env``, same
    arguments and errors). Raises ValueError for an unknown task, listing every valid one."""
    check_task(task)
    if task in SO100_TASKS:
        from sim.so100 import make_so100_env

        return make_so100_env(task, unit_id, robot_cfg, obs_cfg, task_cfg, render_mode)
    return _make_mw_env(task, unit_id, robot_cfg, obs_cfg, task_cfg, render_mode)


def make_expert(env, noise_std: float = 0.0, seed: int = 0, latency_compensation: bool = False):
    """The scripted expert of ``env``'s task (SO-100 or Meta-World; see ``sim.experts.make_expert``)."""
    from sim.so100 import SO100Env, make_so100_expert

    if isinstance(getattr(env, "unwrapped", env), SO100Env):
        return make_so100_expert(env, noise_std=noise_std, seed=seed)
    return _make_mw_expert(env, noise_std=noise_std, seed=seed, latency_compensation=latency_compensation)

__all__ = ["CAMERAS", "CONTROL_HZ", "GL_BACKEND", "PROGRESS_KEYS", "SO100_TASKS", "MetaWorldEnv", "RobotUnit",
           "ScriptedExpert",
           "check_task", "list_tasks", "make_env", "make_expert", "unit_lists"]
