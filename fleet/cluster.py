"""A real multi-node Ray cluster on one machine: every node is its own ``ray start --block`` process tree (its
own raylet, object store and workers), joined to one head over TCP, as on a cluster of machines.

Used by the two-node tests and ``scripts/cluster.py``; on real machines the same ``ray start`` commands run
one per machine (docs/CLUSTER.md) and the fleet joins with ``fleet.ray_address=<head>:<port>``.

    with LocalRayCluster([{"num_cpus": 2, "resources": {"learner": 1}},      # the head
                          {"num_cpus": 2, "resources": {"sim": 2}}]) as cluster:
        run(cfg with fleet.ray_address=cluster.address)
        cluster.kill_node(1)               # SIGKILL the second node's raylet and workers, by their own PIDs

Nothing here calls ``ray stop`` (which would stop every Ray instance of the machine, other jobs' too).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Self

# how fast the head's GCS declares a silent node dead (Ray's defaults take ~30 s): period x threshold
FAST_HEALTH_CHECK = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "1000",
                     "RAY_health_check_failure_threshold": "3", "RAY_AUTH_MODE": "disabled"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid`` (a ``ray start`` launched with ``start_new_session``: its
    raylet and agents keep its session id after it exits)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid:
                os.kill(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError, psutil.Error):
            pass


class ClusterError(RuntimeError):
    """A node did not start (the message carries the tail of its log)."""


class LocalRayCluster:
    """Start a head and worker nodes as separate ``ray start --block`` processes on 127.0.0.1.

    Args:
        nodes: one dict per node, the first is the head: ``{"num_cpus": int, "num_gpus": int (default 0),
            "resources": {name: amount}}`` (custom resources, e.g. ``{"learner": 1}``).
        env: extra environment of every node (default :data:`FAST_HEALTH_CHECK`: a dead node is declared
            dead within ~3-5 s instead of ~30 s).
        log_dir: where each node's ``ray start`` output goes (default: a temporary directory).
        start_timeout_s: seconds to wait for each node.
        start_attempts: launches of a node whose ``ray start`` exits before it is up. Ray gives a new raylet a
            fixed 30 s to register with the GCS (``ray/_private/node.py``) and exits otherwise, which a heavily
            loaded machine can exceed; the failed launch's processes are killed before the next one.

    Attributes:
        address: ``"127.0.0.1:<port>"`` of the head's GCS (``ray.init(address=...)``, ``fleet.ray_address``).

    Raises:
        ClusterError: a node exited or did not come up in time. ValueError: no nodes.
    """

    def __init__(self, nodes: list[dict[str, Any]], env: dict[str, str] | None = None,
                 log_dir: str | Path | None = None, start_timeout_s: float = 120.0, start_attempts: int = 3):
        if not nodes:
            raise ValueError("LocalRayCluster: give at least the head node")
        self.nodes = [dict(n) for n in nodes]
        # the nodes import fleetmind as installed (pip install -e . / a wheel), never from this process's
        # PYTHONPATH or working directory, as on machines that share no directory with the driver
        base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.env = {**base_env, **(FAST_HEALTH_CHECK if env is None else env)}
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="fleetmind_cluster_"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout_s = float(start_timeout_s)
        self.start_attempts = max(int(start_attempts), 1)
        self.attempts: list[int] = []   # launches each node took
        self.temp_dir = tempfile.mkdtemp(prefix="fmray_", dir="/tmp")   # short: Ray's socket paths must fit 107 bytes
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.procs: list[subprocess.Popen] = []
        self.killed: set[int] = set()

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _command(self, i: int) -> list[str]:
        n = self.nodes[i]
        ray_bin = Path(sys.executable).with_name("ray")
        cmd = [str(ray_bin) if ray_bin.exists() else "ray", "start", "--block", "--disable-usage-stats",
               f"--num-cpus={int(n.get('num_cpus', 1))}", f"--num-gpus={int(n.get('num_gpus', 0))}",
               f"--resources={json.dumps(dict(n.get('resources') or {}))}"]
        if i == 0:   # its own temp dir: no /tmp/ray/ray_current_cluster that a bare ray.init() elsewhere would join
            cmd += ["--head", f"--port={self.port}", "--include-dashboard=false", "--node-ip-address=127.0.0.1",
                    f"--temp-dir={self.temp_dir}"]
        else:
            cmd += [f"--address={self.address}", "--node-ip-address=127.0.0.1"]
        return cmd

    def start(self) -> None:
        """Start the head, then every worker node, waiting for each to report it is up (a node whose ``ray
        start`` exits first is launched again, up to ``start_attempts`` times)."""
        for i in range(len(self.nodes)):
            for attempt in range(1, self.start_attempts + 1):
                log = open(self.log_dir / f"node{i}.log", "w" if attempt == 1 else "a")  # noqa: SIM115 - kept open while the node runs
                proc = subprocess.Popen(self._command(i), stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                        cwd=self.log_dir, start_new_session=True)
                self.procs[i:] = [proc]
                if self._wait_up(i):
                    self.attempts.append(attempt)
                    break
                if proc.poll() is None or attempt == self.start_attempts:
                    self._fail(i)
                _kill_session(proc.pid)   # what the failed launch left (its raylet may outlive `ray start`)
                log.write(f"\n[fleetmind] node {i}: `ray start` exited before the node was up; launching it again "
                          f"(attempt {attempt + 1} of {self.start_attempts})\n")
                log.flush()

    def _wait_up(self, i: int) -> bool:
        """True once node ``i`` logs that it is up; False when its ``ray start`` exits first or the time is up."""
        path = self.log_dir / f"node{i}.log"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            text = path.read_text(errors="replace") if path.exists() else ""
            if "block forever" in text:
                return True
            if self.procs[i].poll() is not None:
                return False
            time.sleep(0.2)
        return False

    def _fail(self, i: int) -> None:
        path = self.log_dir / f"node{i}.log"
        self.stop()
        raise ClusterError(f"node {i} ({'head' if i == 0 else 'worker'}) did not start (each launch of "
                           f"{self.start_attempts} waited at most {self.start_timeout_s:g} s): "
                           f"{' '.join(self._command(i))}\n"
                           + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))

    def node_pids(self, i: int) -> list[int]:
        """PIDs of node ``i``'s process tree: the ``ray start`` process, its raylet, agents and Ray workers
        (empty once killed)."""
        import psutil

        try:
            root = psutil.Process(self.procs[i].pid)
            return [root.pid] + [c.pid for c in root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def kill_node(self, i: int) -> list[int]:
        """SIGKILL every process of node ``i`` (a machine lost: no graceful shutdown); returns the PIDs killed.

        Raises:
            ValueError: ``i == 0`` (the head holds the cluster's GCS; losing it ends the cluster) or out of range.
        """
        if not 0 < i < len(self.procs):
            raise ValueError(f"kill_node: node {i} is the head or does not exist (nodes 1..{len(self.procs) - 1})")
        pids = self.node_pids(i)
        for pid in reversed(pids):   # children first, so none is re-parented and left behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.procs[i].wait(timeout=30)
        self.killed.add(i)
        return pids

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop every node still running: SIGTERM to its ``ray start`` (which stops its raylet and workers), then
        SIGKILL to anything of its tree left after ``timeout_s``."""
        trees = {i: self.node_pids(i) for i in range(len(self.procs))}
        for i in reversed(range(len(self.procs))):   # workers first, then the head
            if self.procs[i].poll() is None:
                self.procs[i].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            try:
                p.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
        for pids in trees.values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        shutil.rmtree(self.temp_dir, ignore_errors=True)   # the session's sockets and object spill files
