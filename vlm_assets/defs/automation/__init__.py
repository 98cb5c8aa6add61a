"""Automation: the inbox, configured-source, source-files and frame-cache sensors, the follow-upstream
declarative automation and the nightly integrity schedule (docs/operations.md, "Automation: sensors and schedules")."""

import dagster as dg

from vlm_assets.defs.automation.dead_runs import dead_runs_sensor
from vlm_assets.defs.automation.follow import follow_upstream_sensor
from vlm_assets.defs.automation.integrity import integrity_jobs, integrity_schedules
from vlm_assets.defs.automation.sensors import (
    configured_sources_sensor,
    frame_cache_shards_sensor,
    inbox_sensor,
    source_files_sensor,
)

defs = dg.Definitions(
    sensors=[inbox_sensor, configured_sources_sensor, source_files_sensor, frame_cache_shards_sensor, follow_upstream_sensor,
             dead_runs_sensor],
    schedules=integrity_schedules,
    jobs=integrity_jobs,
)
