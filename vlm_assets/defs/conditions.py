"""Automation conditions that assets carry (evaluated by follow_upstream_sensor)."""

import dagster as dg

# The followers (a source's energon_dataset after its shards, training_mix over every source's
# dataset, video_frame_plan over every catalogue, frame_cache_index over every shard) rebuild once
# an input was updated, when no input is missing or still running; never merely because they are missing.
FOLLOWS_UPSTREAM = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~dg.AutomationCondition.any_deps_missing()
    & ~dg.AutomationCondition.any_deps_in_progress()
    # Not in the same tick as an input: video_frame_plan registers new shard partitions while it
    # runs, and frame_cache_index must wait for those shards instead of indexing the old set.
    & ~dg.AutomationCondition.any_deps_match(dg.AutomationCondition.will_be_requested())
    & ~dg.AutomationCondition.in_progress()
).with_label("follows upstream")
