"""fleetmind as LeRobot 0.6 plugins (plugins/): discovery by LeRobot's own mechanism, ``lerobot-eval`` running a
real exported fleetmind policy on fleetmind's robot units, the plugin acting exactly as fleetmind's runtime, and the
refusals. Real parts: a tiny real AED diffusion policy (random weights), a real export, real Meta-World units,
LeRobot's own command in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.lerobot
pytest.importorskip("lerobot.robots")

import torch

from tests.test_fleet import tiny_aed_checkpoint

REPO = Path(__file__).resolve().parents[2]
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def lerobot_policy_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(the fleetmind export, the LeRobot policy folder written from it) of a tiny real AED policy."""
    from lerobot_policy_fleetmind.export import export_for_lerobot

    from policies.export import export_checkpoint

    root = tmp_path_factory.mktemp("plugins")
    ckpt = tiny_aed_checkpoint(root / "ckpt", seed=3, perturb=0.05)
    export = export_checkpoint(ckpt, root / "export", control_hz=80.0)
    return export, export_for_lerobot(export, root / "lerobot_policy")


def test_lerobot_discovers_the_three_plugins_by_distribution_name():
    code = ("from lerobot.utils.import_utils import register_third_party_plugins as r; r()\n"
            "from lerobot.configs.policies import PreTrainedConfig\n"
            "from lerobot.envs.configs import EnvConfig\n"
            "from lerobot.robots import RobotConfig\n"
            "print(PreTrainedConfig.get_known_choices().get('fleetmind'), EnvConfig.get_known_choices().get('fleetmind'),"
            " RobotConfig.get_known_choices().get('fleetmind_so100_sim'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "FleetmindConfig" in out.stdout and "FleetmindEnv" in out.stdout and "FleetmindSO100SimConfig" in out.stdout


def test_the_plugin_acts_as_fleetmind_runtime_does(lerobot_policy_dir):
    """Same observations, same seed: the LeRobot policy's actions are the runtime's, step for step (history,
    action queue and all), and LeRobot's factory builds it from the folder with its processors."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors
    from lerobot_policy_fleetmind import FleetmindPolicy

    from policies.runtime import PolicyRuntime

    export, folder = lerobot_policy_dir
    cfg = PreTrainedConfig.from_pretrained(folder)
    assert cfg.type == "fleetmind" and get_policy_class("fleetmind") is FleetmindPolicy
    policy = FleetmindPolicy.from_pretrained(folder, config=cfg)
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(folder))
    runtime = PolicyRuntime.load(export, backend="torch")
    policy.reset()
    runtime.reset()
    rng = np.random.default_rng(0)
    for t in range(10):
        state = rng.uniform(-0.2, 0.6, (2, 4)).astype(np.float32)
        env = rng.uniform(-1, 1, (2, 17)).astype(np.float32)
        batch = pre({"observation.state": torch.from_numpy(state), "observation.environment_state": torch.from_numpy(env)})
        torch.manual_seed(t)
        a = post(policy.select_action(batch))
        torch.manual_seed(t)
        b = runtime.policy.select_action({"observation.state": torch.from_numpy(state),
                                          "observation.environment_state": torch.from_numpy(env)})
        assert a.shape == (2, 4) and a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert policy.predict_action_chunk(batch).shape == (2, 8, 4)
    with pytest.raises(ValueError, match="observation lacks"):
        policy.select_action({"observation.state": torch.zeros(1, 4)})


def test_save_pretrained_round_trips_through_a_folder_and_a_local_hub_cache(lerobot_policy_dir, tmp_path):
    """Issue 52, item 8: what ``push_to_hub`` writes (``save_pretrained``) loads again, from its folder and as a repo
    id in a local Hub cache: the same actions, the processors and the model card carried along; a repo id that is
    not cached is refused in one line (nothing is downloaded)."""
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot_policy_fleetmind import FleetmindPolicy

    _, folder = lerobot_policy_dir
    policy = FleetmindPolicy.from_pretrained(folder)
    saved = tmp_path / "resaved"
    policy.save_pretrained(saved)
    names = {p.name for p in saved.iterdir()}
    assert {"config.json", "README.md", policy.config.export_subdir} <= names
    assert any(n.endswith(".json") and "processor" in n for n in names)
    # a local Hub cache: models--<user>--<name>/snapshots/<revision>/ and refs/main, as huggingface_hub lays it out
    cache = tmp_path / "hub"
    snap = cache / "models--fleetmind--tiny" / "snapshots" / ("0" * 40)
    snap.parent.mkdir(parents=True)
    import shutil

    shutil.copytree(saved, snap)
    (cache / "models--fleetmind--tiny" / "refs").mkdir()
    (cache / "models--fleetmind--tiny" / "refs" / "main").write_text("0" * 40)
    rng = np.random.default_rng(1)
    obs = {"observation.state": torch.from_numpy(rng.uniform(-0.2, 0.6, (1, 4)).astype(np.float32)),
           "observation.environment_state": torch.from_numpy(rng.uniform(-1, 1, (1, 17)).astype(np.float32))}
    acts = []
    for p in (policy, FleetmindPolicy.from_pretrained(saved), FleetmindPolicy.from_pretrained("fleetmind/tiny",
                                                                                              cache_dir=cache)):
        pre, _ = make_pre_post_processors(p.config, pretrained_path=str(p._source))
        p.reset()
        torch.manual_seed(0)
        acts.append(p.select_action(pre(dict(obs))))
    torch.testing.assert_close(acts[1], acts[0], rtol=0, atol=0)
    torch.testing.assert_close(acts[2], acts[0], rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="nothing is downloaded"):
        FleetmindPolicy.from_pretrained("fleetmind/not-cached", cache_dir=cache)


def test_an_image_export_takes_lerobots_camera_renamed_and_resized(tmp_path):
    """LeRobot's Meta-World env gives ``observation.image`` at 480 x 480 (B, 3, H, W) in [0, 1]: with lerobot-eval's
    ``rename_map`` the plugin's preprocessor names it as the export's camera, and the policy resizes it to the
    export's size by area averaging: the runtime's actions on the resized uint8 frames, step for step."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot_policy_fleetmind import FleetmindPolicy
    from lerobot_policy_fleetmind.export import export_for_lerobot

    from policies.export import export_checkpoint
    from policies.runtime import PolicyRuntime
    from tests.test_runtime import tiny_image_policy

    tiny_image_policy(size=24).save_pretrained(tmp_path / "ckpt")
    export = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", control_hz=80.0)
    folder = export_for_lerobot(export, tmp_path / "lerobot_policy")
    cfg = PreTrainedConfig.from_pretrained(folder)
    policy = FleetmindPolicy.from_pretrained(folder, config=cfg)
    pre, _ = make_pre_post_processors(cfg, pretrained_path=str(folder), preprocessor_overrides={
        "rename_observations_processor": {"rename_map": {"observation.image": "observation.images.corner"}}})
    runtime = PolicyRuntime.load(export, backend="torch")
    policy.reset()
    runtime.reset()
    g = torch.Generator().manual_seed(0)
    for t in range(6):
        img = torch.rand(2, 3, 96, 96, generator=g)
        state = torch.rand(2, 4, generator=g)
        batch = pre({"observation.image": img, "observation.state": state})
        assert "observation.images.corner" in batch and "observation.image" not in batch
        torch.manual_seed(t)
        a = policy.select_action(batch)
        small = torch.nn.functional.interpolate(img, size=(24, 24), mode="area")
        frames = (small.permute(0, 2, 3, 1) * 255).round().clamp(0, 255).to(torch.uint8)
        torch.manual_seed(t)
        b = runtime.policy.select_action({"observation.state": state, "observation.images.corner": frames})
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lerobot_eval_runs_a_fleetmind_export_on_fleetmind_units(lerobot_policy_dir, tmp_path):
    """LeRobot's own lerobot-eval, the plugins found by name: two held-out units, two episodes each."""
    _, folder = lerobot_policy_dir
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    cmd = [str(Path(sys.executable).with_name("lerobot-eval")), f"--policy.path={folder}", "--policy.device=cpu",
           "--env.type=fleetmind", "--env.task=reach-v3", "--env.units=[100,101]", "--env.episode_length=20",
           "--eval.n_episodes=4", "--eval.batch_size=2", f"--output_dir={tmp_path / 'eval'}"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout[-3000:], [ln for ln in out.stderr.splitlines() if "Error" in ln][-10:],
                                 out.stderr[-3000:])
    info = json.loads((tmp_path / "eval" / "eval_info.json").read_text())
    per_task = info["per_task"][0]["metrics"]
    assert len(per_task["successes"]) == 4 and len(per_task["sum_rewards"]) == 4
    assert all(r > 0 for r in per_task["sum_rewards"])             # Meta-World's shaped reward, 20 real steps
    assert len(set(per_task["sum_rewards"])) == 4                  # four different episodes, not one repeated
    assert info["overall"]["n_episodes"] == 4 and 0.0 <= info["overall"]["pc_success"] <= 100.0
    assert list((tmp_path / "eval" / "videos").rglob("*.mp4"))     # LeRobot's videos, from the env's render()


def test_env_plugin_builds_fleetmind_units_with_lerobot_names():
    import lerobot_env_fleetmind  # noqa: F401 - registers --env.type=fleetmind (as LeRobot's commands do by name)
    from lerobot.envs.factory import make_env_config
    from lerobot.envs.utils import env_to_policy_features, preprocess_observation

    cfg = make_env_config("fleetmind", task="push-v3", units=[100, 102], episode_length=30, cameras=["corner"],
                          image_size=32)
    assert cfg.fps == 80
    feats = env_to_policy_features(cfg)
    assert feats["observation.state"].shape == (4,) and feats["observation.environment_state"].shape == (17,)
    assert feats["observation.images.corner"].shape == (3, 32, 32)
    vec = cfg.create_envs(n_envs=3)["fleetmind"][0]
    try:
        obs, _ = vec.reset(seed=[5, 6, 7])
        assert list(vec.get_attr("unit_id")) == [100, 102, 100]
        assert vec.get_attr("task_description")[1] == "push-v3 on robot unit 102"
        batch = preprocess_observation(obs)
        assert batch["observation.images.corner"].shape == (3, 3, 32, 32)
        _, _, _, _, info = vec.step(np.zeros((3, 4), np.float32))
        assert info["is_success"].dtype == bool
    finally:
        vec.close()
    with pytest.raises(ValueError, match="unknown preset"):
        make_env_config("fleetmind", task="push-v3", robot="nope")


def test_training_through_lerobot_is_refused_with_the_way_to_train(lerobot_policy_dir):
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot_policy_fleetmind import FleetmindPolicy

    cfg = PreTrainedConfig.from_pretrained(lerobot_policy_dir[1])
    with pytest.raises(NotImplementedError, match="trained by fleetmind"):
        FleetmindPolicy(cfg)
    with pytest.raises(FileNotFoundError, match="local folder"):
        FleetmindPolicy.from_pretrained("no/such/folder", config=cfg)


def test_compare_lerobot_matches_diffusion_policy_size_by_parameter_count():
    """scripts/compare_lerobot.py sizes LeRobot's DiffusionPolicy to fleetmind's policy: the candidate U-Net whose
    real parameter count is closest in log ratio."""
    import math

    sys.path.insert(0, str(REPO / "scripts"))
    from compare_lerobot import DOWN_DIMS, matching_down_dims

    dims, counts = matching_down_dims(1_000_000, 4, 17, 4, 10)
    assert set(counts) == {str(d) for d in DOWN_DIMS} and all(v > 0 for v in counts.values())
    assert sorted(counts.values()) == [counts[str(d)] for d in DOWN_DIMS]      # wider U-Nets, more parameters
    assert abs(math.log(counts[str(dims)] / 1e6)) == min(abs(math.log(v / 1e6)) for v in counts.values())


@pytest.fixture(scope="module")
def twin_policy_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(the fleetmind export, the LeRobot folder written with ``--robot so100``) of a tiny real image policy that
    sees proprioception and a 32 x 32 corner camera, as a real arm's policy does."""
    from lerobot_policy_fleetmind.export import export_for_lerobot

    from policies.export import export_checkpoint
    from tests.test_runtime import tiny_image_policy

    root = tmp_path_factory.mktemp("twin_policy")
    tiny_image_policy(size=32).save_pretrained(root / "ckpt")
    export = export_checkpoint(root / "ckpt", root / "export", control_hz=30.0)
    return export, export_for_lerobot(export, root / "lerobot_policy", robot="so100")


def test_a_robot_export_drives_the_twin_as_fleetmind_deploy_bridge_does(twin_policy_dir, tmp_path):
    """``--robot so100``: LeRobot's own frame building (``build_dataset_frame``, ``prepare_observation_for_inference``,
    the saved processors) gives the policy the twin's six joint readings and camera; its joint targets are, step for
    step, those of fleetmind's deploy bridge (forward kinematics in, the twin's controller and IK out) on the same
    robot readings, and the twin moves under them."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference
    from lerobot.robots import make_robot_from_config
    from lerobot.utils.feature_utils import build_dataset_frame, hw_to_dataset_features
    from lerobot_policy_fleetmind import FleetmindPolicy

    from fleet.deploy.lerobot_bridge import MOTOR_KEYS, SO100Bridge
    from fleet.deploy.so100_sim_robot import FleetmindSO100SimConfig
    from policies.runtime import PolicyRuntime

    export, folder = twin_policy_dir
    cfg = PreTrainedConfig.from_pretrained(folder)
    assert cfg.robot_bridge == "so100" and cfg.action_feature_names == list(MOTOR_KEYS)
    assert cfg.input_features["observation.state"].shape == (6,) and cfg.output_features["action"].shape == (6,)
    policy = FleetmindPolicy.from_pretrained(folder, config=cfg)
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(folder))
    runtime = PolicyRuntime.load(export, backend="torch")
    ref = SO100Bridge({"observation.state": [4]}, runtime.meta["features"]["action"]["names"])
    robot = make_robot_from_config(FleetmindSO100SimConfig(calibration_dir=tmp_path / "calib",
                                                           render_cameras=["corner"], image_size=32))
    robot.connect()
    try:
        # lerobot-rollout's own filter: cameras and the <joint>.pos readings (the twin's sim.* object state is dropped)
        hw = {k: v for k, v in robot.observation_features.items() if isinstance(v, tuple) or k.endswith(".pos")}
        feats = hw_to_dataset_features(hw, "observation")
        assert feats["observation.state"]["names"] == list(MOTOR_KEYS)
        policy.reset()
        runtime.reset()
        start = robot.joint_positions()
        for t in range(10):
            obs = robot.get_observation()
            frame = prepare_observation_for_inference(build_dataset_frame(feats, obs, "observation"),
                                                      torch.device("cpu"), "reach", robot.name)
            torch.manual_seed(t)
            got = post(policy.select_action(pre(frame)))
            assert got.shape == (1, 6) and got.dtype == torch.float32
            # the reference: fleetmind's bridge and runtime on the same readings (the camera as the plugin sees it)
            if t == 0:
                ref.reset(obs)
            pol_obs = {k: torch.from_numpy(v)[None] for k, v in ref.policy_observation(obs).items()}
            pol_obs["observation.images.corner"] = torch.from_numpy(obs["corner"])[None]
            torch.manual_seed(t)
            ee = runtime.policy.select_action(pol_obs)
            want = ref.propose(ee[0].double().numpy(), obs, t)
            ref.sent(want)
            np.testing.assert_allclose(got[0].double().numpy(), want, rtol=0, atol=1e-4)
            robot.send_action(dict(zip(MOTOR_KEYS, got[0].tolist())))
        assert np.abs(robot.joint_positions() - start).max() > 0.1   # the arm moved (degrees)
        # a NaN action holds the arm at its readings: NaN never reaches the robot
        real = policy.runtime.policy.select_action
        policy.runtime.policy.select_action = lambda o: torch.full((1, 4), float("nan"))
        obs = robot.get_observation()
        held = post(policy.select_action(pre(prepare_observation_for_inference(
            build_dataset_frame(feats, obs, "observation"), torch.device("cpu"), "reach", robot.name))))
        policy.runtime.policy.select_action = real
        np.testing.assert_allclose(held[0].double().numpy(), [obs[k] for k in MOTOR_KEYS], atol=1e-4)
        with pytest.raises(ValueError, match="six joint readings|6 joint readings"):
            policy.select_action({"observation.state": torch.zeros(2, 6),
                                  "observation.images.corner": torch.zeros(2, 3, 32, 32)})
        with pytest.raises(NotImplementedError, match="inference.type=sync"):
            policy.predict_action_chunk(pre(frame))
    finally:
        robot.disconnect()


CLOUD_CAMS, CLOUD_SIZE = ["corner", "topview"], 48


@pytest.fixture(scope="module")
def twin_cloud_policy_dir(tmp_path_factory) -> tuple[Path, Path]:
    """(the fleetmind export, the LeRobot folder written with ``--robot so100 --depth-cameras corner,topview``) of a
    tiny real point-cloud policy (proprioception and a 64-point cloud of the twin's two depth cameras): the deployable
    observation of issue 49 on the SO-100."""
    from lerobot_policy_fleetmind.export import export_for_lerobot

    from policies.export import export_checkpoint
    from tests.test_runtime import tiny_policy

    root = tmp_path_factory.mktemp("twin_cloud_policy")
    tiny_policy({"observation.state": {"min": [-0.3, -0.45, 0.0, 0.0], "max": [0.3, 0.05, 0.4, 1.0]},
                 "observation.point_cloud": {"min": [-0.3, -0.45, 0.0], "max": [0.3, 0.05, 0.4]},
                 "action": {"min": [-1.0] * 4, "max": [1.0] * 4}}, point_channels=[8, 16],
                input_shapes={"observation.state": [4], "observation.point_cloud": [64, 3]}).save_pretrained(root / "c")
    export = export_checkpoint(root / "c", root / "export", control_hz=30.0)
    return export, export_for_lerobot(export, root / "lerobot_policy", robot="so100", depth_cameras=CLOUD_CAMS,
                                      depth_size=CLOUD_SIZE)


def test_a_published_point_cloud_version_names_its_depth_cameras_in_the_lerobot_folder(tmp_path):
    """The path from a run to ``lerobot-rollout`` (issue 52): a point-cloud version published with its lineage (as
    the job and the learner publish it) becomes a ``--robot so100`` LeRobot folder in one ``scripts/export.py`` call
    that names no depth cameras: the folder takes the cameras and image size the policy was trained on. Other
    cameras than the training's are refused, and nothing is written."""
    from experience_dict.store import ExperienceStore
    from fleet.lineage import lineage
    from fleet.registry import CheckpointRegistry
    from tests.test_runtime import tiny_policy
    from tests.test_store import PROGRESS, SPEC, write_episode

    url = str(tmp_path / "store")
    w = ExperienceStore.create_or_open(url, SPEC, progress_keys=PROGRESS, chunk_bytes=4096).writer("unit-0000")
    write_episode(w, 0, 0, task="so100-reach", is_demo=True)
    w.close()
    tiny_policy({"observation.state": {"min": [-0.3, -0.45, 0.0, 0.0], "max": [0.3, 0.05, 0.4, 1.0]},
                 "observation.point_cloud": {"min": [-0.3, -0.45, 0.0], "max": [0.3, 0.05, 0.4]},
                 "action": {"min": [-1.0] * 4, "max": [1.0] * 4}}, point_channels=[8, 16],
                input_shapes={"observation.state": [4], "observation.point_cloud": [64, 3]}).save_pretrained(tmp_path / "c")
    obs = {"point_cloud": True, "point_cameras": CLOUD_CAMS, "point_image_size": CLOUD_SIZE, "point_color": False}
    md = lineage(url, None, obs)
    assert md["point_cloud"] == {"cameras": CLOUD_CAMS, "image_size": CLOUD_SIZE, "color": False}
    assert "point_cloud" not in lineage(url, None, {"point_cloud": False})
    CheckpointRegistry(str(tmp_path / "registry")).publish(tmp_path / "c", metadata={"run_id": "base", **md})

    def export(name: str, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "scripts/export.py", f"deploy.export.registry_url={tmp_path / 'registry'}",
             "deploy.export.version=latest", f"deploy.export.out_dir={tmp_path / name}", "deploy.export.onnx_steps=[]",
             f"deploy.export.lerobot_dir={tmp_path / (name + '_lerobot')}", "deploy.export.lerobot_robot=so100",
             f"hydra.run.dir={tmp_path / ('hydra_' + name)}", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "PYTHONPATH": str(REPO), "WANDB_MODE": "offline", "MUJOCO_GL": "egl"})

    res = export("a")
    assert res.returncode == 0, res.stderr[-3000:]
    meta = json.loads((tmp_path / "a" / "export.json").read_text())
    assert meta["training"]["point_cloud"]["cameras"] == CLOUD_CAMS
    cfg = json.loads((tmp_path / "a_lerobot" / "config.json").read_text())
    assert list(cfg["depth_cameras"]) == CLOUD_CAMS
    assert cfg["input_features"]["observation.images.topview_depth"]["shape"] == [1, CLOUD_SIZE, CLOUD_SIZE]
    bad = export("b", "deploy.export.lerobot_depth_cameras=[topview,corner]")
    assert bad.returncode != 0 and "trained on the point cloud of ['corner', 'topview']" in bad.stderr + bad.stdout
    assert not (tmp_path / "b_lerobot").exists()


def test_a_point_cloud_export_drives_the_twin_from_its_depth_cameras(twin_cloud_policy_dir, tmp_path):
    """Issue 49, item 2: a point-cloud policy exported ``--robot so100`` takes LeRobot's frame of the twin (joint
    readings and the depth cameras' ``<camera>_depth`` (H, W, 1) images, through LeRobot's own feature and frame
    code) and gives, step for step, the joint targets of fleetmind's runtime and deploy bridge on the same readings
    (the cloud made by the fleet's function from the twin's calibration, saved in the config); the arm moves."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference
    from lerobot.robots import make_robot_from_config
    from lerobot.utils.feature_utils import build_dataset_frame, hw_to_dataset_features
    from lerobot_policy_fleetmind import FleetmindPolicy
    from lerobot_policy_fleetmind.export import export_for_lerobot

    from fleet.deploy.lerobot_bridge import MOTOR_KEYS, SO100Bridge
    from fleet.deploy.so100_sim_robot import FleetmindSO100SimConfig
    from policies.runtime import PolicyRuntime

    export, folder = twin_cloud_policy_dir
    cfg = PreTrainedConfig.from_pretrained(folder)
    assert sorted(cfg.depth_cameras) == sorted(CLOUD_CAMS)
    assert cfg.input_features["observation.images.corner_depth"].shape == (1, CLOUD_SIZE, CLOUD_SIZE)
    assert "observation.point_cloud" not in cfg.input_features
    policy = FleetmindPolicy.from_pretrained(folder, config=cfg)
    pre, post = make_pre_post_processors(cfg, pretrained_path=str(folder))
    runtime = PolicyRuntime.load(export, backend="torch")
    robot = make_robot_from_config(FleetmindSO100SimConfig(calibration_dir=tmp_path / "calib", render_cameras=[],
                                                           depth_cameras=CLOUD_CAMS, depth_size=CLOUD_SIZE))
    robot.connect()
    try:
        assert cfg.depth_cameras == robot.depth_calibration()   # the twin's calibration, written at export
        ref = SO100Bridge({"observation.state": [4], "observation.point_cloud": [64, 3]},
                          runtime.meta["features"]["action"]["names"], depth_cameras=robot.depth_calibration())
        hw = {k: v for k, v in robot.observation_features.items() if isinstance(v, tuple) or k.endswith(".pos")}
        feats = hw_to_dataset_features(hw, "observation")   # LeRobot's own: (H, W, 1) is a depth map
        assert feats["observation.images.corner_depth"]["info"]["is_depth_map"]
        policy.reset()
        runtime.reset()
        start = robot.joint_positions()
        for t in range(8):
            obs = robot.get_observation()
            frame = prepare_observation_for_inference(build_dataset_frame(feats, obs, "observation"),
                                                      torch.device("cpu"), "reach", robot.name)
            torch.manual_seed(t)
            got = post(policy.select_action(pre(frame)))
            if t == 0:
                ref.reset(obs)
            pol_obs = {k: torch.from_numpy(v)[None] for k, v in ref.policy_observation(obs).items()}
            assert pol_obs["observation.point_cloud"].shape == (1, 64, 3)
            torch.manual_seed(t)
            want = ref.propose(runtime.policy.select_action(pol_obs)[0].double().numpy(), obs, t)
            ref.sent(want)
            np.testing.assert_allclose(got[0].double().numpy(), want, rtol=0, atol=1e-4)
            robot.send_action(dict(zip(MOTOR_KEYS, got[0].tolist())))
        assert np.abs(robot.joint_positions() - start).max() > 0.1   # the arm moved (degrees)
        with pytest.raises(ValueError, match="corner_depth"):
            policy.select_action({"observation.state": torch.zeros(1, 6)})
    finally:
        robot.disconnect()
    with pytest.raises(ValueError, match="depth cameras it was made from"):
        export_for_lerobot(export, tmp_path / "x", robot="so100")
    with pytest.raises(ValueError, match=r"no calibration for depth cameras \['topview'\]"):
        export_for_lerobot(export, tmp_path / "y", robot="so100", depth_cameras=CLOUD_CAMS,
                           depth_calibration={"corner": cfg.depth_cameras["corner"]})
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
def test_twin_vs_eval_drives_the_evaluations_trials_through_lerobot_rollout(twin_cloud_policy_dir, tmp_path):
    """``scripts/twin_vs_eval.py --lerobot``: fleetmind's evaluation of a point-cloud export on a held-out trial, then
    the same trial (unit, reset seed, episode length) driven by ``lerobot-rollout`` through a LeRobot folder carrying
    that unit's depth calibration; the twin's outcome file pairs with the evaluation's episode."""
    export, _ = twin_cloud_policy_dir
    out = tmp_path / "tve"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "scripts/twin_vs_eval.py", "--export", str(export), "--task", "so100-reach",
           "--trials", "1", "--out", str(out), "--no-deploy", "--lerobot", "--", "obs=pointcloud",
           f"obs.point_cameras=[{','.join(CLOUD_CAMS)}]", "obs.num_points=64", f"obs.point_image_size={CLOUD_SIZE}",
           "task.max_episode_steps=45"]
    run = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True, text=True,
                         timeout=900, check=False)
    assert run.returncode == 0, (run.stdout[-3000:], run.stderr[-3000:])
    cmp = json.loads((out / "comparison.json").read_text())
    assert set(cmp["table"]["arms"]) == {"eval", "lerobot_rollout"} and cmp["verdict"]["lerobot_rollout"]["pairs"] == 1
    (got,) = [json.loads(x) for x in (out / "lerobot_rollout" / "results.jsonl").read_text().splitlines()]
    (ev,) = json.loads(next(p for p in (out / "eval" / "episodes").glob("*.json")
                            if p.name != "fingerprints.json").read_text())
    assert (got["unit_id"], got["seed"], got["steps"]) == (ev["unit_id"], ev["seed"], 45)
    folder = next((out / "lerobot_rollout" / "policies").iterdir())
    assert folder.name == f"unit_{ev['unit_id']}"   # the unit's own calibration (its cameras are jittered)
    from lerobot_policy_fleetmind.export import twin_depth_calibration

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["depth_cameras"] != twin_depth_calibration(CLOUD_CAMS, CLOUD_SIZE)


def test_robot_exports_refuse_what_a_real_arm_cannot_give(lerobot_policy_dir, tmp_path):
    """An export that reads the object state cannot drive a LeRobot robot: the export and the config say why."""
    from lerobot_policy_fleetmind.export import export_for_lerobot

    export, _ = lerobot_policy_dir
    with pytest.raises(ValueError, match="object state"):
        export_for_lerobot(export, tmp_path / "x", robot="so100")
    with pytest.raises(ValueError, match="expected so100"):
        export_for_lerobot(export, tmp_path / "y", robot="koch")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@pytest.mark.slow
@pytest.mark.parametrize("observation", ["camera", "point_cloud"])
def test_lerobot_rollout_records_the_twin_driven_by_a_fleetmind_export(observation, request, tmp_path):
    """LeRobot's own ``lerobot-rollout`` (episodic strategy, recording) drives the twin with a ``--robot so100``
    export (a camera policy, or a point-cloud policy from the twin's depth cameras); the LeRobotDataset it records
    imports into a fleetmind store as the robot's joint-space episodes."""
    from experience_dict.lerobot import import_dataset
    from experience_dict.store import ExperienceStore

    cloud = observation == "point_cloud"
    _, folder = request.getfixturevalue("twin_cloud_policy_dir" if cloud else "twin_policy_dir")
    sensors = ([f"--robot.depth_cameras=[{','.join(CLOUD_CAMS)}]", f"--robot.depth_size={CLOUD_SIZE}",
                "--robot.render_cameras=[corner]", "--robot.image_size=32"] if cloud
               else ["--robot.render_cameras=[corner]", "--robot.image_size=32"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MUJOCO_GL": os.environ.get("MUJOCO_GL", "egl")}
    ds = tmp_path / "rollout_twin"
    cmd = [str(Path(sys.executable).with_name("lerobot-rollout")), "--strategy.type=episodic",
           f"--policy.path={folder}", "--policy.device=cpu", "--robot.type=fleetmind_so100_sim", *sensors, "--fps=30",
           "--dataset.repo_id=local/rollout_twin", f"--dataset.root={ds}", "--dataset.single_task=so100-reach",
           "--dataset.num_episodes=2", "--dataset.episode_time_s=2", "--dataset.reset_time_s=0.5",
           "--dataset.push_to_hub=false", "--display_data=false"]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert out.returncode == 0, (out.stdout[-3000:], [ln for ln in out.stderr.splitlines() if "Error" in ln][-10:],
                                 out.stderr[-3000:])
    info = json.loads((ds / "meta" / "info.json").read_text())
    assert info["total_episodes"] == 2 and info["total_frames"] > 2
    assert info["features"]["action"]["names"][:2] == ["shoulder_pan.pos", "shoulder_lift.pos"]
    res = import_dataset(str(ds), str(tmp_path / "store"), unit_id=7, success_if_unknown=False, progress=False)
    store = ExperienceStore.open(str(tmp_path / "store"))
    eps = store.episodes()
    assert len(eps) == 2 and not any(e.success for e in eps), res
    ep = store.load_episode(eps[0].episode_id)
    assert ep["action"].shape[1] == 6 and ep["observation.images.corner"].shape[1:] == (32, 32, 3)
    assert np.ptp(ep["observation.state"], axis=0).max() > 0   # the joints moved during the episode
    if cloud:   # LeRobot recorded the depth cameras as depth maps; they come back as metres
        assert info["features"]["observation.images.corner_depth"]["info"]["is_depth_map"]
        d = ep["observation.images.corner_depth"]
        assert d.shape[1:] == (CLOUD_SIZE, CLOUD_SIZE, 1) and d.dtype == np.float32
        assert 0.1 < float(np.median(d)) < 3.0   # the table and the arm, a metre or so from the camera
