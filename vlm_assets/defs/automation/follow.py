"""Declarative automation: the aggregate assets rebuild themselves after their inputs change.

`energon_dataset` (a source's, after its shards), `training_mix` (over every source's dataset),
`video_frame_plan` (over every catalogue) and `frame_cache_index` (over every shard) run once any dependency was updated since they were last
requested, when no dependency is missing or still running. They never run merely because they
are missing, so an empty instance stays quiet until data arrives.
"""

from __future__ import annotations

import warnings

import dagster as dg

from vlm_assets.defs.automation.sensors import SENSOR_INTERVAL_S
from vlm_assets.defs.tags import LAUNCHED_BY_TAG

# Every asset with an automation condition (those without one are not evaluated): an asset joins the
# followers by carrying FOLLOWS_UPSTREAM where it is defined, with no name kept here.
FOLLOWERS = dg.AssetSelection.all()


with warnings.catch_warnings():
    warnings.simplefilter("ignore", dg.BetaWarning)  # evaluating in the user code server is a beta option
    follow_upstream_sensor = dg.AutomationConditionSensorDefinition(
        "follow_upstream_sensor",
        target=FOLLOWERS,
        use_user_code_server=True,
        emit_backfills=False,
        minimum_interval_seconds=SENSOR_INTERVAL_S,
        default_status=dg.DefaultSensorStatus.RUNNING,
        run_tags={LAUNCHED_BY_TAG: "follow_upstream_sensor"},
        description="Rebuilds each asset that carries an automation condition (vlm_assets.defs.conditions."
        "FOLLOWS_UPSTREAM; the asset's page shows it) once its inputs changed.",
    )
