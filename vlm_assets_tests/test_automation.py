"""Sensors and schedules of vlm_assets.defs.automation, evaluated on a real (temporary) instance."""

from __future__ import annotations

import json
import os
import shutil
from datetime import datetime, timezone

import dagster as dg
import pytest

from vlm_assets.defs.automation.follow import follow_upstream_sensor
from vlm_assets.defs.automation.inbox_watch import InboxCursor, decide
from vlm_assets.defs.automation.integrity import integrity_schedules
from vlm_assets.defs.automation.sensors import configured_sources_sensor, frame_cache_shards_sensor, inbox_sensor
from vlm_assets.defs.resources import FRAME_CACHE_SHARD_PARTITIONS, SOURCES_PARTITIONS
from vlm_assets.inbox import READY_MARKER, discover_inbox
from vlm_assets.definitions import build_definitions
from vlm_assets_tests.automation_support import (
    drop_flat_source,
    drop_video_source,
    write_inbox_config,
)

PACKING_LINEAGE = ["energon_dataset", "packed_json", "packed_wds_shards", "packing_bins", "sample_catalog", "sample_lengths"]


@pytest.fixture
def instance():
    with dg.instance_for_test() as instance:
        yield instance


@pytest.fixture(scope="module")
def inbox_setup(tmp_path_factory):
    config = write_inbox_config(tmp_path_factory.mktemp("inbox_site"))
    return config, build_definitions(config)


def tick(sensor, instance, defs, cursor=None):
    """One sensor evaluation, applying its dynamic-partition requests as the daemon does."""
    with dg.build_sensor_context(instance_ref=instance.get_ref(), cursor=cursor, definitions=defs, resources=defs.resources) as context:
        result = sensor.evaluate_tick(context)
    for request in result.dynamic_partitions_requests or []:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    return result


# -- the decision alone ---------------------------------------------------------------------------


def test_new_entry_waits_one_tick_then_launches_once(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    drop_flat_source(demo_config_path.parent, inbox)
    first = decide(discover_inbox(inbox), InboxCursor(), set(), require_ready_marker=False)
    assert first.ready == [] and "inbox-photos" in first.not_ready
    second = decide(discover_inbox(inbox), first.cursor, set(), require_ready_marker=False)
    assert [entry.source.name for entry in second.ready] == ["inbox-photos"]
    assert second.cursor.waiting == {}
    third = decide(discover_inbox(inbox), second.cursor, {"inbox-photos"}, require_ready_marker=False)
    assert third.ready == [] and third.not_ready == {}


def test_entry_still_being_copied_waits_until_unchanged(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = decide(discover_inbox(inbox), InboxCursor(), set(), False).cursor
    (source / "late.json").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}))
    copying = decide(discover_inbox(inbox), cursor, set(), False)
    assert copying.ready == []
    settled = decide(discover_inbox(inbox), copying.cursor, set(), False)
    assert [entry.source.name for entry in settled.ready] == ["inbox-photos"]


def test_ready_marker_is_required_when_configured(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = InboxCursor()
    for _ in range(3):
        decision = decide(discover_inbox(inbox), cursor, set(), require_ready_marker=True)
        assert decision.ready == [] and READY_MARKER in decision.not_ready["inbox-photos"]
        cursor = decision.cursor
    (source / READY_MARKER).touch()
    cursor = decide(discover_inbox(inbox), cursor, set(), True).cursor  # the marker itself is a change
    assert [entry.source.name for entry in decide(discover_inbox(inbox), cursor, set(), True).ready] == ["inbox-photos"]


def test_cursor_stays_small_as_sources_accumulate(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    cursor, registered, sizes = InboxCursor(), set(), []
    for index in range(12):
        drop_flat_source(demo_config_path.parent, inbox, name=f"batch{index:02d}")
        for _ in range(2):
            decision = decide(discover_inbox(inbox), cursor, registered, False)
            registered |= {entry.source.name for entry in decision.ready}
            cursor = decision.cursor
        sizes.append(len(cursor.to_json()))
    assert len(registered) == 12
    assert max(sizes) == min(sizes) < 80, sizes


def test_touching_a_launched_entry_makes_it_new_data(demo_config_path, tmp_path):
    inbox = tmp_path / "inbox"
    source = drop_flat_source(demo_config_path.parent, inbox)
    cursor = decide(discover_inbox(inbox), InboxCursor(), set(), False).cursor
    cursor = decide(discover_inbox(inbox), cursor, set(), False).cursor
    later = cursor.mark + 10
    os.utime(source / "0001.json", (later, later))
    cursor = decide(discover_inbox(inbox), cursor, {"inbox-photos"}, False).cursor
    assert [e.source.name for e in decide(discover_inbox(inbox), cursor, {"inbox-photos"}, False).ready] == ["inbox-photos"]


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
    assert len(second.cursor) < 80
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
