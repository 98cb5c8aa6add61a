"""Resources shared by every domain: the user's config, the storage layout under it, and the HF processor."""

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import dagster as dg

from vlm_assets.asset_specs import spec_of
from vlm_assets.config import AppConfig, ConfigError, SourceConfig, load_config
from vlm_assets.defs.tags import ALIVE_TAG
from vlm_assets.fingerprints import Fingerprints, RecordedFingerprint
from vlm_assets.inbox import inbox_sources
from vlm_assets.layout import StorageLayout
from vlm_assets.packing.mix import mixable
from vlm_assets.progress import ProgressFile
from vlm_assets.publish import msc_url, publish
from vlm_assets.locks import file_locks, process_token
from vlm_assets.root_owner import claim_object_root, claim_storage_root

# Materialisation metadata: the asset's fingerprint (vlm_assets.fingerprints), also its data version.
FINGERPRINT_KEY = "fingerprint"


def versioned(metadata: dict[str, Any], fingerprint: str, data_version: str | None = None) -> dict[str, Any]:
    """MaterializeResult arguments that record `fingerprint` in the metadata and as data version
    (`data_version` instead where an output's bytes can stay the same over changed inputs)."""
    return {"metadata": {**metadata, FINGERPRINT_KEY: fingerprint}, "data_version": dg.DataVersion(data_version or fingerprint)}


def step_progress(context: dg.AssetExecutionContext, unit: str) -> ProgressFile:
    """Where this step reports how far it is, for the progress bars of `vlm-assets run`."""
    return ProgressFile(context.asset_key.to_user_string(), context.partition_key if context.has_partition_key else None, unit)


# Each log line is an event written to the instance's storage (tens of milliseconds on sqlite): a
# line per batch would cost a big source's step half a minute, and bury its other lines in the UI.
PROGRESS_LOG_EVERY_S = 15.0


class LoggedProgress:
    """A long step's progress: the `vlm-assets run` bar (step_progress), and a line of the run's log
    (`line(done, total)`) at most every PROGRESS_LOG_EVERY_S seconds and when the step is done."""

    def __init__(self, context: dg.AssetExecutionContext, unit: str, line: Callable[[int, int | None], str]) -> None:
        self.bar = step_progress(context, unit)
        self.log = context.log
        self.line = line
        self.logged_at = time.monotonic()

    def update(self, done: int, total: int | None = None) -> None:
        self.bar.update(done, total)
        if time.monotonic() - self.logged_at >= PROGRESS_LOG_EVERY_S or (total is not None and done >= total):
            self.logged_at = time.monotonic()
            self.log.info(self.line(done, total))


def latest_materialization(instance: dg.DagsterInstance, asset: str, partition: str | None) -> dg.EventLogRecord | None:
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None),
        limit=1,
    ).records
    return records[0] if records else None


def recorded_fingerprint(record: dg.EventLogRecord | None) -> str:
    """The fingerprint a materialisation recorded ("" for none)."""
    materialization = record.asset_materialization if record else None
    value = materialization.metadata.get(FINGERPRINT_KEY) if materialization else None
    return str(getattr(value, "value", "") or "")


def recorded_fingerprints(instance: dg.DagsterInstance) -> RecordedFingerprint:
    """What each output recorded when it was last built, read from `instance` at each call."""
    return lambda asset, partition: recorded_fingerprint(latest_materialization(instance, asset, partition))
from vlm_assets.tokens.consumer import counting_rule
from vlm_assets.tokens.lengths import LengthCounter
from vlm_assets.tokens.processor import processor_fingerprint, shared_processor
from vlm_assets.tokens.profile import length_counter, stored_media_tokens


class VlmConfig(dg.ConfigurableResource):
    """The validated YAML config (docs/formats.md) every asset reads its settings from."""

    config_path: str

    @cached_property
    def app(self) -> AppConfig:
        return load_config(self.config_path)

    @property
    def layout(self) -> StorageLayout:
        return StorageLayout(self.app.storage_root)

    def sources(self) -> list[SourceConfig]:
        """Configured sources, then those discovered in the inbox (the `sources` partitions)."""
        configured = list(self.app.sources)
        names = {source.name for source in configured}
        return configured + [source for source in inbox_sources(self.app.inbox) if source.name not in names]

    def mix_sources(self, log: dg.DagsterLogManager) -> tuple[list[SourceConfig], dict[str, str]]:
        """The sources the training mix takes; inbox sources not built yet are left out (logged, with why)."""
        configured = {source.name for source in self.app.sources}
        sources = self.sources()
        taken, left_out = mixable(sources, self.layout, optional={s.name for s in sources} - configured)
        for name, reason in left_out.items():
            log.warning(f"{name}: left out of the training mix: {reason}")
        return taken, left_out

    def source(self, name: str) -> SourceConfig:
        for source in self.sources():
            if source.name == name:
                return source
        raise ConfigError(f"{self.app.path}: no source named {name!r} in the config or the inbox {self.app.inbox}")

    def fingerprints(self, instance: dg.DagsterInstance) -> Fingerprints:
        """Fingerprints under the settings as loaded, from the upstream outputs recorded in `instance`."""
        return Fingerprints(self.app, processor_fingerprint(self.app.model), self.sources(), recorded_fingerprints(instance))

    def fingerprint(self, context: dg.AssetExecutionContext, asset: str) -> str:
        """The fingerprint this step's output of `asset` gets: the settings this step loaded and the
        fingerprints its upstream outputs recorded, read now, before it reads them."""
        partition = context.partition_key if context.has_partition_key else None
        return self.fingerprints(context.instance).of(asset, partition)

    def publish(self, context: dg.AssetExecutionContext, asset: str) -> dict[str, Any]:
        """With `storage.root` on object storage, publish what this step of `asset` built there
        (vlm_assets.publish) and return the metadata saying so; call it holding the step's locks.
        With a local root: nothing to do, no metadata."""
        url = self.app.storage_url
        if url is None:
            return {}
        partition = context.partition_key if context.has_partition_key else None
        published = publish(self.app.storage_root, url, spec_of(asset).publishes(self.layout, partition, self.app))
        context.log.info(published.describe(url))
        return {"published_to": str(url), "objects_put": published.put, "objects_unchanged": published.unchanged,
                "objects_deleted": published.deleted}

    def energon_location(self, path: Path) -> Path | str:
        """Where Energon reads the dataset (or mix) at `path` from: its published copy when
        `storage.root` is on object storage (an `msc://` path), else the file itself."""
        url = self.app.storage_url
        return path if url is None else msc_url(self.app.storage_root, url, path)

    @contextlib.contextmanager
    def locked(self, log: dg.DagsterLogManager, exclusive: Iterable[str] = (), shared: Iterable[str] = ()) -> Iterator[None]:
        """Hold storage locks (StorageLayout's *_lock names) so concurrent runs on this root take turns."""
        with file_locks(self.app.storage_root, exclusive, shared, on_wait=log.info):
            yield

    def build(self, context: dg.AssetExecutionContext, take_fingerprint: bool = True) -> "StepBuild":
        """This step's build of its asset, its fingerprint taken now (call it before reading any input),
        unless the build takes its own."""
        return StepBuild(self, context, take_fingerprint)

    @contextlib.contextmanager
    def locked_for(self, context: dg.AssetExecutionContext) -> Iterator[None]:
        """Hold the locks the spec of this step's asset names for its partition (vlm_assets.asset_specs)."""
        spec = spec_of(context.asset_key.to_user_string())
        partition = context.partition_key if context.has_partition_key else None
        locks = spec.locks_of(self.layout, partition, self.app, [source.name for source in self.sources()])
        with self.locked(context.log, locks.exclusive, locks.shared):
            yield

    @contextlib.contextmanager
    def locked_to_read(self, log: dg.DagsterLogManager, asset: str, partition: str | None = None) -> Iterator[None]:
        """Hold every lock the spec of `asset` names for `partition`, shared: a check reads the asset's
        outputs (and what they were built from) while no step writes them, beside other readers."""
        locks = spec_of(asset).locks_of(self.layout, partition, self.app, [source.name for source in self.sources()])
        with self.locked(log, shared=(*locks.exclusive, *locks.shared)):
            yield

    def setup_for_execution(self, context: dg.InitResourceContext) -> None:
        claim_storage_root(self.app.storage_root, self.app.path)
        if self.app.storage_url is not None:
            claim_object_root(self.app.storage_url, self.app.path)
        run = context.run
        if run is not None and context.instance is not None and ALIVE_TAG not in run.tags:
            context.instance.add_run_tags(run.run_id, {ALIVE_TAG: str(process_token(self.app.storage_root))})


class StepBuild:
    """The steps every asset's build takes around its own work: its fingerprint, taken before it reads
    its inputs; its spec's locks, held while it writes (`writing`); its outputs published when the
    writing ends; and the materialisation's metadata, versioned by the fingerprint (`result`)."""

    def __init__(self, vlm_config: VlmConfig, context: dg.AssetExecutionContext, take_fingerprint: bool = True) -> None:
        self._vlm_config, self._context = vlm_config, context
        self.asset = context.asset_key.to_user_string()
        self.fingerprint = vlm_config.fingerprint(context, self.asset) if take_fingerprint else None
        self.published: dict[str, Any] = {}

    @contextlib.contextmanager
    def writing(self) -> Iterator[None]:
        with self._vlm_config.locked_for(self._context):
            yield
            self.published = self._vlm_config.publish(self._context, self.asset)

    def result(self, metadata: dict[str, Any], data_version: str | None = None,
               fingerprint: str | None = None) -> dict[str, Any]:
        """MaterializeResult arguments: `metadata`, where it was published, and the fingerprint taken at
        the start (or `fingerprint`, one the build took itself; see versioned)."""
        taken = fingerprint or self.fingerprint
        assert taken is not None, f"{self.asset}: a build that takes its own fingerprint returns it"
        return versioned({**metadata, **self.published}, taken, data_version)


SOURCES_PARTITIONS = dg.DynamicPartitionsDefinition(name="sources")
# Rereads and retries of a registration that raced another process's (register_partitions).
REGISTER_ATTEMPTS = 5


def register_partitions(instance: dg.DagsterInstance, partitions: dg.DynamicPartitionsDefinition,
                        keys: Iterable[str]) -> list[str]:
    """Add those of `keys` the instance does not know yet; the ones added.

    Dagster's add is read-then-insert: two processes (two runs, a run and a sensor) adding the same
    key at once make one insert fail on the table's unique key. The loser reads the keys again and
    adds only what is still missing.
    """
    from sqlalchemy.exc import IntegrityError

    wanted = list(dict.fromkeys(keys))
    for attempt in range(REGISTER_ATTEMPTS):
        known = set(instance.get_dynamic_partitions(partitions.name))
        new = [key for key in wanted if key not in known]
        if not new:
            return []
        try:
            instance.add_dynamic_partitions(partitions.name, new)
            return new
        except IntegrityError:
            if attempt == REGISTER_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))
    return []
# The chunks of rows a source's catalogue is cut into (vlm_assets.tokens.chunk_plan): chunk indices,
# "00000" up, registered by each catalogue as it is built, paired with the sources. A partition
# key reads `<chunk>|<source>`; a source with fewer chunks than the largest has no rows in the
# indices past its own last chunk.
CHUNK_INDEX_PARTITIONS = dg.DynamicPartitionsDefinition(name="chunk_index")
SOURCE_DIMENSION = "source"  # the dimension of a chunk partition that names its source
SOURCE_CHUNKS_PARTITIONS = dg.MultiPartitionsDefinition({SOURCE_DIMENSION: SOURCES_PARTITIONS, "chunk": CHUNK_INDEX_PARTITIONS})
SOURCE_CHUNKS = "source_chunks"  # what `vlm-assets run` calls that partitioning


# Steps that saturate a core or the disk (token counting, shard and package writing) share this pool
# (dagster.yaml gives each pool its slots), so parallel runs cannot oversubscribe the machine.
HEAVY_POOL = "heavy"
# Frame-cache shard steps (video decoding), one shard per slot.
FRAME_CACHE_POOL = "frame_cache"
FRAME_CACHE_SHARD_PARTITIONS = dg.DynamicPartitionsDefinition(name="frame_cache_shards")


class HFProcessor(dg.ConfigurableResource):
    """The model's Hugging Face processor (embedded Qwen2-VL or a local directory), loaded once per process."""

    vlm_config: VlmConfig

    def load(self) -> Any:
        model = self.vlm_config.app.model
        return shared_processor(model)

    def length_counter(self, source: SourceConfig) -> LengthCounter:
        """The processor's length counter for `source`, its fast path proven (vlm_assets.tokens.profile)."""
        app = self.vlm_config.app
        # A video's tokens per clip as counted before, if they were: not run through the processor again.
        return length_counter(app.model, app.frame_cache, source.rejects_control_tokens,
                              tokens_per_clip=stored_media_tokens(app.model, app.frame_cache).per_clip,
                              rule=counting_rule(app, source))

    def fingerprint(self) -> str:
        return processor_fingerprint(self.vlm_config.app.model)
