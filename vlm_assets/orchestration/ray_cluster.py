"""`vlm-assets run --executor ray`: the chunks of every chunked step go to a Ray cluster.

Dagster stays the control plane: the runs are launched, recorded and checked as without Ray (one
run per asset partition, on the instance), and the work inside a step that is already cut into
chunks (catalogue ranges, token-length chunks, packed JSON and shard chunks: vlm_assets.parallel)
becomes Ray tasks on the cluster's nodes instead of processes of this machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

from vlm_assets.parallel import RAY_ADDRESS_ENV_VAR, STEP_PROCESSES_ENV_VAR

DEFAULT_ADDRESS = "auto"
PROBE_TIMEOUT_S = 30
# Run in a process of its own: a process that joined Ray holds Ray's threads, and `vlm-assets run`
# forks its workers from itself later.
_PROBE = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
print(int(ray.cluster_resources().get("CPU", 0)))
"""


def cluster_cpus(address: str) -> int:
    """The CPUs of the Ray cluster at `address`; ValueError when no cluster answers there."""
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE, address], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ValueError(f"no Ray cluster answered at {address!r} within {PROBE_TIMEOUT_S} s") from None
    lines = probe.stdout.split()
    if probe.returncode != 0 or not lines:
        said = (probe.stderr.strip().splitlines() or ["(nothing)"])[-1]
        raise ValueError(f"cannot join the Ray cluster at {address!r} (--address): {said}")
    cpus = int(lines[-1])
    if cpus < 1:
        raise ValueError(f"the Ray cluster at {address!r} has no CPUs to run tasks on: join a node with "
                         "`ray start --address …`")
    return cpus


def use_ray_cluster(address: str | None) -> int:
    """Send this process's chunked steps, and its workers', to the Ray cluster at `address`; its CPUs.

    Each step then keeps up to a few chunks per cluster CPU in flight ($VLM_ASSETS_STEP_PROCESSES,
    unless the user set it), whichever run it belongs to.
    """
    address = address or os.environ.get(RAY_ADDRESS_ENV_VAR) or DEFAULT_ADDRESS
    cpus = cluster_cpus(address)
    os.environ[RAY_ADDRESS_ENV_VAR] = address
    os.environ.setdefault(STEP_PROCESSES_ENV_VAR, str(cpus))
    return cpus
