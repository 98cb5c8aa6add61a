"""Whether an asset partition is up to date, so `vlm-assets run` need not build it again.

Up to date: its recorded fingerprint (data version) equals the one its upstreams' recorded
fingerprints and the current settings give (vlm_assets.fingerprints), the run that recorded it
succeeded, and its primary outputs (StorageLayout.primary_outputs) are on disk.
"""

from __future__ import annotations

import dagster as dg

from vlm_assets.defs.resources import VlmConfig, latest_materialization, recorded_fingerprint


class Freshness:
    def __init__(self, vlm_config: VlmConfig, instance: dg.DagsterInstance, force: bool) -> None:
        """`force`: nothing is up to date."""
        self.vlm_config, self.instance, self.force = vlm_config, instance, force
        self.fingerprints = vlm_config.fingerprints(instance)

    def up_to_date(self, asset: str, partition: str | None) -> bool:
        if self.force:
            return False
        outputs = self.vlm_config.layout.primary_outputs(asset, partition, self.vlm_config.app)
        if not all(path.exists() for path in outputs):
            return False
        record = latest_materialization(self.instance, asset, partition)
        if record is None or recorded_fingerprint(record) != self.fingerprints.of(asset, partition):
            return False
        run = self.instance.get_run_record_by_id(record.run_id)
        return run is not None and run.dagster_run.status == dg.DagsterRunStatus.SUCCESS
