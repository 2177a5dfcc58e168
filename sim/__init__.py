"""fleetmind sim: MuJoCo worlds as Gymnasium envs (Meta-World v3), robot units, scripted experts, rendering.

Importing ``sim`` chooses the offscreen GL backend (``MUJOCO_GL``: egl, else osmesa) before mujoco is imported;
see ``sim.gl``.
"""

from sim.gl import select_backend as _select_backend

GL_BACKEND = _select_backend()

from sim.experts import ScriptedExpert, make_expert
from sim.metaworld_env import (
    CONTROL_HZ,
    PROGRESS_KEYS,
    MetaWorldEnv,
    check_task,
    list_tasks,
    make_env,
)
from sim.units import CAMERAS, RobotUnit, unit_lists

__all__ = ["CAMERAS", "CONTROL_HZ", "GL_BACKEND", "PROGRESS_KEYS", "MetaWorldEnv", "RobotUnit", "ScriptedExpert",
           "check_task", "list_tasks", "make_env", "make_expert", "unit_lists"]
