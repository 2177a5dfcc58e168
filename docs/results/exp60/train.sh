#!/bin/bash
# an SO-100 point-cloud policy (so100-reach) for the LeRobot-rollout vs evaluation comparison (issue 49 item 2)
cd /work/main
export MUJOCO_GL=egl WANDB_MODE=offline PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1
py=/work/main/.venv/bin/python
OBS="obs=pointcloud obs.point_cameras=[corner,topview] obs.num_points=128"
set -x
$py scripts/collect_demos.py task=so100 'task.tasks=[so100-reach]' $OBS store.url=/work/exp60/demos store.demos.per_task=30 hydra.run.dir=/work/exp60/collect || exit 1
$py scripts/train.py task=so100 'task.tasks=[so100-reach]' $OBS store.url=/work/exp60/demos train.out_dir=/work/exp60/train train.steps=3000 'policy.input_keys=[observation.state,observation.point_cloud]' 'policy.point_channels=[64,128]' policy.point_relative=true hydra.run.dir=/work/exp60/train_hydra || exit 1
$py scripts/export.py deploy.export.checkpoint=/work/exp60/train deploy.export.out_dir=/work/exp60/export deploy.export.control_hz=30 deploy.export.overwrite=true || exit 1
echo done
