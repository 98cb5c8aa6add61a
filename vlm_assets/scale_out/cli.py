"""`vlm-assets worker --config FILE`: a Celery worker for the runs of `vlm-assets run --executor celery`
and the steps of the runs that the daemon or the UI launch with $VLM_ASSETS_CELERY_BROKER set."""

from __future__ import annotations

import argparse
import multiprocessing
import os

from vlm_assets.arguments import whole_number
from vlm_assets.config import CONFIG_ENV_VAR, default_config_path, load_config
from vlm_assets.orchestration.home import POSTGRES_HOST_ENV, default_home, ensure_dagster_home, project_dir
from vlm_assets.orchestration.outage import require_reachable
from vlm_assets.orchestration.workers import default_workers
from vlm_assets.parallel import STEP_PROCESSES_ENV_VAR, imports_without_gc
from vlm_assets.scale_out import core_shares

WORKER_ARGS = (
    # One task (a run or a step) per free process: the rest stay in the queue for the other workers.
    "--prefetch-multiplier=1",
    "--loglevel=INFO",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    worker = subparsers.add_parser(
        "worker", help="execute celery runs and steps (Celery worker; needs $VLM_ASSETS_CELERY_BROKER)",
        description="Start a Celery worker on $VLM_ASSETS_CELERY_BROKER that executes the runs of "
        "`vlm-assets run --executor celery` and the steps of the runs the daemon or the UI launch. It opens the "
        "config's Dagster instance, which must be the one the runs are on (a shared PostgreSQL for workers on other "
        "machines), and runs until stopped.")
    worker.add_argument("--config", default=os.environ.get(CONFIG_ENV_VAR),
                        help=f"config YAML, the same file the runs use (default ${CONFIG_ENV_VAR})")
    worker.add_argument("--concurrency", type=whole_number(minimum=1), default=None,
                        help="runs or steps at a time, each in its own process (default: the number of cores)")
    worker.set_defaults(func=start_worker)


def start_worker(args: argparse.Namespace) -> int:
    from vlm_assets.orchestration.celery_runs import register_run_task, require_broker

    app = load_config(args.config)
    broker = require_broker()
    # Steps of runs launched by the daemon rebuild the code location, which reads this variable.
    os.environ[CONFIG_ENV_VAR] = str(app.path)
    from vlm_assets.orchestration.instance import open_instance

    home = ensure_dagster_home(default_home(app.path), project_dir(app.path))
    require_reachable(home)
    with open_instance(home) as instance:
        storage = type(instance.run_storage).__name__
    print(f"Dagster instance: {home} ({storage}); storage root: {app.storage_root}", flush=True)
    if not os.environ.get(POSTGRES_HOST_ENV):
        print(f"note: {POSTGRES_HOST_ENV} is not set, so only runs started on this machine (sqlite instance) "
              "can use this worker", flush=True)
    concurrency = args.concurrency or default_workers()
    # Loaded here, before Celery forks its pool processes, rather than by each of them on its first
    # step: the code location, and the processor (seconds) that token counting uses.
    with imports_without_gc():
        from vlm_assets.definitions import build_definitions

        build_definitions(default_config_path()).resources["hf_processor"].load()
        from celery.signals import task_postrun, task_prerun, worker_process_init
        from dagster_celery.app import app as celery_app

    celery_app.conf.update(broker_url=broker, result_backend=broker)
    # Next to dagster-celery's step task (runs the daemon launches): whole runs of `vlm-assets run`.
    register_run_task(celery_app)
    worker_process_init.connect(_allow_child_processes, weak=False)
    if STEP_PROCESSES_ENV_VAR not in os.environ:  # else the user's number holds for every task
        task_prerun.connect(core_shares.start_task, weak=False)
        task_postrun.connect(core_shares.end_task, weak=False)
    celery_app.worker_main(["worker", f"--concurrency={concurrency}", f"--hostname=vlm-assets-{os.getpid()}@%h",
                            *WORKER_ARGS])
    return 0


def _allow_child_processes(**_: object) -> None:
    # Celery marks its pool processes daemonic and Python forbids daemonic processes to start
    # children, but steps do (Energon's prepare in energon_dataset). The pool process is not
    # started yet from its own point of view, so the public setter accepts the change.
    multiprocessing.current_process().daemon = False
    # Billiard's pool process stands in as multiprocessing's current process, with billiard's own
    # authkey type, which refuses to be pickled into the spawn data of a chunked step's processes.
    # multiprocessing's own setter stores the same key as multiprocessing's type.
    process = multiprocessing.current_process()
    multiprocessing.process.BaseProcess.authkey.fset(process, bytes(process.authkey))
