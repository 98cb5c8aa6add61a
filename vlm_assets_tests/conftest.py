from __future__ import annotations

import fcntl
import gc
import json
import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from vlm_assets.config import AppConfig, load_config
from vlm_assets.demo import write_demo

# Real sample data (public test media and annotation files): $VLM_ASSETS_TEST_DATA, else
# shared/data beside this checkout (../shared/data from the repository root).
DATA_ENV_VAR = "VLM_ASSETS_TEST_DATA"
DEFAULT_SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real sample data directory; the test is skipped (saying how to enable it) without one."""
    data = Path(os.environ[DATA_ENV_VAR]) if os.environ.get(DATA_ENV_VAR) else DEFAULT_SHARED_DATA
    if not data.is_dir():
        pytest.skip(f"real sample data not found at {data}: set ${DATA_ENV_VAR} to its directory "
                    f"(or put it at {DEFAULT_SHARED_DATA}) to run this test")
    return data


@pytest.fixture(scope="session")
def real_file(shared_data: Path) -> Callable[[str], Path]:
    """`real_file("decord/…/corrupted.mp4")`: that file of the real data; a missing one fails the test."""

    def find(relative: str) -> Path:
        path = shared_data / relative
        if not path.is_file():
            pytest.fail(f"{path} is missing from the real sample data at {shared_data}")
        return path

    return find


@pytest.fixture(scope="session")
def demo_config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo dataset, written once per test session (read-only for tests)."""
    return write_demo(tmp_path_factory.mktemp("demo"))


@dataclass(frozen=True)
class ReferenceRun:
    """The demo graph built once by `vlm-assets run --workers 2` on its own site and instance."""

    config: Path
    home: Path
    root: Path
    outputs: dict[str, str]  # sha256 of every output file by path relative to `root`
    result: subprocess.CompletedProcess


def session_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder every pytest-xdist worker of this test session shares (the session's own without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextmanager
def session_lock(tmp_path_factory: pytest.TempPathFactory, name: str) -> Iterator[Path]:
    """Hold the session-wide lock `name`: what one worker builds under it, the others then reuse."""
    path = session_dir(tmp_path_factory) / f"{name}.lock"
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield path
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def reference_run(demo_config_path: Path, tmp_path_factory: pytest.TempPathFactory) -> ReferenceRun:
    """The one full-graph run of a test session, shared by every test that needs the whole graph
    built (read-only), on whichever pytest-xdist worker asks first."""
    from vlm_assets_tests.run_support import run, site_config, snapshot

    site = session_dir(tmp_path_factory) / "reference"
    record = site / "run.json"
    with session_lock(tmp_path_factory, "reference"):
        if not record.exists():
            config = site_config(demo_config_path, site)
            result = run(config, site / "home", "--workers", "2")
            record.write_text(json.dumps({"config": str(config), "returncode": result.returncode, "stdout": result.stdout,
                                          "outputs": snapshot(site / "vlm_data") if result.returncode == 0 else {}}))
    built = json.loads(record.read_text())
    assert built["returncode"] == 0, built["stdout"][-4000:]
    result = subprocess.CompletedProcess(["vlm-assets", "run"], built["returncode"], built["stdout"], "")
    return ReferenceRun(Path(built["config"]), site / "home", site / "vlm_data", built["outputs"], result)


# A folder the offline family processors are kept in across test sessions: scripts/test.sh names one,
# so the session under the oldest transformers loads the directories the session before it wrote,
# as a trainer loads a processor directory saved by another transformers release.
FAMILY_CACHE_ENV_VAR = "VLM_ASSETS_TEST_FAMILY_CACHE"


@pytest.fixture(scope="session")
def family_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the offline processors of the nine families (processor_families.py) are built, once per
    test session (or once for the sessions sharing $VLM_ASSETS_TEST_FAMILY_CACHE) for every module and
    pytest-xdist worker (the build is process-safe)."""
    shared = os.environ.get(FAMILY_CACHE_ENV_VAR)
    return Path(shared) if shared else session_dir(tmp_path_factory) / "families"


@pytest.fixture(scope="session")
def demo_app(demo_config_path: Path) -> AppConfig:
    return load_config(demo_config_path)


@pytest.fixture(scope="session")
def processor():
    from vlm_assets.config import ModelConfig
    from vlm_assets.tokens.processor import load_processor

    return load_processor(ModelConfig(processor_kwargs={"min_pixels": 3136, "max_pixels": 1003520}))


# Under pytest-xdist (plain `pytest` and `scripts/test.sh` run two workers), tests go to workers a
# whole module at a time (`--dist loadfile`), so a module's fixtures are built once. (xdist's
# `loadgroup` names its groups by a suffix on the test's node id, which pytest 9 no longer reads
# back: every test became a group of its own.) Modules start in this order, the longest of the full
# tier first (`--no-loadscope-reorder`: else xdist starts the modules with the most tests first, and
# a one-test module of two minutes ends last, alone), so the two workers end at about the same time.
LONGEST_FIRST = ("test_run_safety", "test_family_lengths", "test_object_store", "test_ray_cluster", "test_append",
                 "test_chunked_source",
                 "test_celery", "test_ui_agreement", "test_e2e_ui", "test_provenance", "test_cli_run",
                 "test_default_instance", "test_video_tokens", "test_partition_registration", "test_instance_outage",
                 "test_lengths", "test_processor_families", "test_catalog_append", "test_training_mix",
                 "test_automation", "test_run_output")


def _module(item: pytest.Item) -> str:
    return item.module.__name__.rsplit(".", 1)[-1] if item.module else item.nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {module: number for number, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item), len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    # What collecting imported (Dagster, the package, the test modules) lives as long as the process:
    # frozen, the garbage collector's passes no longer walk it.
    gc.freeze()
