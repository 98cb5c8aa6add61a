"""Run safety with real processes: kill -9 and rerun, Ctrl-C, concurrent runs, byte-identical outputs,
unchanged reruns, a full disk. Every site reads the same demo inputs and writes its own storage root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import dagster as dg
import pytest

from vlm_assets.config import load_config
from vlm_assets.defs.automation.dead_runs import assign_stranded_steps, dead_runs_sensor
from vlm_assets.defs.resources import HEAVY_POOL
from vlm_assets.layout import StorageLayout
from vlm_assets.locks import LOCK_DIR, file_lock
from vlm_assets_tests.run_support import (
    descendants,
    differences,
    initialised_home,
    run,
    run_status,
    single_slot_instance,
    site_config,
    skip_without_mount_namespace,
    snapshot,
    start_run,
    wait_for_started_run,
)

pytestmark = pytest.mark.processes

WORKERS = ("--workers", "2")


@pytest.fixture(scope="module")
def reference(reference_run):
    """One clean run: its config and the bytes of every output. A run compared with it reads the inputs
    its config names (`site_config(reference_config, …)`): catalogues record where each sample's media is,
    and another pytest-xdist worker may have built the reference from a demo dataset of its own."""
    assert "0 failed run(s), 0 failed check(s)" in reference_run.result.stdout
    with dg.DagsterInstance.from_config(str(reference_run.home)) as instance:
        spans = sorted((record.start_time, record.end_time) for record in instance.get_run_records())
    assert any(later[0] < earlier[1] for earlier, later in zip(spans, spans[1:])), "two workers never overlapped"
    return reference_run.config, reference_run.outputs, reference_run.result


def test_clean_runs_elsewhere_give_the_same_bytes_side_by_side_and_an_unchanged_rerun_does_nothing(
        reference, tmp_path):
    reference_config, expected, first = reference
    config = site_config(reference_config, tmp_path)
    home = tmp_path / "home"
    # Two runs on one storage root at once, each on its own instance (the same file locks order them
    # as on one instance, test_concurrent_runs_on_one_instance…), one worker each.
    processes = [start_run(config, instance_home, "--workers", "1") for instance_home in (home, tmp_path / "home2")]
    for process in processes:
        output = process.communicate(timeout=600)[0]
        assert process.returncode == 0, output[-4000:]
    assert differences(expected, snapshot(tmp_path / "vlm_data")) == []

    outputs = [path for path in (tmp_path / "vlm_data").rglob("*") if path.is_file() and LOCK_DIR not in path.parts]
    mtimes = {path: path.stat().st_mtime_ns for path in outputs}
    again = run(config, home, *WORKERS)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "0 run(s), 0 materialisation(s), 30 up to date" in again.stdout
    # Nothing to run: its workers and the process they fork from (loading the processor) were stopped, not left.
    deadline = time.monotonic() + 10
    while _processes_on(home) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_on(home)
    rewritten = [str(path) for path, mtime in mtimes.items() if path.stat().st_mtime_ns != mtime]
    assert rewritten == []

    # A changed section rebuilds exactly what reads it: wds.maxcount → shards, their Energon metadata, the mix, package.
    changed = site_config(reference_config, tmp_path, wds={"maxcount": 2})
    rebuilt = run(changed, home, *WORKERS)
    assert rebuilt.returncode == 0, rebuilt.stdout[-3000:]
    launched = sorted(line.split(" ", 1)[1] for line in rebuilt.stdout.splitlines() if line.startswith("▶ "))
    assert launched == [*(f"{asset} [{source}]" for asset in ("energon_dataset", "packed_wds_shards")
                          for source in ("demo_images", "demo_video", "demo_wds")),
                        "training_mix", "training_package"]


# The killed run and its rerun build the lineage the killed step is in (`target`); their outputs
# (the files under `outputs`) must equal the reference run's.
SOURCE_LINEAGE_OUTPUTS = ("catalog/demo_images.", "lengths/demo_images.", "packing/demo_images.",
                          "packed_json/demo_images.", "packed_wds/demo_images/")


@pytest.mark.parametrize(
    ("asset", "partition", "prepare", "lock", "swept_by", "target", "outputs"),
    [
        ("sample_length_chunk", "00000|demo_images", "sample_catalog[demo_images]", "source-demo_images", "cli",
         "energon_dataset[demo_images]", SOURCE_LINEAGE_OUTPUTS),
        ("packed_wds_shards", "demo_images", "packed_json[demo_images]", "source-demo_images", "cli",
         "energon_dataset[demo_images]", SOURCE_LINEAGE_OUTPUTS),
        ("frame_cache_shard", "part-00000", "video_frame_plan", "frame_cache-384-64-part-00000", "sensor",
         "frame_cache_index", ("catalog/", "frame_cache/")),
    ],
)
def test_kill_9_in_a_step_then_a_rerun_on_the_same_instance_completes(
    reference, tmp_path, asset, partition, prepare, lock, swept_by, target, outputs
):
    reference_config, reference_outputs, _ = reference
    config = site_config(reference_config, tmp_path)
    home = tmp_path / "home"
    single_slot_instance(home)
    assert run(config, home, *WORKERS, "--select", prepare).returncode == 0
    root = load_config(config).storage_root
    # Holding the step's storage lock parks the step inside its body, pool slot taken: a
    # deterministic point to kill it at.
    with file_lock(root, lock):
        process = start_run(config, home, *WORKERS, "--select", target)
        victim = wait_for_started_run(home, asset, partition)
        time.sleep(1.0)
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate(timeout=60)
        time.sleep(2.0)  # the worker notices its CLI is gone
        assert run_status(home, victim.run_id) == dg.DagsterRunStatus.STARTED  # dead, but nobody knows yet
    if swept_by == "sensor":  # what the daemon does under `dagster dev`
        with dg.DagsterInstance.from_config(str(home)) as instance, \
                dg.build_sensor_context(instance=instance) as context:
            assert "dead run(s) failed" in str(dead_runs_sensor(context))
        assert run_status(home, victim.run_id) == dg.DagsterRunStatus.FAILURE
    rerun = run(config, home, *WORKERS, "--select", target, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-4000:]
    if swept_by == "cli":
        assert f"run {victim.run_id}: its process is gone" in rerun.stdout
    assert run_status(home, victim.run_id) == dg.DagsterRunStatus.FAILURE

    def lineage(files: dict[str, str]) -> dict[str, str]:
        return {name: digest for name, digest in files.items() if name.startswith(outputs)}

    assert lineage(reference_outputs) and differences(lineage(reference_outputs), lineage(snapshot(root))) == []


def test_ctrl_c_stops_after_the_step_in_flight_and_launches_nothing_more(demo_config_path, tmp_path):
    config = site_config(demo_config_path, tmp_path)
    home = initialised_home(tmp_path / "home")  # the test reads the instance while the run starts
    root = load_config(config).storage_root
    # One worker builds the whole graph one step at a time, the first a source's catalogue, which
    # holding that source's lock parks mid-body.
    with file_lock(root, StorageLayout.source_lock("demo_images")):
        process = start_run(config, home, "--workers", "1")
        victim = wait_for_started_run(home, "sample_catalog", "demo_images")
        process.send_signal(signal.SIGINT)
        time.sleep(1.0)
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 130, output[-3000:]
    assert "stopping after the step(s) in flight" in output
    assert run_status(home, victim.run_id) == dg.DagsterRunStatus.SUCCESS  # the step in flight finished
    lines = output.splitlines()
    stopping = next(index for index, line in enumerate(lines) if "stopping after the step(s) in flight" in line)
    launched = [line for line in lines if line.startswith("▶ ")]
    assert launched == ["▶ sample_catalog [demo_images]"]
    assert not [line for line in lines[stopping:] if line.startswith("▶ ")]
    assert not (root / "packages").exists()
    with dg.DagsterInstance.from_config(str(home)) as instance:
        assert instance.get_latest_materialization_event(dg.AssetKey("sample_lengths")) is None


def _processes_on(home: Path) -> set[int]:
    """The running processes whose environment names `home` as $DAGSTER_HOME, from /proc."""
    wanted = f"DAGSTER_HOME={home}".encode()
    found = set()
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if wanted in environ.read_bytes().split(b"\0"):
                found.add(int(environ.parent.name))
        except OSError:  # gone meanwhile, or another user's
            continue
    return _still_running(found)


def _still_running(pids: set[int]) -> set[int]:
    """Those of `pids` that still run (a zombie has stopped: it waits only to be reaped)."""
    running = set()
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            running.add(pid)
    return running


@pytest.mark.parametrize("how", ["kill -9 of the CLI alone", "Ctrl-C twice"])
def test_the_clis_workers_and_their_helpers_go_with_it(demo_config_path, tmp_path, how):
    config = site_config(demo_config_path, tmp_path)
    home = initialised_home(tmp_path / "home")  # the test reads the instance while the run starts
    root = load_config(config).storage_root
    with file_lock(root, StorageLayout.source_lock("demo_video")):  # parks that source's catalogue mid-body
        process = start_run(config, home, *WORKERS, "--select", "sample_catalog")
        wait_for_started_run(home, "sample_catalog", "demo_video")
        family = descendants(process.pid)
        assert len(family) >= 2, family  # two workers, and their steps' helpers
        if how == "Ctrl-C twice":
            process.send_signal(signal.SIGINT)
            time.sleep(0.5)
            process.send_signal(signal.SIGINT)
        else:
            process.kill()  # the CLI's pid alone, not its process group
        process.communicate(timeout=60)
        deadline = time.monotonic() + 10
        while _still_running(family) and time.monotonic() < deadline:
            time.sleep(0.2)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120] for pid in _still_running(family)}
    for pid in left:  # what a failing test leaves must not outlive it
        os.kill(pid, signal.SIGKILL)
    assert not left, f"alive 10 s after {how}: {left}"


def test_a_second_run_waits_for_the_partition_another_run_is_building_and_takes_its_result(demo_config_path, tmp_path):
    config = site_config(demo_config_path, tmp_path)
    home = initialised_home(tmp_path / "home")  # the test reads the instance while the first run starts
    target = ("--select", "sample_catalog[demo_images]")
    root = load_config(config).storage_root
    with file_lock(root, StorageLayout.source_lock("demo_images")):  # parks the first run's step mid-body
        first = start_run(config, home, *WORKERS, *target)
        building = wait_for_started_run(home, "sample_catalog", "demo_images")
        second = start_run(config, home, *WORKERS, *target)
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(second.stdout), daemon=True)
        reader.start()
        waiting = f"sample_catalog [demo_images]: being built by run {building.run_id[:8]}"
        deadline = time.monotonic() + 120
        while not any(waiting in line for line in lines) and second.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any(waiting in line for line in lines), "".join(lines)[-3000:]
    first_output = first.communicate(timeout=300)[0]
    second.wait(300)
    reader.join(30)
    outputs = [first_output, "".join(lines)]
    assert [first.returncode, second.returncode] == [0, 0], outputs[1][-3000:]
    assert "▶ sample_catalog [demo_images]" not in outputs[1]
    assert "= sample_catalog [demo_images]: up to date" in outputs[1]
    with dg.DagsterInstance.from_config(str(home)) as instance:
        runs = instance.get_runs(filters=dg.RunsFilter(tags={"dagster/partition": "demo_images"}))
    assert [run.run_id for run in runs if run.tags.get("vlm_assets/asset") == "sample_catalog"] == [building.run_id]


def test_an_output_deleted_or_cut_short_on_disk_is_rebuilt_with_what_energon_needs(demo_config_path, tmp_path):
    from vlm_assets.packing.energon_loader import load_all_ids

    config = site_config(demo_config_path, tmp_path)
    home = tmp_path / "home"
    lineage = ("--select", "energon_dataset[demo_images]")
    assert run(config, home, *WORKERS, *lineage).returncode == 0
    layout = StorageLayout(load_config(config).storage_root)
    shard = layout.packed_wds("demo_images") / "pretrain-000000.tar"
    index = Path(f"{shard}.idx")
    expected_ids = load_all_ids(layout.packed_wds("demo_images"))

    def plan() -> str:
        result = run(config, home, "--plan", *lineage)
        assert result.returncode == 0, result.stdout[-3000:]
        return result.stdout

    def rebuilt() -> None:
        again = run(config, home, *WORKERS, *lineage)
        assert again.returncode == 0, again.stdout[-3000:]
        assert load_all_ids(layout.packed_wds("demo_images")) == expected_ids

    shard.unlink()
    shown = plan()
    assert "   missing  packed_wds_shards [demo_images]" in shown and f"↳ {shard} is missing" in shown
    assert "   missing  energon_dataset [demo_images]" in shown
    rebuilt()

    # --force builds the selection and everything it reads again: none of it is taken as up to date.
    forced = run(config, home, *WORKERS, "--force", "--select", "packed_wds_shards[demo_images]")
    assert forced.returncode == 0 and " 0 up to date" in forced.stdout, forced.stdout[-3000:]
    if not index.exists():  # the rewritten shards' Energon index goes with them: energon_dataset is missing
        assert f"↳ {index} is missing (Energon's index)" in plan()
    rebuilt()

    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    assert "are cut short" in plan()
    lengths = layout.lengths("demo_images")
    with open(lengths, "r+b") as handle:
        handle.truncate(lengths.stat().st_size - 10)
    assert f"↳ {lengths} is cut short (no Parquet footer)" in plan()
    rebuilt()  # both at once
    shown = plan()  # each rebuild left nothing behind that a later run would take for missing or stale
    assert "0 of" in shown, [line for line in shown.splitlines() if "up to date" not in line]


def test_concurrent_runs_on_one_instance_never_fail_and_write_the_same_bytes(reference, tmp_path):
    reference_config, expected, _ = reference
    config = site_config(reference_config, tmp_path)
    home = tmp_path / "home"
    # Both build the whole graph, then both force a rebuild of one source's lineage over the outputs there.
    forced = ("--force", "--select", "energon_dataset[demo_video]")
    for attempt in range(2):
        processes = [start_run(config, home, "--workers", "1", *(forced if attempt else ())) for _ in range(2)]
        outputs = [process.communicate(timeout=600)[0] for process in processes]
        for process, output in zip(processes, outputs):
            assert process.returncode == 0, output[-4000:]
        assert differences(expected, snapshot(load_config(config).storage_root)) == []


def test_readers_never_see_energon_metadata_being_rewritten(demo_config_path, tmp_path):
    """Energon's loader, run over and over while forced runs re-prepare the metadata, always loads every sample."""
    from vlm_assets.packing.energon_loader import load_all_ids

    config = site_config(demo_config_path, tmp_path)
    home = tmp_path / "home"
    # The reader loads demo_images' dataset: that source's lineage is what the forced run rebuilds.
    lineage = "energon_dataset[demo_images]"
    assert run(config, home, *WORKERS, "--select", lineage).returncode == 0
    root = load_config(config).storage_root / "packed_wds" / "demo_images"
    expected_ids = sorted(load_all_ids(root))
    failures, loads, stop = [], [], threading.Event()

    def keep_loading() -> None:
        while not stop.is_set():
            try:
                assert sorted(load_all_ids(root)) == expected_ids
                loads.append(time.monotonic())
            except Exception as error:  # noqa: BLE001 — any failure of a reader is the finding
                failures.append(repr(error))

    reader = threading.Thread(target=keep_loading)
    reader.start()
    try:
        result = run(config, home, *WORKERS, "--select", lineage, "--force")  # rewrites shards and metadata
        assert result.returncode == 0, result.stdout[-3000:]
    finally:
        stop.set()
        reader.join()
    assert failures == [] and len(loads) >= 3, (failures, len(loads))


def test_a_full_disk_is_named_in_one_line(demo_config_path, tmp_path):
    skip_without_mount_namespace()
    site = tmp_path / "site"
    config = site_config(demo_config_path, site)
    (site / "vlm_data").mkdir()
    home = tmp_path / "home"
    home.mkdir()
    cli = [sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--workers", "1"]
    command = f"mount -t tmpfs -o size=400k tmpfs {site / 'vlm_data'} && exec {subprocess.list2cmdline(cli)}"
    result = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
        capture_output=True, text=True, timeout=600, env={**os.environ, "DAGSTER_HOME": str(home)},
    )
    assert result.returncode != 0
    failed = [line for line in result.stdout.splitlines() if "failed:" in line and "No space left on device" in line]
    assert failed, result.stdout[-4000:] + result.stderr[-2000:]
    assert str(site / "vlm_data") in failed[0] and "full log: " in failed[0]
    log = Path(failed[0].rsplit("full log: ", 1)[1])
    assert log.is_file() and "Stack Trace" in log.read_text()
    assert "did every source reject" not in result.stdout + result.stderr


def test_a_storage_root_that_is_a_file_is_a_config_error(demo_config_path, tmp_path):
    site = tmp_path / "site"
    config = site_config(demo_config_path, site)
    (site / "vlm_data").write_text("not a directory")
    result = run(config, tmp_path / "home")
    assert result.returncode == 2
    assert f"storage.root is not a directory: {site / 'vlm_data'}" in result.stdout


def test_a_read_only_storage_root_is_named_in_one_line(demo_config_path, tmp_path):
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True) \
        if shutil.which("unshare") else None
    if probe is None or probe.returncode != 0:
        pytest.skip("needs unshare to mount a read-only bind mount")
    site = tmp_path / "site"
    config = site_config(demo_config_path, site)
    root = site / "vlm_data"
    root.mkdir()
    cli = [sys.executable, "-m", "vlm_assets.cli", "run", "--config", str(config), "--workers", "1"]
    command = (f"mount --bind {root} {root} && mount -o remount,bind,ro {root} && "
               f"exec {subprocess.list2cmdline(cli)}")
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", command],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DAGSTER_HOME": str(tmp_path / "home")})
    assert result.returncode == 1
    assert f"error: Read-only file system: {StorageLayout(root).owner}" in result.stderr


def test_a_step_that_missed_a_freed_pool_slot_gets_it(tmp_path):
    """The race seen in CI: the slot's holder frees it just after a second step saw it taken and
    just before that step queued, so nobody hands it the slot. The runner's sweep does."""
    single_slot_instance(tmp_path)
    with dg.DagsterInstance.from_config(str(tmp_path)) as instance:
        storage = instance.event_log_storage
        storage.initialize_concurrency_limit_to_default(HEAVY_POOL)
        assert storage.claim_concurrency_slot(HEAVY_POOL, "holder", "step").is_claimed
        assert not storage.has_unassigned_slots(HEAVY_POOL)  # what the asker sees
        storage.free_concurrency_slots_for_run("holder")  # no step queued yet: nothing to hand over
        storage.add_pending_step(HEAVY_POOL, "asker", "step", should_assign=False)  # the asker queues
        assert not storage.claim_concurrency_slot(HEAVY_POOL, "asker", "step").is_claimed  # and would wait for ever
        storage.add_pending_step(HEAVY_POOL, "third", "step", should_assign=False)

        assert assign_stranded_steps(instance, [HEAVY_POOL]) == 1  # one slot: only the first in the queue
        assert storage.claim_concurrency_slot(HEAVY_POOL, "asker", "step").is_claimed
        assert assign_stranded_steps(instance, [HEAVY_POOL]) == 0  # the slot is taken again
        assert not storage.claim_concurrency_slot(HEAVY_POOL, "third", "step").is_claimed
