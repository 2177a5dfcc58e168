"""The fleet on a real two-node Ray cluster on this machine (fleet.cluster.LocalRayCluster: a head and a second
node, each its own ``ray start`` process tree with its own raylet and custom resources; the nodes import
fleetmind as installed, not from the test's working directory).

Covered: units spread over both nodes and the learner placed by its resource on the head; the second node
SIGKILLed mid-run (raylet, agents and workers, by their own PIDs): its units are re-placed on the head, every
planned trial is committed exactly once (0 lost, 0 duplicated (unit, seed)), the run's summary reports the node
loss, and the learner goes on training and publishes a version after the loss.
"""

import os
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("ray")
import ray
from hydra import compose, initialize_config_dir

from experience_dict.store import ExperienceStore
from fleet.cluster import LocalRayCluster
from fleet.coordinator import Fleet, _plain
from tests.test_learner import setup  # noqa: F401 - the learner's store, tiny base and registry (a fixture)

CONFIGS = str(Path(__file__).resolve().parents[1] / "configs")


@pytest.mark.slow
def test_two_node_fleet_survives_losing_a_node(tmp_path, setup):  # noqa: F811 - the imported fixture
    from fleet.fert.learner import FertLearner
    from fleet.registry import CheckpointRegistry
    from tests.test_learner import learner_cfg

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with initialize_config_dir(config_dir=CONFIGS, version_base=None):
        cfg = compose("config", overrides=["task=mw_quick", "robot=nominal", "task.tasks=[reach-v3]",
                                           "task.max_episode_steps=60", f"store.url={tmp_path}/store",
                                           "fleet.placement=spread", "fleet.worker_cpus=0.5", "fleet.max_restarts=3",
                                           f"fleet.registry_url={tmp_path}/registry", f"fleet.cache_dir={tmp_path}/c"])
    units = [0, 1, 2, 3]
    plan = [{"task": "reach-v3", "unit_id": u, "seed": 1000 * u + k} for k in range(5) for u in units]
    with LocalRayCluster([{"num_cpus": 2, "resources": {"learner": 1}}, {"num_cpus": 2}],
                         log_dir=tmp_path / "cluster") as cluster:
        c = _plain(cfg)
        c["fleet"]["ray_address"] = cluster.address
        try:
            with Fleet(c, policy="expert", units=units) as fleet:
                head = next(n["NodeID"] for n in ray.nodes() if n["Resources"].get("learner"))
                second = next(n["NodeID"] for n in ray.nodes() if not n["Resources"].get("learner"))
                placed = dict(fleet.unit_nodes)
                assert set(placed.values()) == {head, second}, f"units not spread over both nodes: {placed}"
                # the learner: a Ray actor that asks for the learner resource (a GPU node's, in production)
                lrn = ray.remote(FertLearner).options(resources={"learner": 1}, num_cpus=0).remote(
                    learner_cfg(6), setup["store"], setup["registry"], str(tmp_path / "learner"), setup["base"],
                    run_id="cluster")
                assert ray.get(lrn.node.remote()) == head
                reported: list[str] = []
                box: dict = {}
                th = threading.Thread(target=lambda: box.update(r=fleet.run(
                    plan=plan, progress=False, on_episode=lambda s: reported.append(s["episode_id"]))), daemon=True)
                th.start()
                t0 = time.monotonic()
                while len(reported) < 4 and time.monotonic() - t0 < 300:
                    time.sleep(0.1)
                assert len(reported) >= 4, "the fleet committed nothing before the kill"
                killed = cluster.kill_node(1)
                assert killed and not cluster.node_pids(1)
                rounds = lrn.run.remote(1)        # the learner trains a round after the loss
                th.join(600)
                result = box["r"]
                status = ray.get(rounds, timeout=600)
        finally:
            ray.shutdown()
    assert [x["node_id"] for x in result.node_losses] == [second]
    lost_units = sorted(u for u, n in placed.items() if n == second)
    assert result.node_losses[0]["units"] == lost_units
    assert all(result.unit_nodes[u] == head for u in units), result.unit_nodes   # re-placed on the survivor
    assert "lost" in result.summary() and all(result.restarts[u] >= 1 for u in lost_units)
    store = ExperienceStore.open(str(tmp_path / "store"))
    eps = store.episodes(quarantined=None)
    pairs = Counter((int(m.unit_id), int(m.seed)) for m in eps)
    assert set(pairs) == {(t["unit_id"], t["seed"]) for t in plan}           # every trial committed ...
    assert max(pairs.values()) == 1                                           # ... once: 0 duplicated
    assert set(reported) <= {m.episode_id for m in eps} and len(set(reported)) == len(plan)   # 0 lost
    assert store.verify()["ok"]
    assert status["round"] == 1, status
    metas = [CheckpointRegistry(setup["registry"]).manifest(v)["metadata"] for v in CheckpointRegistry(setup["registry"]).versions()]
    assert any(m.get("run_id") == "cluster" for m in metas)


def test_a_node_whose_ray_start_exits_is_launched_again(tmp_path):
    """Ray gives a raylet a fixed 30 s to register and then exits `ray start` (seen on a loaded 2-core machine):
    LocalRayCluster launches that node again; a node that never comes up fails with a ClusterError naming it."""
    from fleet.cluster import ClusterError

    class FlakyFirstLaunch(LocalRayCluster):
        launches = 0

        def _command(self, i):
            type(self).launches += 1
            return ["sh", "-c", "echo simulated startup timeout; exit 1"] if type(self).launches == 1 \
                else super()._command(i)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with FlakyFirstLaunch([{"num_cpus": 1}], log_dir=tmp_path / "flaky") as cluster:
        assert cluster.attempts == [2]
        log = (tmp_path / "flaky" / "node0.log").read_text()
        assert "simulated startup timeout" in log and "launching it again (attempt 2 of 3)" in log

    class NeverUp(LocalRayCluster):
        def _command(self, i):
            return ["sh", "-c", "exit 1"]

    with pytest.raises(ClusterError, match="node 0 \\(head\\) did not start \\(each launch of 2"):
        NeverUp([{"num_cpus": 1}], log_dir=tmp_path / "never", start_attempts=2).start()


@pytest.mark.slow
def test_head_lost_mid_run_is_one_line_with_partial_results(tmp_path):
    """The Ray head SIGKILLed under a running ``scripts/rollout.py`` (``fleet.ray_address`` set): the driver ends
    within ``fleet.head_lost_after_s`` with exit 3 and one line (the head, what is kept, the command that resumes)
    and writes the partial ``fleet_result.json``, whose episodes are all in the store (before: Ray's native
    ``WrongClusterID`` abort or exit 1 after 60 s, no message, no result file)."""
    import json
    import signal
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "WANDB_MODE": "disabled"}
    with LocalRayCluster([{"num_cpus": 2}], log_dir=tmp_path / "cluster") as cluster:
        cmd = [sys.executable, "scripts/rollout.py", "task=mw_quick", "task.tasks=[reach-v3]", "robot=nominal",
               "task.max_episode_steps=40", "fleet.units=2", "policy=expert", "fleet.episodes_per_unit=200",
               "fleet.head_lost_after_s=3", f"store.url={tmp_path}/store", f"hydra.run.dir={tmp_path}/run",
               f"fleet.ray_address={cluster.address}"]
        proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 300
        n = 0
        while n < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
            try:
                n = len(ExperienceStore.open(str(tmp_path / "store")).episodes())
            except Exception:  # noqa: BLE001 - not created yet
                n = 0
        assert n >= 4 and proc.poll() is None, "the fleet did not start committing"
        for pid in reversed(cluster.node_pids(0)):       # the head machine lost: no graceful shutdown
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=120)
        took = time.monotonic() - t0
    assert proc.returncode == 3, err[-3000:]
    assert took < 40, f"the driver took {took:.0f} s to end after the head was lost"
    ours = [ln for ln in err.splitlines() if ln.startswith("fleet: the Ray head")]
    assert len(ours) == 1 and "resume" in ours[0] and "scripts/rollout.py" in ours[0], err[-3000:]
    res = json.loads((tmp_path / "run" / "fleet_result.json").read_text())
    assert res["complete"] is False and res["head_lost"]["unreachable_s"] >= 3
    committed = {e.episode_id for e in ExperienceStore.open(str(tmp_path / "store")).episodes()}
    assert res["episodes"] and {e["episode_id"] for e in res["episodes"]} <= committed
