"""Real-robot deployment: everything between an exported policy and a LeRobot arm.

- ``fleet.deploy.safety``: joint limits, rate limits, workspace box, watchdog, event log (no LeRobot import;
  tested in the core environment);
- ``fleet.deploy.lerobot_bridge``: policy actions (end-effector deltas) <-> LeRobot joint commands for the
  SO-100/SO-101 (plain dicts; no LeRobot import);
- ``fleet.deploy.deployer``: ``Deployer`` runs labelled episodes on a LeRobot ``Robot`` through the lean
  runtime, the safety filter and the bridge (imports LeRobot: the ``[lerobot]`` extra, which ``make install`` installs);
- ``fleet.deploy.so100_sim_robot``: the SO-100 MuJoCo twin as a LeRobot ``Robot`` (``fleetmind_so100_sim``).

This package's ``__init__`` imports none of them, so the safety layer and the bridge load without LeRobot.
Import order matters for the two LeRobot modules: they import LeRobot before ``sim`` probes EGL (Mesa's EGL
then triton's library segfaults the process; see ``fleet/deploy/so100_sim_robot/__init__.py``).
"""
