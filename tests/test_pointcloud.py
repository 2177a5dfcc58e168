"""The depth point cloud (sim.pointcloud, obs.point_cloud): geometry of a known scene, determinism, the store."""

from __future__ import annotations

import numpy as np
import pytest

import sim  # noqa: F401 - picks the GL backend before mujoco is imported (sim.gl)

mujoco = pytest.importorskip("mujoco")

from sim.pointcloud import GRID_M, CloudSpec, DepthPointCloud, farthest_points, snap_to_grid

# A box of half-sizes (0.05, 0.04, 0.03) m centred at (0.3, 0.1, 0.03) in the world, a robot base body placed at
# (0.1, -0.2, 0) turned 90 degrees about z, and a camera looking at the box from above and in front.
BOX_C, BOX_H = np.array([0.3, 0.1, 0.03]), np.array([0.05, 0.04, 0.03])
SCENE = f"""
<mujoco>
  <visual><global offwidth="128" offheight="128"/></visual>
  <worldbody>
    <geom type="plane" size="2 2 0.1" pos="0 0 0"/>
    <body name="base" pos="0.1 -0.2 0" euler="0 0 90"><geom type="sphere" size="0.01" pos="0 0 -0.5"/></body>
    <geom name="box" type="box" size="{BOX_H[0]} {BOX_H[1]} {BOX_H[2]}" pos="{BOX_C[0]} {BOX_C[1]} {BOX_C[2]}"
          rgba="0.9 0.1 0.1 1"/>
    <body name="target" pos="{BOX_C[0]} {BOX_C[1]} {BOX_C[2]}"/>
    <camera name="cam" pos="0.0 -0.3 0.5" mode="targetbody" target="target" fovy="50"/>
  </worldbody>
</mujoco>
"""


def _scene():
    model = mujoco.MjModel.from_xml_string(SCENE)
    data = mujoco.MjData(model)
    mujoco.mj_forward(model, data)
    return model, data


def _to_base(p_world: np.ndarray, data) -> np.ndarray:
    b = data.body("base")
    return (p_world - b.xpos) @ b.xmat.reshape(3, 3)


def test_known_box_gives_points_on_its_faces_in_metres_in_the_base_frame():
    model, data = _scene()
    # the crop: a box around the object in the *base* frame, above the floor
    c_base = _to_base(BOX_C, data)
    spec = CloudSpec(("cam",), (96, 96), 256, tuple(c_base - 0.1 + [0, 0, 0.1 - 0.002]), tuple(c_base + 0.1),
                     "base")
    cloud = DepthPointCloud(model, spec)(data)
    assert cloud.shape == (256, 3) and cloud.dtype == np.float32
    # back in the world frame, every point lies on the box's surface (within the depth buffer's precision)
    b = data.body("base")
    world = cloud.astype(np.float64) @ b.xmat.reshape(3, 3).T + b.xpos
    q = np.abs(world - BOX_C) - BOX_H                     # signed distance to a box, per axis
    outside = np.linalg.norm(np.maximum(q, 0), axis=1)
    inside = np.minimum(q.max(1), 0)
    dist = outside + inside
    assert np.abs(dist).max() < 3e-3, np.abs(dist).max()
    # the top face and the faces the camera sees (front: -y, and the left: -x) carry points; the hidden back does not
    top = np.abs(world[:, 2] - 2 * BOX_H[2]) < 2e-3
    front = np.abs(world[:, 1] - (BOX_C[1] - BOX_H[1])) < 2e-3
    back = (np.abs(world[:, 1] - (BOX_C[1] + BOX_H[1])) < 1e-3) & ~top   # the top face's back edge is seen
    assert top.sum() > 30 and front.sum() > 10 and back.sum() == 0
    # the base frame is not the world frame: the cloud's centre is the box's centre expressed in the base frame
    assert np.linalg.norm(world.mean(0)[:2] - BOX_C[:2]) < 0.03
    assert np.linalg.norm(cloud.mean(0)[:2] - c_base[:2]) < 0.03
    assert np.linalg.norm(cloud.mean(0)[:2] - BOX_C[:2]) > 0.1
    # metres on the store's grid
    assert np.array_equal(cloud, snap_to_grid(cloud))


def test_point_colours_are_the_pixels_of_the_points_and_leave_the_cloud_as_it_was():
    """obs.point_color: each point carries its pixel's RGB (a red box: red points, the grey floor: grey points), and
    the cloud itself is the colourless one, bit for bit (the colour pass changes nothing of the geometry)."""
    model, data = _scene()
    c_base = _to_base(BOX_C, data)
    box = (tuple(c_base - 0.3), tuple(c_base + 0.3))            # the box and some floor around it
    plain = DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 128, *box, "base"))
    coloured = DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 128, *box, "base", color=True))
    obs = coloured.observation(data)
    cloud, rgb = obs["observation.point_cloud"], obs["observation.point_colors"]
    assert np.array_equal(cloud, plain(data)) and plain.observation(data).keys() == {"observation.point_cloud"}
    assert rgb.shape == (128, 3) and rgb.dtype == np.uint8
    b = data.body("base")
    world = cloud.astype(np.float64) @ b.xmat.reshape(3, 3).T + b.xpos
    on_box = np.all(np.abs(world - BOX_C) <= BOX_H + 2e-3, axis=1)
    floor = np.abs(world[:, 2]) < 1e-3
    assert on_box.sum() >= 5 and floor.sum() > 10
    r, g, bl = (rgb.astype(int)[:, i] for i in range(3))
    assert np.all(r[on_box] > g[on_box] + 40) and np.all(r[on_box] > bl[on_box] + 40)   # red
    assert np.all(np.abs(r[floor] - g[floor]) < 30)                                     # not red
    # the one path for a robot's RGB-D frames: cloud_from_depth with aligned colour images gives the same
    from sim.pointcloud import cloud_from_depth

    colours, depths = coloured.rgbd_images(data)
    c2, rgb2 = cloud_from_depth(depths, coloured.calibration(data), *box, 128, colors=colours)
    assert np.array_equal(c2, cloud) and np.array_equal(rgb2, rgb)
    with pytest.raises(ValueError, match="colour image"):
        cloud_from_depth(depths, coloured.calibration(data), *box, 128, colors=[colours[0][:10]])
    plain.close()
    coloured.close()


def test_crop_drops_the_floor_and_an_empty_crop_gives_zeros():
    model, data = _scene()
    c_base = _to_base(BOX_C, data)
    with_floor = DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 128, tuple(c_base - 0.3),
                                                  tuple(c_base + 0.3), "base"))(data)
    assert (np.abs(with_floor[:, 2]) < 1e-3).sum() > 20          # the floor is in this box
    empty = DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 16, (5.0, 5.0, 5.0), (6.0, 6.0, 6.0), "base"))(data)
    assert np.array_equal(empty, np.zeros((16, 3), np.float32))
    e = DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 16, (5.0, 5.0, 5.0), (6.0, 6.0, 6.0), "base",
                                         color=True)).observation(data)
    assert np.array_equal(e["observation.point_colors"], np.zeros((16, 3), np.uint8))


def test_farthest_points_is_deterministic_and_spreads():
    rng = np.random.default_rng(0)
    pts = rng.uniform(-1, 1, (4000, 3))
    a, b = farthest_points(pts, 64), farthest_points(pts, 64)
    assert np.array_equal(a, b)
    # FPS covers the cube far better than the first 64 points: the largest gap to the sample is smaller
    def cover(s):
        return np.sqrt(((pts[:, None] - s[None]) ** 2).sum(-1)).min(1).max()
    assert cover(a) < 0.8 * cover(pts[:64])
    few = farthest_points(pts[:5], 12)                            # fewer points than asked: repeated
    assert few.shape == (12, 3) and np.array_equal(few[5:10], pts[:5])


def test_bad_spec_and_unknown_camera_are_refused():
    model, _ = _scene()
    with pytest.raises(ValueError, match="crop_min"):
        CloudSpec(("cam",), (64, 64), 8, (0, 0, 1), (1, 1, 0), "base")
    with pytest.raises(ValueError, match="num_points"):
        CloudSpec(("cam",), (64, 64), 0, (0, 0, 0), (1, 1, 1), "base")
    with pytest.raises(ValueError, match="not in the model"):
        DepthPointCloud(model, CloudSpec(("nope",), (64, 64), 8, (0, 0, 0), (1, 1, 1), "base"))
    with pytest.raises(ValueError, match="base body"):
        DepthPointCloud(model, CloudSpec(("cam",), (64, 64), 8, (0, 0, 0), (1, 1, 1), "nobody"))


OBS = {"point_cloud": True, "point_cameras": ["corner", "corner3"], "point_image_size": 64, "num_points": 256}


def test_metaworld_cloud_is_a_function_of_the_seed_and_sees_the_objects():
    from sim.metaworld_env import MetaWorldEnv

    env = MetaWorldEnv("push-v3", obs_cfg=OBS)
    o1, _ = env.reset(seed=3)
    puck = env.raw_observation[4:7]                                 # Meta-World's base is at the world origin
    o2, _ = env.reset(seed=3)
    o3, _ = env.reset(seed=4)
    c1 = o1["observation.point_cloud"]
    assert c1.shape == (256, 3) and c1.dtype == np.float32
    assert np.array_equal(c1, o2["observation.point_cloud"])        # the same seed: the same cloud, bit for bit
    assert not np.array_equal(c1, o3["observation.point_cloud"])    # the puck moved
    assert env.observation_space["observation.point_cloud"].contains(c1)
    assert np.linalg.norm(c1 - puck, axis=1).min() < 0.03             # the puck's surface (radius 2 cm) is seen
    lo, hi = np.array(env.POINT_CROP[0]), np.array(env.POINT_CROP[1])
    assert np.all(c1 >= lo - GRID_M) and np.all(c1 <= hi + GRID_M)
    spec = env.spec_dict()["observation.point_cloud"]
    assert spec["shape"] == [256, 3] and spec["grid_m"] == GRID_M
    env.close()


def test_reset_frame_draws_the_goal_where_the_episode_has_it():
    """Issue 52, item 1: Meta-World places the goal after its last physics update; the reset frame must see it."""
    from sim.metaworld_env import MetaWorldEnv

    env = MetaWorldEnv("reach-v3", obs_cfg={"images": True, "cameras": ["corner"], "image_size": 32})
    for seed in range(3):
        env.reset(seed=seed)
        gap = np.linalg.norm(env.mj_data.site("goal").xpos - env.raw_observation[36:39])
        assert gap < 2e-3, (seed, gap)
    env.close()


def test_store_keeps_the_cloud_exactly_in_int16_and_pools_its_statistics(tmp_path):
    from experience_dict.store import ExperienceStore
    from sim.metaworld_env import MetaWorldEnv

    env = MetaWorldEnv("reach-v3", obs_cfg={**OBS, "point_color": True}, task_cfg={"max_episode_steps": 12})
    store = ExperienceStore.create_or_open(str(tmp_path / "s"), env.spec_dict())
    w = store.writer("w0")
    clouds, colours = [], []
    obs, info = env.reset(seed=1)
    w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=1, seed=1)
    done = False
    while not done:
        a = np.array([0.3, 0.2, 0.0, -1.0], np.float32)
        clouds.append(obs["observation.point_cloud"])
        colours.append(obs["observation.point_colors"])
        w.add_step(obs, a, 0.0, info["progress"])
        obs, _, term, trunc, info = env.step(a)
        done = term or trunc
    w.commit(success=False)
    w.close()
    r = ExperienceStore.open(str(tmp_path / "s"))
    ep = r.episodes()[0]
    got = r.load_episode(ep.episode_id)["observation.point_cloud"]
    assert got.dtype == np.float32 and np.array_equal(got, np.stack(clouds))
    st = r.stats()["observation.point_cloud"]
    assert np.asarray(st["mean"]).shape == (3,)
    assert np.allclose(st["mean"], np.stack(clouds).reshape(-1, 3).mean(0), atol=1e-5)
    # the colours: uint8 exactly, statistics per channel over every point
    rgb = r.load_episode(ep.episode_id)["observation.point_colors"]
    assert rgb.dtype == np.uint8 and np.array_equal(rgb, np.stack(colours))
    cst = r.stats()["observation.point_colors"]
    assert np.asarray(cst["mean"]).shape == (3,)
    assert np.allclose(cst["mean"], np.stack(colours).reshape(-1, 3).mean(0), atol=1e-3)
    rep = r.verify()
    assert not rep.get("corrupt") and not rep.get("errors"), rep
    # on disk: int16 grid indices, so the array is at most half of float32's bytes
    arr = r._array(ep.shard, "observation.point_cloud")
    assert any(c.get("name") == "fleetmind.point_grid" for c in arr.metadata.to_dict()["codecs"])
    env.close()


@pytest.fixture(scope="module")
def cloud_store(tmp_path_factory):
    """A real store of 3 reach-v3 episodes with point clouds and their colours (64 points, one 32 px RGB-D camera)."""
    from experience_dict.store import ExperienceStore
    from sim.metaworld_env import MetaWorldEnv

    obs_cfg = {"point_cloud": True, "point_cameras": ["corner"], "point_image_size": 32, "num_points": 64,
               "point_color": True}
    env = MetaWorldEnv("reach-v3", obs_cfg=obs_cfg, task_cfg={"max_episode_steps": 30})
    url = str(tmp_path_factory.mktemp("cloud") / "s")
    store = ExperienceStore.create_or_open(url, env.spec_dict())
    w = store.writer("w0")
    rng = np.random.default_rng(0)
    for seed in range(3):
        obs, info = env.reset(seed=seed)
        w.begin_episode(unit_id=0, embodiment="sawyer", task="reach-v3", policy_version=-1, seed=seed, is_demo=True)
        done = False
        while not done:
            a = np.r_[rng.uniform(-1, 1, 3), -1.0].astype(np.float32)
            w.add_step(obs, a, 0.0, info["progress"])
            obs, _, term, trunc, info = env.step(a)
            done = term or trunc
        w.commit(success=bool(seed % 2))
    w.close()
    env.close()
    return ExperienceStore.open(url)


def _cloud_policy(reader, color: bool = False, **over):
    from policies.aed_diffusion.modeling_aed_diffusion import build_policy, config_from_hydra

    keys = ["observation.state", "observation.point_cloud"] + (["observation.point_colors"] if color else [])
    cfg = {**over, "input_keys": keys, "dim": 32, "n_layers": 2, "n_heads": 2,
           "state_hidden": 32, "horizon": 8, "n_action_steps": 4, "point_channels": [16, 32],
           "aed": {"history_actions": 8, "group_size": 4, "memory_queries": 2, "tokenizer_vocab_size": 256},
           "mt_loss": {"weight": 0.01}}
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    return build_policy(config_from_hydra(cfg, reader), reader, reader.episodes())


def test_point_cloud_policy_trains_and_reads_the_cloud(cloud_store):
    import torch

    from experience_dict.sampler import WindowDataset
    from policies.onnx import example_inputs

    policy = _cloud_policy(cloud_store)
    assert policy.config.point_keys == ["observation.point_cloud"]
    assert policy.obs_encoder.tokens_per_frame == 2        # the state token and the cloud's pooled token
    assert len(policy.stats["observation.point_cloud"]["mean"]) == 3
    ds = WindowDataset(cloud_store, windows=policy.window_spec())
    batch = policy.tokenize_history(ds[list(range(0, 80, 10))])
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    losses = []
    for _ in range(30):
        loss, _ = policy(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert policy.obs_encoder.points["observation_point_cloud"].mlp[0].weight.grad is not None
    # the chunk depends on the cloud: move every point and the actions change
    policy.eval()
    x = example_inputs(policy, 2, steps=5, seed=1)
    noise = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = policy.predict_action_chunk(x, noise=noise)
        moved = {**x, "observation.point_cloud": x["observation.point_cloud"] + 0.3}
        b = policy.predict_action_chunk(moved, noise=noise)
    assert not torch.allclose(a, b, atol=1e-4)


def test_point_colour_policy_reads_the_colours_through_the_point_encoder(cloud_store):
    """policy.input_keys with observation.point_colors: the point encoder reads 3 more inputs per point (the colour in
    [-1, 1]), no token of its own, no normalisation statistics; the chunk depends on the colours; a colour key
    without a cloud of as many points is refused."""
    import torch

    from experience_dict.sampler import WindowDataset
    from policies.aed_diffusion import AEDDiffusionConfig
    from policies.onnx import example_inputs

    policy = _cloud_policy(cloud_store, color=True, point_relative=True)
    assert policy.config.point_color and policy.config.point_in_dim == 9
    assert policy.config.state_keys == ["observation.state"] and "observation.point_colors" not in policy.stats
    assert policy.obs_encoder.tokens_per_frame == 2
    assert policy.obs_encoder.points["observation_point_cloud"].mlp[0].in_features == 9
    ds = WindowDataset(cloud_store, windows=policy.window_spec())
    batch = policy.tokenize_history(ds[list(range(0, 80, 10))])
    assert batch["observation.point_colors"].dtype == torch.uint8
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for _ in range(30):
        loss, _ = policy(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(loss)
    policy.eval()
    x = example_inputs(policy, 2, steps=5, seed=1)
    assert x["observation.point_colors"].dtype == torch.uint8
    recoloured = {**x, "observation.point_colors": 255 - x["observation.point_colors"]}
    noise = torch.randn(2, 8, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():   # the cloud's token, and so the chunk, depends on the colours
        tok = policy.obs_encoder(policy._frames(x))
        assert not torch.allclose(tok, policy.obs_encoder(policy._frames(recoloured)), atol=1e-4)
        a = policy.predict_action_chunk(x, noise=noise)
        b = policy.predict_action_chunk(recoloured, noise=noise)
    assert not torch.allclose(a, b, atol=1e-4)
    shapes = {"observation.state": [4], "observation.point_cloud": [64, 3], "observation.point_colors": [32, 3]}
    with pytest.raises(ValueError, match="colours need exactly one point cloud"):
        AEDDiffusionConfig(input_shapes=shapes)


@pytest.mark.parametrize("relative,color", [(False, False), (True, False), (True, True)])
def test_critic_features_score_the_cloud_through_the_policys_encoder(cloud_store, relative, color):
    import torch

    from policies.critic import CriticFeatures

    policy = _cloud_policy(cloud_store, color=color, point_relative=relative)
    f = CriticFeatures.from_policy(policy)
    assert f.keys == ["observation.state", "observation.point_cloud"] + (["observation.point_colors"] if color else [])
    d = cloud_store.load_episode(cloud_store.episodes()[0].episode_id)
    out = f({k: d[k][:5] for k in f.keys})
    assert out.shape == (5, 4 + policy.config.dim)
    # the same numbers as the policy's own encoder on its normalised cloud
    with torch.no_grad():
        x = policy.point_input("observation.point_cloud", torch.as_tensor(d["observation.point_cloud"][:5]),
                               torch.as_tensor(d["observation.state"][:5]),
                               torch.as_tensor(d["observation.point_colors"][:5]))
        assert x.shape == (5, 64, 3 + 3 * relative + 3 * color)
        ref = policy.obs_encoder.points["observation_point_cloud"](x)
    torch.testing.assert_close(out[:, 4:], ref)
    # a saved critic rebuilds the same features (critic.json holds the point settings)
    back = CriticFeatures(**f.spec())
    back.load_state_dict(f.state_dict())
    torch.testing.assert_close(back({k: d[k][:5] for k in f.keys}), out)


@pytest.mark.slow
@pytest.mark.parametrize("relative,color", [(False, False), (True, True)])
def test_exported_point_cloud_policy_acts_as_the_policy(cloud_store, tmp_path, relative, color):
    """The export (PyTorch and the ONNX graph) of a point-cloud policy gives the policy's chunks on the same inputs."""
    import torch

    from policies.export import export_checkpoint
    from policies.onnx import example_inputs
    from policies.runtime import PolicyRuntime

    policy = _cloud_policy(cloud_store, color=color, point_relative=relative).eval()
    policy.save_pretrained(tmp_path / "ckpt")
    folder = export_checkpoint(tmp_path / "ckpt", tmp_path / "export", control_hz=80.0, onnx_steps=[4])
    x = example_inputs(policy, 1, steps=6, seed=3)
    noise = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = policy.predict_action_chunk(x, noise=noise, num_inference_steps=4)
    for backend in ("torch", "onnx"):
        rt = PolicyRuntime.load(folder, backend=backend, num_threads=1, num_inference_steps=4)
        assert rt.input_shapes["observation.point_cloud"] == [64, 3]
        torch.testing.assert_close(rt.predict_action_chunk(x, noise=noise, num_inference_steps=4), ref,
                                   atol=1e-5, rtol=1e-5)


def test_cloud_grabber_gives_each_units_own_cloud_through_one_context():
    """Two units of one task share one depth renderer; each gets what its own camera (varied per unit) sees."""
    from sim.metaworld_env import MetaWorldEnv
    from sim.pointcloud import CloudGrabber

    obs = {"point_cloud": True, "point_cameras": ["corner"], "point_image_size": 48, "num_points": 64}
    robot = {"train_units": [0, 1], "heldout_units": [], "variation": {"camera_pos_mm": 20.0, "camera_rot_deg": 2.0}}
    envs = [MetaWorldEnv("reach-v3", unit_id=u, robot_cfg=robot, obs_cfg=obs) for u in (0, 1)]
    grab = CloudGrabber(["corner"], (48, 48), 64)
    for env in envs:
        own, _ = env.reset(seed=2)
        np.testing.assert_array_equal(grab.cloud(env), own["observation.point_cloud"])
    assert len(grab._clouds) == 1
    a, b = (grab.cloud(e) for e in envs)
    assert not np.array_equal(a, b)           # the units' cameras differ
    grab.close()
    for env in envs:
        env.close()
    # with colour: (N, 6), the env's own cloud and colours side by side
    env = MetaWorldEnv("reach-v3", unit_id=1, robot_cfg=robot, obs_cfg={**obs, "point_color": True})
    own, _ = env.reset(seed=2)
    grab = CloudGrabber(["corner"], (48, 48), 64, color=True)
    c = grab.cloud(env)
    assert c.shape == (64, 6) and c.dtype == np.float32
    np.testing.assert_array_equal(c[:, :3], own["observation.point_cloud"])
    np.testing.assert_array_equal(c[:, 3:], own["observation.point_colors"].astype(np.float32))
    grab.close()
    env.close()


def test_detector_reads_the_cloud_relative_to_the_hand():
    """A detector with a cloud learns a label that only the geometry gives: whether a cluster of points sits within
    3 cm of the hand (as a reach goal marker does at success); it round-trips through save / load."""
    import torch

    from policies.success_detector import DetectorSpec, fit_detector

    rng = np.random.default_rng(0)
    n, P = 600, 64
    hand = rng.uniform(-0.2, 0.2, (n, 3)).astype(np.float32)
    clouds = rng.uniform(-0.4, 0.4, (n, P, 3)).astype(np.float32)
    label = rng.random(n) < 0.5
    target = np.where(label[:, None], hand + rng.normal(0, 0.01, (n, 3)), rng.uniform(-0.4, 0.4, (n, 3)))
    clouds[:, :8] = target[:, None] + rng.normal(0, 0.005, (n, 8, 3))     # the marker's points
    state = np.concatenate([hand, np.zeros((n, 1), np.float32)], 1)
    spec = DetectorSpec(tasks=["reach-v3"], cameras=[], num_points=P)
    frames = torch.zeros((n, 0, 64, 64, 3), dtype=torch.uint8)
    tr, te = slice(0, 500), slice(500, n)
    model, _ = fit_detector(spec, frames[tr], torch.as_tensor(state[tr]), torch.zeros(500, dtype=torch.long),
                               torch.as_tensor(label[tr].astype(np.int64)), updates=300, batch_size=64,
                               clouds=torch.as_tensor(clouds[tr]))
    p = model.probability(frames[te], torch.as_tensor(state[te]), torch.zeros(100, dtype=torch.long),
                          torch.as_tensor(clouds[te])).numpy()
    assert ((p > 0.5) == label[te]).mean() > 0.85
    with pytest.raises(ValueError, match="clouds"):
        model(frames[te], torch.as_tensor(state[te]), torch.zeros(100, dtype=torch.long))


def test_detector_with_colour_tells_the_points_apart_by_colour():
    """labels.point_color: a label that only the colour gives (the cluster at the hand is red, or the same cluster in
    blue with a red one elsewhere): the coloured detector learns it, the same detector without colour cannot."""
    import torch

    from policies.success_detector import DetectorSpec, fit_detector

    rng = np.random.default_rng(1)
    n, P = 600, 64
    hand = rng.uniform(-0.2, 0.2, (n, 3)).astype(np.float32)
    label = rng.random(n) < 0.5
    xyz = rng.uniform(-0.4, 0.4, (n, P, 3)).astype(np.float32)
    rgb = np.full((n, P, 3), 128.0, np.float32)
    far = rng.uniform(-0.4, 0.4, (n, 3))
    xyz[:, :8] = hand[:, None] + rng.normal(0, 0.005, (n, 8, 3))          # a cluster at the hand, always
    xyz[:, 8:16] = far[:, None] + rng.normal(0, 0.005, (n, 8, 3))         # and one elsewhere
    red, blue = np.array([220.0, 30, 30]), np.array([30.0, 30, 220])
    rgb[:, :8] = np.where(label[:, None, None], red, blue)
    rgb[:, 8:16] = np.where(label[:, None, None], blue, red)
    clouds = np.concatenate([xyz, rgb], -1)
    state = np.concatenate([hand, np.zeros((n, 1), np.float32)], 1)
    frames = torch.zeros((n, 0, 64, 64, 3), dtype=torch.uint8)
    tr, te = slice(0, 500), slice(500, n)
    acc = {}
    for color in (True, False):
        spec = DetectorSpec(tasks=["reach-v3"], cameras=[], num_points=P, point_color=color)
        c = torch.as_tensor(clouds if color else xyz)
        model, _ = fit_detector(spec, frames[tr], torch.as_tensor(state[tr]), torch.zeros(500, dtype=torch.long),
                                torch.as_tensor(label[tr].astype(np.int64)), updates=300, batch_size=64,
                                clouds=c[tr])
        p = model.probability(frames[te], torch.as_tensor(state[te]), torch.zeros(100, dtype=torch.long),
                              c[te]).numpy()
        acc[color] = ((p > 0.5) == label[te]).mean()
    assert acc[True] > 0.85 and acc[False] < 0.7, acc
    with pytest.raises(ValueError, match="clouds"):
        model(frames[te], torch.as_tensor(state[te]), torch.zeros(100, dtype=torch.long), torch.as_tensor(clouds[te]))


def test_labels_config_needs_a_camera_or_the_cloud():
    from configs.rules import ConfigError
    from fleet.labels_config import LabelsConfig

    assert LabelsConfig.from_dict({"cameras": [], "point_cloud": True}).num_points == 256
    with pytest.raises(ConfigError, match="at least one camera"):
        LabelsConfig.from_dict({"cameras": []})
