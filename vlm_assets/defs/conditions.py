"""Automation conditions that assets carry (evaluated by follow_upstream_sensor)."""

import dagster as dg

# An input that is missing because its latest run failed (an inbox source whose lineage failed; the
# inbox sensor retries it with back-off) does not hold the followers back: waiting on it could last
# for ever, and every other source would never reach the mix.
ANY_DEPS_MISSING_NOT_FAILED = dg.AutomationCondition.any_deps_match(
    dg.AutomationCondition.missing()
    & ~dg.AutomationCondition.will_be_requested()
    & ~dg.AutomationCondition.execution_failed()
).with_label("any_deps_missing (not failed)")

# The followers (a source's energon_dataset after its shards, training_mix over every source's
# dataset, video_frame_plan over every catalogue, frame_cache_index over every shard) rebuild once
# an input was updated, when no input is missing (other than by a failed run) or still running;
# never merely because they are missing.
FOLLOWS_UPSTREAM = (
    dg.AutomationCondition.any_deps_updated().since_last_handled()
    & ~ANY_DEPS_MISSING_NOT_FAILED
    & ~dg.AutomationCondition.any_deps_in_progress()
    # Not in the same tick as an input: video_frame_plan registers new shard partitions while it
    # runs, and frame_cache_index must wait for those shards instead of indexing the old set.
    & ~dg.AutomationCondition.any_deps_match(dg.AutomationCondition.will_be_requested())
    & ~dg.AutomationCondition.in_progress()
).with_label("follows upstream")
