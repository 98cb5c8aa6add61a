"""`vlm-assets run`: materialise the graph (or a selection plus its upstream) on the real instance.

Each asset partition is one Dagster run (the asset with its checks) on the instance in
$DAGSTER_HOME, so the UI shows them exactly like sensor-launched runs. Runs execute in worker
processes, as many at a time as `--workers`, each as soon as everything it reads has been
built; a step that fails (or whose ERROR check fails) stops everything downstream of it.
Before launching anything, runs whose process is gone are failed and their pool slots freed.
An asset whose recorded fingerprint (data version) equals the one its upstreams' recorded
fingerprints and the current settings give (vlm_assets.fingerprints), and whose output is on
disk, is not run again unless `force`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import dagster as dg

from vlm_assets.atomic import atomic_write_text
from vlm_assets.defs.failures import root_cause
from vlm_assets.config import CONFIG_ENV_VAR, AppConfig
from vlm_assets.defs.tags import ALIVE_TAG, ASSET_TAG, CHUNKED_TAG, LAUNCHED_BY_CLI, LAUNCHED_BY_TAG
from vlm_assets.defs.resources import (
    FRAME_CACHE_POOL, HEAVY_POOL, SOURCES_PARTITIONS, VlmConfig, latest_materialization,
    recorded_fingerprint,
)
from vlm_assets.locks import file_lock, process_token, remove_dead_tokens
from vlm_assets.layout import StorageLayout
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR
from vlm_assets.root_owner import claim_storage_root
from vlm_assets.scale_out.executor import file_sha256
from vlm_assets.wording import plural
from vlm_assets.worker_processes import start_workers

RUN_LOGGING = {"loggers": {"console": {"config": {"log_level": "INFO"}}}}
WAIT_POLL_S = 0.5
POOL_SWEEP_S = 5.0  # how often a step stranded in a pool's queue (see assign_stranded_steps) is looked for


@dataclass
class RunSummary:
    runs: int = 0
    failed_runs: list[str] = field(default_factory=list)
    failed_checks: list[str] = field(default_factory=list)
    materialized: list[str] = field(default_factory=list)
    up_to_date: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    dead_runs_failed: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def ok(self) -> bool:
        return not (self.failed_runs or self.failed_checks or self.blocked or self.interrupted)




def open_instance(home: Path) -> dg.DagsterInstance:
    """The instance in `home`; the first process to open a new one creates its tables alone."""
    # Most of the second an open takes is importing the SQL libraries Dagster's storage is built
    # on: done before the lock, the CLI and its workers starting together queue only for the rest.
    import alembic.command  # noqa: F401
    import sqlalchemy.orm  # noqa: F401

    with file_lock(home, "instance-init"):
        return dg.DagsterInstance.get()


def create_pool_limits(instance: dg.DagsterInstance, storage_root: Path) -> None:
    """Give each of our pools its default limit before any run claims a slot in it.

    Dagster creates a pool's limit on first use. On PostgreSQL two runs doing that at the same
    moment make one of them fail (its insert conflicts, and the update that follows runs in the
    aborted transaction), so it is done here, once, before runs start side by side.
    """
    with file_lock(storage_root, "dagster-pools"):
        existing = {pool.name for pool in instance.event_log_storage.get_pool_limits()}
        for pool in (FRAME_CACHE_POOL, HEAVY_POOL):
            if pool not in existing:
                instance.event_log_storage.initialize_concurrency_limit_to_default(pool)


def register_sources(instance: dg.DagsterInstance, app: AppConfig) -> None:
    existing = set(instance.get_dynamic_partitions(SOURCES_PARTITIONS.name))
    new = [source.name for source in app.sources if source.name not in existing]
    if new:
        instance.add_dynamic_partitions(SOURCES_PARTITIONS.name, new)


# -- the graph, from public asset specs ---------------------------------------------------------

@dataclass(frozen=True)
class GraphShape:
    order: list[str]  # asset names, dependencies first
    parents: dict[str, set[str]]
    partitioning: dict[str, str | None]  # name of the dynamic partitions definition, or None
    chunked: set[str] = field(default_factory=set)  # assets whose step can use several processes


def graph_shape(defs: dg.Definitions) -> GraphShape:
    specs = {spec.key.to_user_string(): spec for spec in defs.resolve_all_asset_specs()}
    parents = {name: {dep.asset_key.to_user_string() for dep in spec.deps} & set(specs) for name, spec in specs.items()}
    partitioning = {name: getattr(spec.partitions_def, "name", None) for name, spec in specs.items()}
    order: list[str] = []
    remaining = dict(parents)
    while remaining:
        ready = sorted(name for name, deps in remaining.items() if deps <= set(order))
        if not ready:
            raise ValueError(f"dependency cycle among {sorted(remaining)}")
        order.extend(ready)
        for name in ready:
            del remaining[name]
    chunked = {name for name, spec in specs.items() if spec.tags.get(CHUNKED_TAG) == "true"}
    return GraphShape(order, parents, partitioning, chunked)


def selected_assets(shape: GraphShape, select: Sequence[str] | None) -> list[str]:
    if not select:
        return list(shape.order)
    unknown = sorted(set(select) - set(shape.order))
    if unknown:
        raise ValueError(f"unknown asset key(s): {', '.join(unknown)} (known: {', '.join(sorted(shape.order))})")
    wanted = set(select)
    for name in reversed(shape.order):
        if name in wanted:
            wanted |= shape.parents[name]
    return [name for name in shape.order if name in wanted]


# -- one run, in a worker process ---------------------------------------------------------------

@dataclass
class TaskOutcome:
    asset: str
    partition: str | None
    run_id: str = ""
    success: bool = False
    materialized: bool = False
    checks: list[tuple[str, bool, str]] = field(default_factory=list)  # (name, passed, severity)
    failure: str = ""  # root cause, one line
    log_path: str = ""

    @property
    def label(self) -> str:
        return self.asset + (f" [{self.partition}]" if self.partition else "")

    @property
    def failed_checks(self) -> list[str]:
        return [name for name, passed, severity in self.checks if not passed and severity == "ERROR"]


# Per config path, with the sha256 of the file it was built from: a Celery worker's pool process
# lives on and may execute runs of several configs, and of a config edited since its last run.
_worker: dict[str, tuple[str, tuple[dg.Definitions, dg.DagsterInstance, VlmConfig]]] = {}




def worker_state(config_path: str) -> tuple[dg.Definitions, dg.DagsterInstance, VlmConfig]:
    sha256 = file_sha256(config_path)
    if config_path not in _worker or _worker[config_path][0] != sha256:
        from vlm_assets.definitions import build_definitions

        defs = build_definitions(config_path)
        # Under the lock: the CLI and its other workers open a new instance at the same moment.
        instance = open_instance(Path(os.environ["DAGSTER_HOME"]))
        _worker[config_path] = (sha256, (defs, instance, defs.resources["vlm_config"]))
    return _worker[config_path][1]


def execute_task(config_path: str, asset: str, partition: str | None, log_dir: str,
                 executor: str = "in_process", processes: int | None = None) -> TaskOutcome:
    """Materialise one asset partition (and its checks) as one run; summarise what happened.

    With the celery executor a Celery worker executes the run, as this function, and this process waits.
    `processes`: how many processes a chunked step of this run may use (None: as the environment says;
    on a worker, its own share of its machine's cores).
    """
    if executor == "celery":
        from vlm_assets.scale_out.executor import execute_on_workers

        return execute_on_workers(config_path, asset, partition, log_dir)
    if processes is not None:
        os.environ[STEP_PROCESSES_ENV_VAR] = str(processes)
    defs, instance, vlm_config = worker_state(config_path)
    token = process_token(vlm_config.app.storage_root)
    result = dg.materialize(
        list(defs.assets or []) + list(defs.asset_checks or []),
        selection=dg.AssetSelection.assets(asset),
        partition_key=partition,
        instance=instance,
        resources=defs.resources or {},
        run_config=RUN_LOGGING,
        raise_on_error=False,
        tags={LAUNCHED_BY_TAG: LAUNCHED_BY_CLI, ASSET_TAG: asset, ALIVE_TAG: str(token)},
    )
    outcome = TaskOutcome(asset, partition, run_id=result.run_id, success=result.success)
    for event in result.all_events:
        if event.event_type_value == "ASSET_MATERIALIZATION":
            outcome.materialized = True
        elif event.event_type_value == "ASSET_CHECK_EVALUATION":
            evaluation = event.event_specific_data
            outcome.checks.append((evaluation.check_name, evaluation.passed, evaluation.severity.value))
        elif event.event_type_value == "STEP_FAILURE" and not outcome.failure:
            outcome.failure = root_cause(event.event_specific_data.error)
    if not result.success:
        outcome.failure = outcome.failure or "the run failed (see its log)"
        outcome.log_path = str(write_run_log(instance, result.run_id, Path(log_dir)))
    return outcome


def write_run_log(instance: dg.DagsterInstance, run_id: str, log_dir: Path) -> Path:
    """Every event of the run, with full tracebacks, in one text file."""
    lines = []
    for entry in instance.all_logs(run_id):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(entry.timestamp))
        lines.append(f"{stamp} {entry.step_key or '-'}: {entry.user_message or entry.message or ''}")
        event = entry.dagster_event
        error = getattr(event.event_specific_data, "error", None) if event is not None else None
        if error is not None:
            lines.append(error.to_string())
    path = log_dir / f"run-{run_id}.log"
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


# -- the scheduler, in the CLI process ----------------------------------------------------------

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
    def __init__(self, defs: dg.Definitions, app: AppConfig, instance: dg.DagsterInstance, selected: list[str],
                 shape: GraphShape, force: bool, echo: Callable[[str], None]) -> None:
        self.app, self.instance, self.shape, self.force, self.echo = app, instance, shape, force, echo
        self.vlm_config: VlmConfig = defs.resources["vlm_config"]  # type: ignore[assignment]
        self.fingerprints = self.vlm_config.fingerprints(instance)
        self.selected = selected
        self.partitions: dict[str, list[str | None]] = {}
        self.state: dict[tuple[str, str | None], str] = {}  # done | up_to_date | failed | blocked | running

    def expand(self, asset: str) -> list[str | None] | None:
        """The asset's partitions once they are known (frame-cache shards: after the plan is final)."""
        if asset in self.partitions:
            return self.partitions[asset]
        name = self.shape.partitioning[asset]
        if name is None:
            keys: list[str | None] = [None]
        elif name == SOURCES_PARTITIONS.name:
            keys = [source.name for source in self.app.sources]
        else:
            parents = [p for p in self.shape.parents[asset] if p in self.selected]
            if any(not self._final(p) for p in parents):
                return None
            keys = list(self.instance.get_dynamic_partitions(name))
        self.partitions[asset] = keys
        return keys

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
            if self.shape.partitioning[parent] is None:
                deps.append((parent, None))
            elif self.shape.partitioning[parent] == self.shape.partitioning[asset]:
                deps.append((parent, partition))
            else:
                deps.extend((parent, key) for key in keys)
        return deps

    def up_to_date(self, asset: str, partition: str | None) -> bool:
        """Built by a successful run from exactly the inputs its upstreams hold now, and on disk."""
        if self.force:
            return False
        if not all(path.exists() for path in self.vlm_config.layout.primary_outputs(asset, partition, self.vlm_config.app)):
            return False
        record = latest_materialization(self.instance, asset, partition)
        if record is None or recorded_fingerprint(record) != self.fingerprints.of(asset, partition):
            return False
        run = self.instance.get_run_record_by_id(record.run_id)
        return run is not None and run.dagster_run.status == dg.DagsterRunStatus.SUCCESS

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
                bad = [dep for dep in deps if self.state[dep] in ("failed", "blocked")]
                if bad:
                    self.state[(asset, key)] = "blocked"
                    parent = bad[0][0] + (f" [{bad[0][1]}]" if bad[0][1] else "")
                    self.echo(f"⊘ {asset}" + (f" [{key}]" if key else "") + f": not built, upstream {parent} failed")
                    continue
                ready.append((asset, key))
        return ready


def run_graph(
    defs: dg.Definitions,
    app: AppConfig,
    instance: dg.DagsterInstance,
    select: Sequence[str] | None = None,
    echo: Callable[[str], None] = print,
    workers: int = 1,
    force: bool = False,
    log_dir: Path | None = None,
    executor: str = "in_process",
    pool: concurrent.futures.ProcessPoolExecutor | None = None,
) -> RunSummary:
    """Materialise `select` (and what it reads) as one run per asset partition on `workers` processes.

    `pool`: the processes from `start_workers` (started here when not given); shut down on return.
    """
    shape = graph_shape(defs)
    selected = selected_assets(shape, select)
    if executor == "celery":
        _require_celery_workers(echo)
    summary = RunSummary()
    from vlm_assets.defs.automation.dead_runs import assign_stranded_steps, fail_dead_runs

    claim_storage_root(app.storage_root, app.path)
    process_token(app.storage_root)  # a storage root we cannot write to fails here, in one line, before any run
    summary.dead_runs_failed = fail_dead_runs(instance)
    for run_id in summary.dead_runs_failed:
        echo(f"run {run_id}: its process is gone (killed?); marked failed and its pool slots freed")
    remove_dead_tokens(app.storage_root)
    register_sources(instance, app)
    create_pool_limits(instance, app.storage_root)
    scheduler = _Scheduler(defs, app, instance, selected, shape, force, echo)
    log_dir = log_dir or Path(os.environ.get("DAGSTER_HOME", ".")) / "logs"
    in_flight: dict[concurrent.futures.Future, tuple[str, str | None]] = {}
    next_pool_sweep = time.monotonic() + POOL_SWEEP_S
    with _Stop(echo) as stop, pool or start_workers(str(app.path), workers) as pool:
        while True:
            if not stop.requested:
                launch = []
                for node in scheduler.next_ready():
                    if len(in_flight) + len(launch) >= workers:
                        break
                    if scheduler.up_to_date(*node):
                        scheduler.state[node] = "up_to_date"
                        summary.up_to_date.append(_label(*node))
                        echo(f"= {_label(*node)}: up to date")
                        continue
                    scheduler.state[node] = "running"
                    launch.append(node)
                shares = _process_shares(launch, shape.chunked, workers - len(in_flight))
                for node, processes in zip(launch, shares):
                    echo(f"▶ {_label(*node)}" + (f" on {processes} processes" if processes and processes > 1 else ""))
                    in_flight[pool.submit(execute_task, str(app.path), *node, str(log_dir), executor, processes)] = node
            if not in_flight:
                if stop.requested or not scheduler.next_ready():
                    break
                continue
            finished, _ = concurrent.futures.wait(list(in_flight), timeout=WAIT_POLL_S,
                                                  return_when=concurrent.futures.FIRST_COMPLETED)
            if time.monotonic() >= next_pool_sweep:
                assign_stranded_steps(instance, [FRAME_CACHE_POOL, HEAVY_POOL])
                next_pool_sweep = time.monotonic() + POOL_SWEEP_S
            for future in finished:
                node = in_flight.pop(future)
                summary.runs += 1
                try:
                    outcome = future.result()
                except concurrent.futures.process.BrokenProcessPool:
                    outcome = TaskOutcome(*node, failure="the worker process running it died (killed or out of memory)")
                except OSError as error:  # before its run started, e.g. the storage root turned read-only
                    outcome = TaskOutcome(*node, failure=f"{error.strerror or error}: {error.filename}")
                scheduler.state[node] = "done" if outcome.success and not outcome.failed_checks else "failed"
                _report(outcome, summary, echo)
        summary.interrupted = stop.requested
    summary.blocked = [_label(*node) for node, state in scheduler.state.items() if state == "blocked"]
    if summary.interrupted:
        never = [_label(asset, key) for asset in selected for key in scheduler.partitions.get(asset, [None])
                 if (asset, key) not in scheduler.state]
        echo(f"stopped on request; not launched: {', '.join(never) or 'nothing'}")
    return summary


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


def _require_celery_workers(echo: Callable[[str], None]) -> None:
    """Refuse to start when no worker would take the steps: the runs would wait for ever."""
    from vlm_assets.scale_out.executor import START_WORKERS_HINT, answering_workers, printable_url, require_broker

    broker = require_broker()
    workers = answering_workers(broker)
    if not workers:
        raise ValueError(f"no Celery worker answers on {printable_url(broker)} ($VLM_ASSETS_CELERY_BROKER); "
                         f"{START_WORKERS_HINT}")
    echo(f"steps go to {len(workers)} Celery worker(s): {', '.join(workers)}")


def _label(asset: str, partition: str | None) -> str:
    return asset + (f" [{partition}]" if partition else "")


def _report(outcome: TaskOutcome, summary: RunSummary, echo: Callable[[str], None]) -> None:
    if outcome.materialized:
        summary.materialized.append(outcome.label)
        echo(f"  ✓ materialised {outcome.label}")
    for name, passed, severity in outcome.checks:
        echo(f"  {'✓' if passed else '✗'} check {outcome.asset}:{name} {'passed' if passed else f'FAILED ({severity})'}")
    summary.failed_checks.extend(f"{outcome.asset}:{name} ({outcome.label})" for name in outcome.failed_checks)
    if not outcome.success:
        where = f"; full log: {outcome.log_path}" if outcome.log_path else ""
        summary.failed_runs.append(f"{outcome.label}: {outcome.failure}" + (f" (run {outcome.run_id}{where})" if outcome.run_id else ""))
        echo(f"  ✗ {outcome.label} failed: {outcome.failure}{where}")


def print_outputs(app: AppConfig, echo: Callable[[str], None] = print) -> None:
    echo(f"outputs under {app.storage_root}:")
    for path in StorageLayout(app.storage_root).output_folders:
        if path.exists():
            count = sum(1 for item in path.rglob("*") if item.is_file())
            echo(f"  {path}  ({plural(count, 'file')})")




__all__ = ["CONFIG_ENV_VAR", "RunSummary", "open_instance", "print_outputs", "register_sources", "run_graph"]
