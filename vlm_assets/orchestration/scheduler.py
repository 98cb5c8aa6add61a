"""`vlm-assets run`: materialise the graph (or a selection plus its upstream) on the real instance.

Each asset partition is one Dagster run (the asset with its checks) on the instance in
$DAGSTER_HOME, so the UI shows them exactly like sensor-launched runs. Runs execute in worker
processes, as many at a time as `--workers`, each as soon as everything it reads has been
built; a step that fails (or whose ERROR check fails) stops everything downstream of it.
Before launching anything, runs whose process is gone are failed and their pool slots freed.
An asset partition that is up to date (orchestration.freshness) is not run again unless `force`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import dagster as dg

from vlm_assets.asset_specs import SPECS, may_measure_lengths, runs_energon
from vlm_assets.config import AppConfig, SourceConfig
from vlm_assets.defs.automation.dead_runs import IN_FLIGHT, assign_stranded_steps, fail_dead_runs
from vlm_assets.defs.resources import (
    CHUNK_INDEX_PARTITIONS,
    FRAME_CACHE_POOL,
    HEAVY_POOL,
    SOURCE_CHUNKS,
    SOURCES_PARTITIONS,
    VlmConfig,
    latest_materialization,
)
from vlm_assets.defs.tags import ASSET_TAG, LAUNCHED_BY_TAG
from vlm_assets.layout import StorageLayout
from vlm_assets.orchestration.freshness import Freshness, State
from vlm_assets.orchestration.instance import built_sources, prepare_instance
from vlm_assets.orchestration.report import RunSummary, report_outcome, report_up_to_date
from vlm_assets.orchestration.progress_view import ProgressView
from vlm_assets.orchestration.selection import GraphShape, Selection, graph_shape, selection_of, upstream_partitions
from vlm_assets.orchestration.task import IN_WORKER_PROCESS, Submission, TaskOutcome, checks_of_latest_build, label
from vlm_assets.orchestration.worker_output import log_folder
from vlm_assets.orchestration.workers import WorkerPool, start_workers
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR
from vlm_assets.tokens.chunk_plan import ChunkPlan, chunk_index_key, chunk_partition_key

WAIT_POLL_S = 0.5
POOL_SWEEP_S = 5.0  # how often a step stranded in a pool's queue (see assign_stranded_steps) is looked for


class _Stop:
    """First SIGINT/SIGTERM: launch nothing more, let the steps in flight finish. Second: exit now."""

    def __init__(self, echo: Callable[[str], None]) -> None:
        self.requested = False
        self.echo = echo
        self.previous: dict[int, object] = {}

    def __enter__(self) -> _Stop:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame) -> None:
        if self.requested:
            # Waiting for the pool to wind down is what the user just declined; the workers follow
            # their CLI out within a second and the next run fails their runs as dead.
            self.echo(f"{signal.Signals(signum).name} again: aborting; the runs in flight are killed")
            os._exit(130)
        self.requested = True
        self.echo(f"{signal.Signals(signum).name}: stopping after the step(s) in flight; nothing more is launched "
                  "(signal again to abort them)")


class _Scheduler:
    """Which asset partitions are ready to launch, given what has settled so far."""

    def __init__(self, sources: list[SourceConfig], instance: dg.DagsterInstance, selection: Selection,
                 shape: GraphShape, echo: Callable[[str], None], layout: StorageLayout) -> None:
        self.sources, self.instance, self.shape, self.echo = [source.name for source in sources], instance, shape, echo
        self.layout = layout
        self.selection = selection
        self.selected = selection.assets
        self.partitions: dict[str, list[str | None]] = {}
        self.state: dict[tuple[str, str | None], str] = {}  # done | up_to_date | failed | blocked | running
        self.read: dict[tuple[str, str | None, str], set[str] | None] = {}

    def expand(self, asset: str) -> list[str | None] | None:
        """The asset's partitions once they are known (frame-cache shards: after the plan is final)."""
        if asset in self.partitions:
            return self.partitions[asset]
        name = self.shape.partitioning[asset]
        if name is None:
            keys: list[str | None] = [None]
        elif name == SOURCES_PARTITIONS.name:
            keys = list(self.sources)
        else:
            # Known once what cuts them is built: a frame-cache plan, a source's catalogue (its chunks).
            parents = [p for p in self.shape.parents[asset] if p in self.selected]
            if any(not self._final(p) for p in parents):
                return None
            keys = list(existing_partitions(name, self.instance, self.layout, self.sources))
        self.partitions[asset] = [key for key in keys if self.selection.keeps(asset, key)]
        return self.partitions[asset]

    def unknown_partitions(self) -> list[str]:
        """Selected partitions that do not exist (a source not in the config, a shard not planned yet)."""
        problems = []
        for asset, wanted in self.selection.partitions.items():
            name = self.shape.partitioning[asset]
            known = (self.sources if name == SOURCES_PARTITIONS.name
                     else existing_partitions(name, self.instance, self.layout, self.sources))
            # The chunks of a selected source are selected by the source's name (selection.Selection).
            whole_sources = set(self.sources) if name == SOURCE_CHUNKS else set()
            problems += [f"{label(asset, key)} (known: {', '.join(known) or 'none yet'})"
                         for key in sorted(set(wanted) - set(known) - whole_sources)]
        return problems

    def _final(self, asset: str) -> bool:
        keys = self.expand(asset)
        return keys is not None and all(self.state.get((asset, key)) not in (None, "running") for key in keys)

    def dependencies(self, asset: str, partition: str | None) -> list[tuple[str, str | None]] | None:
        deps: list[tuple[str, str | None]] = []
        for parent in self.shape.parents[asset]:
            if parent not in self.selected:
                continue
            keys = self.expand(parent)
            if keys is None:
                return None
            read = self._reads(asset, partition, parent)
            deps.extend((parent, key) for key in keys if read is None or key in read)
        return deps

    def _reads(self, asset: str, partition: str | None, parent: str) -> set[str] | None:
        """The partitions of `parent` that `partition` of `asset` reads (None: all), asked once the
        parent's partitions are known."""
        if (asset, partition, parent) not in self.read:
            self.read[(asset, partition, parent)] = upstream_partitions(self.shape, asset, partition, parent, self.instance)
        return self.read[(asset, partition, parent)]

    def next_ready(self) -> list[tuple[str, str | None]]:
        """Nodes whose inputs are settled; blocked ones are settled as blocked on the way."""
        ready = []
        for asset in self.selected:
            keys = self.expand(asset)
            if keys is None:
                continue
            for key in keys:
                if (asset, key) in self.state:
                    continue
                deps = self.dependencies(asset, key)
                if deps is None or any(self.state.get(dep) in (None, "running") for dep in deps):
                    continue
                bad = [dep for dep in deps if self.state[dep] in ("failed", "blocked") and _needed(asset, key, dep)]
                if bad:
                    self.state[(asset, key)] = "blocked"
                    self.echo(f"⊘ {label(asset, key)}: not built, upstream {label(*bad[0])} failed")
                    continue
                ready.append((asset, key))
        return ready


def _needed(asset: str, partition: str | None, dependency: tuple[str, str | None]) -> bool:
    """Whether `asset[partition]` cannot be built without `dependency` built: all but another partition
    of an upstream it reads every partition of (asset_specs: it takes what of those there is, and its
    fingerprint names them, so one source's failed catalogue does not hold every source's dedup back)."""
    parent, key = dependency
    return asset not in SPECS or parent not in SPECS[asset].reads_every_partition_of or key == partition


def run_graph(
    defs: dg.Definitions,
    app: AppConfig,
    instance: dg.DagsterInstance,
    select: Sequence[str] | None = None,
    echo: Callable[[str], None] = print,
    workers: int = 1,
    force: bool = False,
    log_dir: Path | None = None,
    submission: Submission = IN_WORKER_PROCESS,
    pool: WorkerPool | None = None,
    progress: ProgressView | None = None,
) -> RunSummary:
    """Materialise `select` (asset names or `asset[partition]`, and what they read) as one run per asset
    partition on `workers` processes.

    `submission`: where the runs execute (orchestration.task.Submission). `pool`: the processes
    from `start_workers` (started here when not given); shut down on return. `progress`: shows the
    progress the steps in flight report (orchestration.progress_view).
    """
    shape = graph_shape(defs)
    selection = selection_of(shape, select, instance)
    selected = selection.assets
    if progress is not None:
        echo = progress.echo(echo)
    submission.check_ready(echo)
    summary = RunSummary()
    summary.dead_runs_failed = prepare_instance(instance, app, echo)
    freshness, sources = _judge(defs, instance, shape, selection, force)
    scheduler = _Scheduler(sources, instance, selection, shape, echo, StorageLayout(app.storage_root))
    unknown = scheduler.unknown_partitions()
    if unknown:
        raise ValueError(f"no such partition: {'; '.join(unknown)}")
    log_dir = log_dir or log_folder(Path(os.environ.get("DAGSTER_HOME", ".")))
    in_flight: dict[concurrent.futures.Future, tuple[str, str | None]] = {}
    waiting: set[tuple[str, str | None]] = set()  # ready, but another process's run is building them
    next_pool_sweep = time.monotonic() + POOL_SWEEP_S
    with _Stop(echo) as stop, \
            pool or start_workers(str(app.path), workers, import_energon=runs_energon(select),
                                  load_processor=may_measure_lengths(select, app, force)) as pool:
        while True:
            if not stop.requested:
                launch = []
                ready = scheduler.next_ready()
                elsewhere = builds_elsewhere(instance) if ready else {}
                for node in ready:
                    if len(in_flight) + len(launch) >= workers:
                        break
                    if node in elsewhere:
                        if node not in waiting:
                            echo(f"… {label(*node)}: being built by {elsewhere[node]}; waiting for it, then taking its result")
                            waiting.add(node)
                        continue
                    waiting.discard(node)
                    if freshness.up_to_date(*node):
                        scheduler.state[node] = "up_to_date"
                        last_build = TaskOutcome(*node, success=True, checks=checks_of_latest_build(instance, *node))
                        report_up_to_date(last_build, summary, echo)
                        continue
                    scheduler.state[node] = "running"
                    launch.append(node)
                shares = _process_shares(launch, shape.chunked, workers - len(in_flight))
                for node, processes in zip(launch, shares):
                    echo(f"▶ {label(*node)}" + (f" on {processes} processes" if processes and processes > 1 else ""))
                    in_flight[pool.submit(submission.execute, str(app.path), *node, str(log_dir), processes, force)] = node
            if not in_flight:
                if stop.requested or not scheduler.next_ready():
                    break
                if waiting:
                    time.sleep(WAIT_POLL_S)
                    if time.monotonic() >= next_pool_sweep:  # a run waited for whose process died is failed
                        fail_dead_runs(instance)
                        next_pool_sweep = time.monotonic() + POOL_SWEEP_S
                continue
            finished, _ = concurrent.futures.wait(list(in_flight), timeout=WAIT_POLL_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            if progress is not None:
                progress.refresh(node for future, node in in_flight.items() if future not in finished)
            if time.monotonic() >= next_pool_sweep:
                assign_stranded_steps(instance, [FRAME_CACHE_POOL, HEAVY_POOL])
                next_pool_sweep = time.monotonic() + POOL_SWEEP_S
            for future in finished:
                node = in_flight.pop(future)
                summary.runs += 1
                try:
                    outcome = future.result()
                except concurrent.futures.process.BrokenProcessPool:
                    outcome = TaskOutcome(*node, failure=pool.why_broken(), log_path=str(pool.log_path))
                except OSError as error:  # before its run started, e.g. the storage root turned read-only
                    outcome = TaskOutcome(*node, failure=f"{error.strerror or error}: {error.filename}")
                scheduler.state[node] = "done" if outcome.success and not outcome.failed_checks else "failed"
                report_outcome(outcome, summary, echo)
        summary.interrupted = stop.requested
    if progress is not None:
        progress.close()
    summary.blocked = [label(*node) for node, state in scheduler.state.items() if state == "blocked"]
    if summary.interrupted:
        never = [label(asset, key) for asset in selected for key in scheduler.partitions.get(asset, [None])
                 if (asset, key) not in scheduler.state]
        echo(f"stopped on request; not launched: {', '.join(never) or 'nothing'}")
    return summary


def builds_elsewhere(instance: dg.DagsterInstance) -> dict[tuple[str, str | None], str]:
    """The asset partitions that runs in progress on the instance are building (another `vlm-assets
    run`, a sensor or schedule under `dagster dev`, a launch from the UI), each with its run's name.

    Asked only about partitions this run has not launched, so every such run is another process's: it
    is waited for rather than raced, and its result then judged like any other.
    """
    building: dict[tuple[str, str | None], str] = {}
    for run in instance.get_runs(filters=dg.RunsFilter(statuses=IN_FLIGHT)):
        partition = run.tags.get("dagster/partition")
        who = run.tags.get(LAUNCHED_BY_TAG) or ("vlm-assets run" if ASSET_TAG in run.tags else "a launch")
        assets = {key.to_user_string() for key in run.asset_selection or ()}
        if ASSET_TAG in run.tags:
            assets.add(run.tags[ASSET_TAG])
        for asset in assets:
            building[(asset, partition)] = f"run {run.run_id[:8]} ({who})"
    return building


def plan_graph(defs: dg.Definitions, app: AppConfig, instance: dg.DagsterInstance, select: Sequence[str] | None = None,
               echo: Callable[[str], None] = print) -> dict[str, State]:
    """Each selected asset partition's state (orchestration.freshness.State), as the UI shows it now;
    nothing is built. Partitions that do not exist yet (shards of a plan not made) are not listed."""
    shape = graph_shape(defs)
    selection = selection_of(shape, select, instance)
    prepare_instance(instance, app, echo)
    freshness, sources = _judge(defs, instance, shape, selection, force=False)
    states = {}
    for asset in selection.assets:
        name = shape.partitioning[asset]
        names = [source.name for source in sources]
        keys: list[str | None] = ([None] if name is None else names if name == SOURCES_PARTITIONS.name
                                  else list(existing_partitions(name, instance, StorageLayout(app.storage_root), names)))
        for key in keys:
            if selection.keeps(asset, key):
                states[label(asset, key)] = state = freshness.state(asset, key)
                echo(f"{state.value:>10}  {label(asset, key)}")
                record = latest_materialization(instance, asset, key) if state is State.MISSING else None
                for damage in freshness.damage(asset, key, record) if record is not None else []:
                    echo(f"{'':>10}  ↳ {damage}")
    return states


def existing_partitions(name: str, instance: dg.DagsterInstance, layout: StorageLayout, sources: list[str]) -> list[str]:
    """The partitions of a dynamic partitioning that exist now: for `source_chunks`, each source's
    chunks as its catalogue last cut them (not the cells past a source's last chunk), and for a
    source not catalogued yet, every chunk index registered, as the UI shows it."""
    if name != SOURCE_CHUNKS:
        return list(instance.get_dynamic_partitions(name))
    registered = list(instance.get_dynamic_partitions(CHUNK_INDEX_PARTITIONS.name))
    keys = []
    for source in sources:
        plan = ChunkPlan.load(layout.chunk_plan(source))
        indices = [chunk_index_key(index) for index in range(len(plan))] if plan is not None else registered
        keys += [chunk_partition_key(source, int(index)) for index in indices]
    return keys


def _judge(defs: dg.Definitions, instance: dg.DagsterInstance, shape: GraphShape, selection: Selection,
           force: bool) -> tuple[Freshness, list[SourceConfig]]:
    """The judge of what needs building, and the sources built, once the sources' files are observed."""
    vlm_config: VlmConfig = defs.resources["vlm_config"]  # type: ignore[assignment]
    freshness = Freshness(vlm_config, instance, force, shape.partitions_defs)
    sources = built_sources(vlm_config, instance)
    if "sample_catalog" in selection.assets:
        freshness.observe_sources(sources)
    return freshness, sources


def _process_shares(launch: list[tuple[str, str | None]], chunked: set[str], free: int) -> list[int | None]:
    """Processes per launched run: workers no run takes now go to the chunked steps among them.

    A big source alone then uses every worker, and the processes of all runs together never exceed
    `--workers` at launch (a chunk process may load the model's processor: about 1 GB). A user's
    $VLM_ASSETS_STEP_PROCESSES is left as it is.
    """
    if STEP_PROCESSES_ENV_VAR in os.environ:
        return [None] * len(launch)
    takers = [index for index, (asset, _) in enumerate(launch) if asset in chunked]
    spare = free - len(launch)
    shares: list[int | None] = [1] * len(launch)
    for rank, index in enumerate(takers):
        shares[index] = 1 + spare // len(takers) + (1 if rank < spare % len(takers) else 0)
    return shares


