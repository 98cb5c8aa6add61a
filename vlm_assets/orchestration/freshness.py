"""Whether an asset partition needs building, judged as the Dagster UI judges it.

Missing: never materialised, or its outputs on disk are gone or cut short (vlm_assets.asset_specs.damaged_outputs:
a primary output, a shard, an Energon index file).
Failed: the latest run that set out to materialise it failed after its last materialisation (a
run killed mid-step too, once marked failed). Stale: its recorded fingerprint (its data version)
differs from the one its upstreams' recorded fingerprints and the current settings give
(vlm_assets.fingerprints); the UI sees the same through code versions and data versions. Up to
date otherwise. The sources' files are observed first (observe_sources), so a changed file shows
in the UI as the stale catalogue that `vlm-assets run` rebuilds.
"""

from __future__ import annotations

import enum

import dagster as dg

from vlm_assets.asset_specs import damaged_outputs
from vlm_assets.config import SourceConfig
from vlm_assets.defs.catalog.source_files import changed_source_files
from vlm_assets.defs.resources import VlmConfig, latest_materialization, recorded_fingerprint

FAILED_RUN = (dg.DagsterRunStatus.FAILURE, dg.DagsterRunStatus.CANCELED)


class State(enum.Enum):
    UP_TO_DATE = "up to date"
    MISSING = "missing"
    FAILED = "failed"
    STALE = "stale"


class Freshness:
    def __init__(self, vlm_config: VlmConfig, instance: dg.DagsterInstance, force: bool,
                 partitions_defs: dict[str, dg.PartitionsDefinition | None] | None = None) -> None:
        """`force`: nothing is up to date. `partitions_defs`: each partitioned asset's definition."""
        self.vlm_config, self.instance, self.force = vlm_config, instance, force
        self.fingerprints = vlm_config.fingerprints(instance)
        self.partitions_defs = partitions_defs or {}
        self._failed: dict[str, set[str]] = {}  # per partitioned asset: its partitions whose latest run failed

    def observe_sources(self, sources: list[SourceConfig]) -> list[str]:
        """Record an observation of each source whose files changed since last observed; their names."""
        observations = changed_source_files(self.instance, sources, self.fingerprints.source_walk)
        for observation in observations:
            self.instance.report_runless_asset_event(observation)
        return [str(observation.partition) for observation in observations]

    def up_to_date(self, asset: str, partition: str | None) -> bool:
        return not self.force and self.state(asset, partition) is State.UP_TO_DATE

    def state(self, asset: str, partition: str | None) -> State:
        record = latest_materialization(self.instance, asset, partition)
        if record is None or self.damage(asset, partition, record):
            return State.MISSING
        if self._latest_attempt_failed(asset, partition, record.run_id):
            return State.FAILED
        if recorded_fingerprint(record) != self.fingerprints.of(asset, partition):
            return State.STALE
        return State.UP_TO_DATE

    def damage(self, asset: str, partition: str | None, record: dg.EventLogRecord) -> list[str]:
        """What of the outputs its materialisation recorded is gone or cut short on disk (asset_specs.damaged_outputs)."""
        materialization = record.asset_materialization
        recorded = {key: value.value for key, value in materialization.metadata.items()} if materialization else {}
        return damaged_outputs(self.vlm_config.layout, asset, partition, self.vlm_config.app, recorded)

    def _latest_attempt_failed(self, asset: str, partition: str | None, materialized_by: str) -> bool:
        key = dg.AssetKey(asset)
        partitions_def = self.partitions_defs.get(asset)
        if partition is not None and partitions_def is not None:
            if asset not in self._failed:
                # Once per asset, as they were when this judge was made: a run asks about every partition.
                names = partitions_def.get_partition_keys(dynamic_partitions_store=self.instance)
                status = self.instance.get_status_by_partition(key, names, partitions_def) or {}
                self._failed[asset] = {name for name, value in status.items() if value == dg.AssetPartitionStatus.FAILED}
            return partition in self._failed[asset]
        records = self.instance.get_asset_records([key])
        entry = records[0].asset_entry if records else None
        latest_run_id = entry and (entry.last_planned_materialization_run_id or entry.last_run_id)
        if not latest_run_id or latest_run_id == materialized_by:
            return False
        run = self.instance.get_run_record_by_id(latest_run_id)
        return run is not None and run.dagster_run.status in FAILED_RUN
