"""A real S3 API server on loopback for tests and benchmarks: moto's server mode (``moto[server]``, a dev
dependency), started as a child process with one bucket. Nothing here is used in production."""

from __future__ import annotations

import socket
import subprocess
import sys
import time


def start_local_s3(bucket: str, key: str = "testing", secret: str = "testing",
                   timeout_s: float = 60.0) -> tuple[subprocess.Popen, dict]:
    """Start moto's S3 server on a free 127.0.0.1 port and create ``bucket``.

    Returns:
        ``(process, storage_options)``: kill the process when done; ``storage_options`` is what
        ``store.storage_options`` / ``s3fs.S3FileSystem(**...)`` take (``endpoint_url``, ``key``, ``secret``,
        ``client_kwargs.region_name``).
    Raises:
        RuntimeError: the server did not answer within ``timeout_s`` seconds (the process is killed).
        ImportError: moto or boto3 is not installed (``pip install 'moto[server]'``).
    """
    import boto3

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    opts = {"endpoint_url": f"http://127.0.0.1:{port}", "key": key, "secret": secret,
            "client_kwargs": {"region_name": "us-east-1"}}
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            boto3.client("s3", endpoint_url=opts["endpoint_url"], aws_access_key_id=key, aws_secret_access_key=secret,
                         region_name="us-east-1").create_bucket(Bucket=bucket)
            return proc, opts
        except Exception:  # noqa: BLE001 - any error until the server answers
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto S3 server on port {port} did not start within {timeout_s} s") from None
            time.sleep(0.2)
