#!/bin/bash
# experiment 60b: the same recipe with the coloured cloud and 60 demonstrations (declared before its results)
cd /work/exp60/wt
export MUJOCO_GL=egl WANDB_MODE=offline PYTHONUNBUFFERED=1 HYDRA_FULL_ERROR=1 PYTHONPATH=/work/exp60/wt
py=/work/main/.venv/bin/python
OBS="obs=pointcloud obs.point_cameras=[corner,topview] obs.num_points=128 obs.point_color=true"
set -x
$py scripts/collect_demos.py task=so100 'task.tasks=[so100-reach]' $OBS store.url=/work/exp60/demos_rgb store.demos.per_task=60 hydra.run.dir=/work/exp60/collect_rgb || exit 1
$py scripts/train.py task=so100 'task.tasks=[so100-reach]' $OBS store.url=/work/exp60/demos_rgb train.out_dir=/work/exp60/train_rgb train.steps=3000 'policy.input_keys=[observation.state,observation.point_cloud,observation.point_colors]' 'policy.point_channels=[64,128]' policy.point_relative=true hydra.run.dir=/work/exp60/train_rgb_hydra || exit 1
$py scripts/export.py deploy.export.checkpoint=/work/exp60/train_rgb deploy.export.out_dir=/work/exp60/export_rgb deploy.export.control_hz=30 deploy.export.overwrite=true || exit 1
echo done
