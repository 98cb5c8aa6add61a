"""Sensors and schedules of vlm_assets.defs.automation, evaluated on a real (temporary) instance."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone

import dagster as dg
import pytest

from vlm_assets.defs.automation.follow import follow_upstream_sensor
from vlm_assets.defs.automation.inbox_watch import InboxCursor, RunOutcome, RunState, decide
from vlm_assets.defs.automation.integrity import integrity_schedules
from vlm_assets.defs.automation.sensors import (
    configured_sources_sensor,
    frame_cache_shards_sensor,
    inbox_sensor,
    source_files_sensor,
)
from vlm_assets.defs.catalog.source_files import SOURCE_FILES
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS
from vlm_assets.inbox import READY_MARKER, discover_inbox
from vlm_assets.definitions import build_definitions
from vlm_assets_tests.automation_support import (
    drop_flat_source,
    drop_video_source,
    tick,
    write_inbox_config,
)

PACKING_LINEAGE = ["energon_dataset", "packed_json", "packed_wds_shards", "packing_bins", "sample_catalog", "sample_dedup",
                   "sample_lengths"]


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


@pytest.fixture(scope="module")
def inbox_setup(tmp_path_factory):
    config = write_inbox_config(tmp_path_factory.mktemp("inbox_site"))
    return config, build_definitions(config)


def launch(defs, instance, request) -> bool:
    """Execute a sensor's run request in this process, as the daemon would launch it; whether it succeeded."""
    return dg.materialize(
        list(defs.assets) + list(defs.asset_checks or []), selection=request.asset_selection,
        partition_key=request.partition_key, tags=request.tags, instance=instance, resources=defs.resources,
        raise_on_error=False,
    ).success


# -- the decision alone ---------------------------------------------------------------------------


def no_runs(name):
    return None


def decide_now(inbox, cursor, registered=frozenset(), require_ready_marker=False, latest_run=no_runs):
    return decide(discover_inbox(inbox), cursor, set(registered), require_ready_marker, latest_run, interval_s=30)


def test_new_entry_waits_one_tick_then_launches_once(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    drop_flat_source(demo_config_path.parent, inbox)
    first = decide_now(inbox, InboxCursor())
    assert first.launches == [] and "inbox-photos" in first.waiting
    second = decide_now(inbox, first.cursor)
    assert [(launch.entry.source.name, launch.attempt) for launch in second.launches] == [("inbox-photos", 1)]
    third = decide_now(inbox, second.cursor, {"inbox-photos"})
    assert third.launches == [] and "has not started yet" in third.waiting["inbox-photos"]


def test_entry_still_being_copied_waits_until_unchanged(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = decide_now(inbox, InboxCursor()).cursor
    (source / "late.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    copying = decide_now(inbox, cursor)
    assert copying.launches == []
    settled = decide_now(inbox, copying.cursor)
    assert [launch.entry.source.name for launch in settled.launches] == ["inbox-photos"]


def test_ready_marker_is_required_when_configured(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = InboxCursor()
    for _ in range(3):
        decision = decide_now(inbox, cursor, require_ready_marker=True)
        assert decision.launches == [] and READY_MARKER in decision.waiting["inbox-photos"]
        cursor = decision.cursor
    (source / READY_MARKER).touch()
    cursor = decide_now(inbox, cursor, require_ready_marker=True).cursor  # the marker itself is a change
    assert [launch.entry.source.name for launch in decide_now(inbox, cursor, require_ready_marker=True).launches] == ["inbox-photos"]


def test_running_entry_is_not_relaunched_and_changed_built_entry_is_new_data(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = decide_now(inbox, decide_now(inbox, InboxCursor()).cursor).cursor  # launched: attempt 1
    key = cursor.entries["inbox-photos"].fingerprint

    def latest(state):
        return lambda name: RunOutcome("run-1", key, 1, state)

    for _ in range(3):
        running = decide_now(inbox, cursor, {"inbox-photos"}, latest_run=latest(RunState.IN_PROGRESS))
        assert running.launches == [] and "run-1 (attempt 1) in progress" in running.waiting["inbox-photos"]
        cursor = running.cursor
    built = decide_now(inbox, cursor, {"inbox-photos"}, latest_run=latest(RunState.SUCCEEDED))
    assert built.built == ["inbox-photos"] and built.launches == [] and built.cursor.entries["inbox-photos"].done
    later = max(path.stat().st_mtime for path in source.iterdir()) + 10
    os.utime(source / "0001.json", (later, later))  # touching a file of a built entry makes it new data
    changed = decide_now(inbox, built.cursor, {"inbox-photos"}, latest_run=latest(RunState.SUCCEEDED))
    assert changed.launches == [] and "still changing" in changed.waiting["inbox-photos"]
    [again] = decide_now(inbox, changed.cursor, {"inbox-photos"}, latest_run=latest(RunState.SUCCEEDED)).launches
    assert again.attempt == 1 and again.run_key != f"inbox-photos@{key}"


def test_cursor_of_an_earlier_version_keeps_its_launched_entries_done(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    drop_flat_source(demo_config_path.parent, inbox)
    newest = discover_inbox(inbox)[0].fingerprint[2]
    legacy = InboxCursor.from_json(json.dumps({"mark": newest, "waiting": {}}))
    decision = decide_now(inbox, legacy, {"inbox-photos"})
    assert decision.launches == [] and decision.waiting == {} and decision.cursor.entries["inbox-photos"].done
    assert "mark" not in decision.cursor.to_json()


# -- the sensors on a real instance --------------------------------------------------------------


def test_inbox_sensor_adds_partition_and_requests_packing_lineage_once(inbox_setup, instance, demo_config_path):
    config, defs = inbox_setup
    inbox = config.parent / "inbox"
    shutil.rmtree(inbox)
    inbox.mkdir()
    drop_flat_source(demo_config_path.parent, inbox)
    drop_video_source(demo_config_path.parent, inbox)

    first = tick(inbox_sensor, instance, defs)
    assert first.run_requests == [] and first.skip_message
    second = tick(inbox_sensor, instance, defs, first.cursor)
    assert set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)) == {"inbox-clips", "inbox-photos"}
    assert sorted(request.partition_key for request in second.run_requests) == ["inbox-clips", "inbox-photos"]
    for request in second.run_requests:
        assert sorted(key.to_user_string() for key in request.asset_selection) == PACKING_LINEAGE
        assert request.run_key.startswith(request.partition_key + "@")
    assert len(second.cursor) < 2 * 100
    again = tick(inbox_sensor, instance, defs, second.cursor)
    assert again.run_requests == []
    replay = tick(inbox_sensor, instance, defs, first.cursor)  # a lost cursor: same run keys, so no duplicate runs
    assert {r.run_key for r in replay.run_requests} <= {r.run_key for r in second.run_requests}


def test_inbox_sensor_waits_for_ready_marker(tmp_path, instance, demo_config_path):
    config = write_inbox_config(tmp_path / "site", require_ready_marker=True)
    defs = build_definitions(config)
    source = drop_flat_source(demo_config_path.parent, config.parent / "inbox")
    cursor = None
    for _ in range(3):
        result = tick(inbox_sensor, instance, defs, cursor)
        assert result.run_requests == []
        cursor = result.cursor
    assert instance.get_dynamic_partitions(SOURCES_PARTITIONS.name) == []
    (source / READY_MARKER).touch()
    cursor = tick(inbox_sensor, instance, defs, cursor).cursor
    assert [r.partition_key for r in tick(inbox_sensor, instance, defs, cursor).run_requests] == ["inbox-photos"]


def fail_while_entry_is_away(defs, instance, request, entry, stash):
    """The entry vanishes mid-run (the catalogue step fails), then comes back unchanged (same files and mtimes)."""
    entry.rename(stash)
    assert not launch(defs, instance, request)
    stash.rename(entry)


def test_failed_entry_is_retried_with_backoff_and_a_built_one_is_not_relaunched(tmp_path, instance, demo_config_path):
    config = write_inbox_config(tmp_path / "site")
    defs = build_definitions(config)
    entry = drop_flat_source(demo_config_path.parent, config.parent / "inbox")
    first = tick(inbox_sensor, instance, defs)
    launched = tick(inbox_sensor, instance, defs, first.cursor)
    [request] = launched.run_requests
    fail_while_entry_is_away(defs, instance, request, entry, tmp_path / "away")
    [failed_run] = instance.get_runs()

    noticed = tick(inbox_sensor, instance, defs, launched.cursor)
    assert noticed.run_requests == []
    assert noticed.skip_message.startswith(f"inbox-photos: run {failed_run.run_id} failed (sample_catalog: ")
    assert "no source named 'inbox-photos'" in noticed.skip_message and "retry 2 in ~30 s" in noticed.skip_message
    retrying = tick(inbox_sensor, instance, defs, noticed.cursor)  # after one tick of back-off
    [retry] = retrying.run_requests
    assert retry.run_key == request.run_key + "#2" and retry.tags["vlm_assets/inbox_attempt"] == "2"
    assert instance.get_dynamic_partitions(SOURCES_PARTITIONS.name) == ["inbox-photos"]

    fail_while_entry_is_away(defs, instance, retry, entry, tmp_path / "away")
    cursor, messages = retrying.cursor, []
    for _ in range(2):  # the second failure sits out two ticks
        waiting = tick(inbox_sensor, instance, defs, cursor)
        assert waiting.run_requests == []
        messages.append(waiting.skip_message)
        cursor = waiting.cursor
    assert "retry 3 in ~60 s" in messages[0] and "retry 3 in ~30 s" in messages[1], messages
    third_tick = tick(inbox_sensor, instance, defs, cursor)
    [third] = third_tick.run_requests
    assert third.run_key == request.run_key + "#3"

    assert launch(defs, instance, third)  # the fault has cleared
    built = tick(inbox_sensor, instance, defs, third_tick.cursor)
    assert built.run_requests == [] and built.skip_message.startswith("no new finished sources")
    for _ in range(3):
        built = tick(inbox_sensor, instance, defs, built.cursor)
        assert built.run_requests == []
    assert json.loads(built.cursor)["entries"]["inbox-photos"]["done"] is True


def test_gone_or_failed_inbox_sources_do_not_hold_back_training_mix(tmp_path, instance, demo_config_path):
    config = write_inbox_config(tmp_path / "site")
    defs = build_definitions(config)
    inbox = config.parent / "inbox"
    entries = {name: drop_flat_source(demo_config_path.parent, inbox, name=name) for name in ("photos", "broken", "gone")}
    follow = follow_upstream_sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))
    launched = tick(inbox_sensor, instance, defs, tick(inbox_sensor, instance, defs).cursor)
    requests = {request.partition_key: request for request in launched.run_requests}
    assert launch(defs, instance, requests["inbox-photos"])
    fail_while_entry_is_away(defs, instance, requests["inbox-broken"], entries["broken"], tmp_path / "away")
    shutil.rmtree(entries["gone"])  # registered, deleted before its run started

    def mix_requested(follow):
        return any(dg.AssetKey("training_mix") in request.asset_selection for request in follow.run_requests)

    follow = follow_upstream_sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=follow.cursor, definitions=defs))
    assert not mix_requested(follow)  # inbox-gone's energon_dataset is missing and not failed: the mix waits

    swept = tick(inbox_sensor, instance, defs, launched.cursor)
    assert set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)) == {"inbox-photos", "inbox-broken"}
    assert "inbox-gone: entry gone, unregistered" in swept.skip_message
    assert "inbox-broken: run " in swept.skip_message and "retry 2 in" in swept.skip_message
    follow = follow_upstream_sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=follow.cursor, definitions=defs))
    assert mix_requested(follow)  # the failed source no longer holds it back either
    # ... and the mix is built without it while it waits for its retry, saying so.
    mix = dg.materialize(list(defs.assets) + list(defs.asset_checks or []), selection=["training_mix"],
                         instance=instance, resources=defs.resources)
    [materialization] = mix.asset_materializations_for_node("training_mix")
    assert materialization.metadata["sources"].value == 1
    assert "no Energon dataset yet" in materialization.metadata["left_out"].value["inbox-broken"]

    shutil.rmtree(entries["broken"])
    tick(inbox_sensor, instance, defs, swept.cursor)
    assert instance.get_dynamic_partitions(SOURCES_PARTITIONS.name) == ["inbox-photos"]


def test_inbox_cursor_is_bounded_by_the_entries_present(tmp_path, instance, demo_config_path):
    config = write_inbox_config(tmp_path / "site")
    defs = build_definitions(config)
    inbox = config.parent / "inbox"
    cursor, sizes = None, []
    for index in range(12):
        drop_flat_source(demo_config_path.parent, inbox, name=f"batch{index:02d}")
        for _ in range(2):
            cursor = tick(inbox_sensor, instance, defs, cursor).cursor
        sizes.append(len(cursor))
    assert len(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)) == 12
    assert all(size <= 100 * (index + 1) for index, size in enumerate(sizes)), sizes
    for index in range(12):
        shutil.rmtree(inbox / f"batch{index:02d}")
    drained = tick(inbox_sensor, instance, defs, cursor)
    assert instance.get_dynamic_partitions(SOURCES_PARTITIONS.name) == []
    assert json.loads(drained.cursor) == {"entries": {}}


def test_source_files_sensor_observes_a_source_whose_files_changed(tmp_path, instance):
    config = write_inbox_config(tmp_path / "site")
    manifest = tmp_path / "site" / "notes.jsonl"
    manifest.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n')
    config.write_text(config.read_text() + "sources:\n  - {name: notes, kind: jsonl, path: ./notes.jsonl}\n")
    defs = build_definitions(config)
    assert tick(source_files_sensor, instance, defs).skip_message  # not registered yet: nothing to observe
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["notes"])

    def observed() -> list[str]:
        records = instance.fetch_observations(dg.AssetRecordsFilter(asset_key=SOURCE_FILES, asset_partitions=["notes"]), limit=10).records
        return [record.asset_observation.data_version for record in records]

    assert len(tick(source_files_sensor, instance, defs).asset_events) == 1
    first = observed()
    assert len(first) == 1 and first[0]
    assert tick(source_files_sensor, instance, defs).skip_message  # unchanged: no new observation
    assert observed() == first
    with manifest.open("a") as handle:
        handle.write('{"messages": [{"role": "user", "content": "again"}, {"role": "assistant", "content": "yes"}]}\n')
    tick(source_files_sensor, instance, defs)
    assert len(observed()) == 2 and observed()[0] != first[0]


def test_configured_sources_sensor_registers_partitions_without_runs(instance, demo_config_path):
    defs = build_definitions(demo_config_path)
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["demo_images"])
    result = tick(configured_sources_sensor, instance, defs)
    assert result.run_requests == []
    assert set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name)) == {"demo_images", "demo_video", "demo_wds"}
    assert tick(configured_sources_sensor, instance, defs).skip_message


# -- new videos: plan -> shards -> index; and the nightly checks ----------------------------------


def _materialize(defs, instance, selection, partition_key=None):
    result = dg.materialize(
        list(defs.assets) + list(defs.asset_checks or []), selection=selection, partition_key=partition_key,
        instance=instance, resources=defs.resources, raise_on_error=False,
    )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    return result


def test_new_videos_flow_and_nightly_integrity(tmp_path, instance, demo_config_path):
    site = tmp_path / "site"
    drop_video_source(demo_config_path.parent, site, name="clips")
    defs = build_definitions(write_inbox_config(site, video_sources=("clips",)))
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["clips"])
    follow_cursor = follow_upstream_sensor.evaluate_tick(
        dg.build_sensor_context(instance=instance, definitions=defs)).cursor
    assert tick(frame_cache_shards_sensor, instance, defs).skip_message  # no plan yet

    _materialize(defs, instance, ["sample_catalog"], "clips")
    _materialize(defs, instance, ["sample_lengths"], "clips")  # the plan takes the videos the lengths accept
    follow = follow_upstream_sensor.evaluate_tick(dg.build_sensor_context(instance=instance, cursor=follow_cursor, definitions=defs))
    followers = {key.to_user_string() for request in follow.run_requests for key in request.asset_selection}
    assert "video_frame_plan" in followers and "energon_dataset" not in followers
    assert "frame_cache_index" not in followers  # it waits for the shards the new plan will add

    _materialize(defs, instance, ["video_frame_plan"])
    shards = tick(frame_cache_shards_sensor, instance, defs)
    planned = sorted(instance.get_dynamic_partitions(FRAME_CACHE_SHARD_PARTITIONS.name))
    assert len(planned) >= 2 and sorted(r.partition_key for r in shards.run_requests) == planned
    assert all([k.to_user_string() for k in r.asset_selection] == ["frame_cache_shard"] for r in shards.run_requests)
    assert tick(frame_cache_shards_sensor, instance, defs, shards.cursor).skip_message  # this plan is handled
    _materialize(defs, instance, ["frame_cache_shard"], planned[0])

    # More videos grow the plan: only shards not built for the new plan get runs.
    drop_video_source(demo_config_path.parent, site, name="more_clips")
    defs = build_definitions(write_inbox_config(site, video_sources=("clips", "more_clips")))
    instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, ["more_clips"])
    _materialize(defs, instance, ["sample_catalog"], "more_clips")
    _materialize(defs, instance, ["sample_lengths"], "more_clips")
    _materialize(defs, instance, ["video_frame_plan"])
    grown = tick(frame_cache_shards_sensor, instance, defs, shards.cursor)
    requested = sorted(r.partition_key for r in grown.run_requests)
    assert planned[0] not in requested
    assert set(requested) >= set(instance.get_dynamic_partitions(FRAME_CACHE_SHARD_PARTITIONS.name)) - set(planned)

    night = datetime(2026, 1, 2, 3, 0, tzinfo=timezone.utc)
    schedules = {schedule.name: schedule for schedule in integrity_schedules}
    context = dg.build_schedule_context(instance=instance, scheduled_execution_time=night, repository_def=defs.get_repository_def())
    shard_checks = schedules["nightly_integrity_frame_cache_shards"].evaluate_tick(context)
    assert [r.tags["dagster/partition"] for r in shard_checks.run_requests] == [planned[0]]
    [request] = shard_checks.run_requests
    assert request.asset_selection == [] and [k.name for k in request.asset_check_keys] == ["frame_cache_shard_matches_record"]
    assert schedules["nightly_integrity"].evaluate_tick(context).skip_message  # no unpartitioned asset yet
    job = defs.resolve_job_def(request.job_name or "integrity_checks_frame_cache_shards")
    result = job.execute_in_process(instance=instance, tags=request.tags, resources=defs.resources)
    evaluations = result.get_asset_check_evaluations()
    assert [(e.partition, e.passed) for e in evaluations] == [(planned[0], True)]


def test_inbox_entries_whose_names_sanitise_alike_stay_distinct_sources(tmp_path):
    inbox = tmp_path / "inbox"
    for name in ("set a", "set_a", "set-a!"):
        (inbox / name).mkdir(parents=True)
        (inbox / name / "0.json").write_text(json.dumps({"messages": [{"role": "user", "content": name}]}))
    (inbox / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (inbox / "chat").mkdir()  # the jsonl's media directory, not an entry of its own
    (inbox / "chat" / "notes.json").write_text("{}")
    sources = {entry.source.name: entry.source for entry in discover_inbox(inbox)}
    assert len(sources) == 4
    assert sources["inbox-set_a"].path == inbox / "set_a"
    assert {source.path.name for source in sources.values()} == {"set a", "set_a", "set-a!", "chat.jsonl"}
    assert sources["inbox-chat"].kind == "jsonl"
