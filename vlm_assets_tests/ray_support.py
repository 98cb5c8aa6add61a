"""A Ray cluster of several nodes on this machine: a head and worker nodes, each a `ray start` of its own
(its own raylet, temporary folder, HOME and working directory), all on a loopback address."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from vlm_assets_tests.run_support import descendants
from vlm_assets_tests.s3_support import free_port, free_ports

# Ray takes 127.0.0.1 (and localhost) to mean "this machine" and replaces it with the machine's
# network address; any other address of the loopback range it uses as given.
LOOPBACK = "127.0.0.2"
NODE_START_S = 90
REPOSITORY = Path(__file__).resolve().parents[1]
NODE_PORTS = ("node-manager-port", "object-manager-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
              "metrics-export-port", "runtime-env-agent-port")
# Small object stores (in /dev/shm): the chunks' results are megabytes at most.
OBJECT_STORE_BYTES = 100 * 1000 * 1000
_WAIT_FOR_NODES = """
import sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[3])
while sum(1 for node in ray.nodes() if node["Alive"] and node["Resources"].get("CPU")) < int(sys.argv[2]):
    if time.monotonic() > deadline:
        sys.exit(f"fewer than {sys.argv[2]} worker nodes joined: {ray.nodes()}")
    time.sleep(0.5)
"""


class LoopbackRayCluster:
    """`with LoopbackRayCluster(workers=2) as cluster:` a head without CPUs (so every task runs on a
    worker node) and `workers` nodes of `cpus` CPUs each; `cluster.address` for ray.init / --address."""

    def __init__(self, workers: int = 2, cpus: int = 1) -> None:
        self.workers, self.cpus = workers, cpus
        # Short: Ray's Unix sockets live under it, and a socket's path may not exceed 107 bytes.
        self.folder = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
        self.address = f"{LOOPBACK}:{free_port()}"
        self.nodes: list[subprocess.Popen] = []

    def __enter__(self) -> LoopbackRayCluster:
        try:
            client, dashboard = free_ports(2)
            self._start("head", "--head", f"--port={self.address.rsplit(':', 1)[1]}", "--num-cpus=0",
                        "--include-dashboard=false", f"--ray-client-server-port={client}", f"--dashboard-port={dashboard}")
            for number in range(self.workers):
                self.add_worker(f"worker{number + 1}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def add_worker(self, name: str) -> subprocess.Popen:
        """Start a worker node and wait until the cluster counts it."""
        node = self._start(name, f"--address={self.address}", f"--num-cpus={self.cpus}")
        joined = sum(1 for process in self.nodes[1:] if process.poll() is None)
        subprocess.run([sys.executable, "-c", _WAIT_FOR_NODES, self.address, str(joined), str(NODE_START_S)],
                       check=True, timeout=NODE_START_S + 30, env=self._env(self.folder / name))
        return node

    def kill(self, node: subprocess.Popen) -> None:
        """The node lost at once, as a machine is: its raylet, object store and task processes killed."""
        processes = descendants(node.pid)
        os.killpg(node.pid, signal.SIGKILL)
        for pid in processes:  # the raylet's task processes are not in its process group
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        node.wait()

    def _start(self, name: str, *args: str) -> subprocess.Popen:
        home = self.folder / name
        home.mkdir()
        log = (home / "node.log").open("w")
        # Every port a node listens on is a free one: its defaults are fixed numbers, which the nodes
        # of this cluster (and of any other on the machine) would share.
        ports = dict(zip(NODE_PORTS, free_ports(len(NODE_PORTS))))
        node = subprocess.Popen(
            [str(Path(sys.executable).parent / "ray"), "start", "--block", f"--node-ip-address={LOOPBACK}",
             f"--temp-dir={home / 'tmp'}", f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
             *(f"--{option}={port}" for option, port in ports.items()), *args],
            cwd=home, env=self._env(home), stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        log.close()
        self.nodes.append(node)
        if name == "head":
            self._wait_for_head(home / "node.log", node)
        return node

    @staticmethod
    def _env(home: Path) -> dict[str, str]:
        # Every node runs this checkout's code, the tests' modules too (their chunk functions).
        path = os.pathsep.join(filter(None, [str(REPOSITORY), os.environ.get("PYTHONPATH")]))
        return {**os.environ, "HOME": str(home), "PYTHONPATH": path, "RAY_USAGE_STATS_ENABLED": "0"}

    @staticmethod
    def _wait_for_head(log: Path, node: subprocess.Popen) -> None:
        deadline = time.monotonic() + NODE_START_S
        while "Ray runtime started" not in log.read_text():
            if node.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the Ray head did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def __exit__(self, *_: object) -> None:
        for node in reversed(self.nodes):
            if node.poll() is None:
                self.kill(node)
        shutil.rmtree(self.folder, ignore_errors=True)


# Chunk functions for the tests' ordered_map calls: in a module the nodes import by its name.
_set_up_with: list[str] = []


def set_up(label: str) -> None:
    _set_up_with.append(label)


def chunk_on_node(chunk: tuple[int, float]) -> tuple[int, str, list[str]]:
    """(the chunk's number, the node it ran on, what this process was set up with)."""
    import ray

    number, seconds = chunk
    time.sleep(seconds)
    return number, ray.get_runtime_context().get_node_id(), list(_set_up_with)


def fail_on_three(number: int) -> int:
    if number == 3:
        raise FileNotFoundError(f"chunk {number}: no such file")
    return number


def write_mixed_source(folder: Path, rows: int, seed: int = 5) -> Path:
    """A JSON-lines source of `rows` records in `folder` (its media beside it): chats of assorted
    lengths, every third with one of 12 small images, every 97th naming an image that is not there."""
    from PIL import Image

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for number in range(12):
        Image.new("RGB", (rng.randint(40, 400), rng.randint(40, 400)), (number * 20, 90, 160)).save(folder / f"img{number}.jpg")
    words = ["why", "is", "the", "sky", "blue", "light", "scatter", "photo", "shows", "a"]
    with (folder / "mixed.jsonl").open("w") as out:
        for number in range(rows):
            question = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
            record: dict = {"id": f"m{number}", "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": "Rayleigh scattering. " * rng.randint(1, 30)},
            ]}
            if number % 97 == 0:
                record["images"] = ["missing.jpg"]
            elif number % 3 == 0:
                record["images"] = [f"img{rng.randrange(12)}.jpg"]
            out.write(json.dumps(record) + "\n")
    return folder / "mixed.jsonl"


class TaskWatch:
    """What the cluster's nodes are running, seen from /proc a few times a second while `with` lasts:
    `seen[node index]` holds the titles of the Ray task processes (`ray::<task name>`) found on it."""

    def __init__(self, cluster: LoopbackRayCluster, period_s: float = 0.02) -> None:
        self.cluster, self.period_s = cluster, period_s
        self.seen: dict[int, set[str]] = {index: set() for index in range(len(cluster.nodes))}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def running(self, index: int, title_start: str) -> bool:
        return any(title.startswith(title_start) for title in self.now().get(index, ()))

    def now(self) -> dict[int, set[str]]:
        found: dict[int, set[str]] = {}
        for index, node in enumerate(self.cluster.nodes):
            for pid in descendants(node.pid) if node.poll() is None else ():
                try:
                    title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
                except OSError:
                    continue  # gone meanwhile
                if title.startswith("ray::"):
                    found.setdefault(index, set()).add(title)
        return found

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            for index, titles in self.now().items():
                self.seen.setdefault(index, set()).update(titles)

    def __enter__(self) -> TaskWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
