"""`vlm-assets`: run the graph, write the demo, and the package / frames tools."""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import os
import shlex
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

from vlm_assets.arguments import whole_number
from vlm_assets.asset_specs import ASSET_NAMES, may_measure_lengths, runs_energon, selected_asset
from vlm_assets.config import CONFIG_ENV_VAR, AppConfig, ConfigError, load_config
from vlm_assets.orchestration.home import default_home, ensure_dagster_home, project_dir, remember_for_dagster_dev
from vlm_assets.orchestration.outage import InstanceUnreachable, as_outage, require_reachable
from vlm_assets.orchestration.worker_output import log_folder
from vlm_assets.orchestration.workers import default_workers, start_workers
from vlm_assets.parallel import RAY_ADDRESS_ENV_VAR, exit_without_teardown, imports_without_gc
from vlm_assets.progress import PROGRESS_DIR_ENV_VAR

EXIT_INSTANCE_UNREACHABLE = 3
TRACEBACK_ENV_VAR = "VLM_ASSETS_TRACEBACK"  # set to 1: a handled error prints its traceback before its line


def _cmd_demo(args: argparse.Namespace) -> int:
    from vlm_assets.demo import write_demo

    config_path = write_demo(args.directory, note=print)
    print(f"demo dataset under {config_path.parent}")
    print(f"config: {config_path}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    app = load_config(args.config)
    # Before the instance, the workers and their log: a misspelt asset is a usage error that leaves nothing behind.
    select = _selected(args)
    if args.address and args.executor != "ray":
        raise ValueError("--address names a Ray cluster: it goes with --executor ray")
    if not app.sources:
        raise ConfigError(f"{app.path}: sources: `vlm-assets run` builds the configured sources and there are none; "
                          "add a `sources:` list (inbox entries are built by the inbox sensor under `dagster dev`)")
    # The code location reads the same file, so the UI and this run agree on settings.
    os.environ[CONFIG_ENV_VAR] = str(app.path)
    # An instance named explicitly (the variable or the option) is this command's choice alone: writing it
    # into the project's .env would make every later `dagster dev` there show it too, silently.
    named = bool(args.dagster_home or os.environ.get("DAGSTER_HOME"))
    home = ensure_dagster_home(Path(args.dagster_home) if args.dagster_home else default_home(app.path), project_dir(app.path))
    dagster = Path(sys.executable).parent / "dagster"  # the venv's, which a fresh shell has no PATH to
    if not named and remember_for_dagster_dev(home, app.path):
        print(f"Dagster instance: {home}  (see the runs with: cd {shlex.quote(str(project_dir(app.path)))} && "
              f"{shlex.quote(str(dagster))} dev)", flush=True)
    else:
        # Started in the instance's own folder, which holds no .env: `dagster dev` reads the .env of the
        # folder it starts in over the variables given, so a project's would show its own instance.
        print(f"Dagster instance: {home}  (see the runs with: cd {shlex.quote(str(home))} && "
              f"DAGSTER_HOME={shlex.quote(str(home))} {CONFIG_ENV_VAR}={shlex.quote(str(app.path))} "
              f"{shlex.quote(str(dagster))} dev -m vlm_assets.definitions)", flush=True)
    # Before the workers start: each would wait out Dagster's connection retries on its own.
    require_reachable(home)
    if args.plan:
        return _plan(app, home, select)
    workers = args.workers or default_workers()
    if args.executor == "ray":
        from vlm_assets.orchestration.ray_cluster import use_ray_cluster

        print(f"Ray cluster: {use_ray_cluster(args.address)} CPU(s) for the steps' chunks", flush=True)
    started = time.monotonic()
    # The steps in flight write their progress there (vlm_assets.progress), for the bars.
    progress_dir = log_folder(home) / f"progress-{os.getpid()}"
    progress_dir.mkdir(parents=True, exist_ok=True)
    os.environ[PROGRESS_DIR_ENV_VAR] = str(progress_dir)
    # Forked from this process at the first run, once it has imported what they run (orchestration.workers).
    in_worker_processes = args.executor != "celery"
    with start_workers(str(app.path), workers, import_energon=in_worker_processes and runs_energon(select),
                       load_processor=in_worker_processes and may_measure_lengths(select, app, args.force)) as pool, \
            _removed_after(progress_dir):
        print(f"worker output (Dagster's and the libraries' logs): {pool.log_path}", flush=True)
        with imports_without_gc():
            from vlm_assets.definitions import build_definitions
            from vlm_assets.orchestration.celery_runs import CELERY
            from vlm_assets.orchestration.instance import open_instance
            from vlm_assets.orchestration.progress_view import ProgressView
            from vlm_assets.orchestration.report import print_outputs, samples_by_source
            from vlm_assets.orchestration.scheduler import run_graph
            from vlm_assets.orchestration.task import IN_WORKER_PROCESS

        defs = build_definitions(str(app.path))
        with open_instance(home) as instance:
            summary = run_graph(defs, app, instance, select, echo=_echo, workers=workers, force=args.force,
                                log_dir=log_folder(home), submission=IN_WORKER_PROCESS if in_worker_processes else CELERY,
                                pool=pool, progress=ProgressView(progress_dir))
            by_source = samples_by_source(app, instance)
    print_outputs(app)
    print("\n".join(by_source))
    print(f"{summary.runs} run(s), {len(summary.materialized)} materialisation(s), {len(summary.up_to_date)} up to date, "
          f"{len(summary.failed_runs)} failed run(s), {len(summary.failed_checks)} failed check(s), "
          f"{len(summary.check_warnings)} check warning(s), "
          f"{len(summary.blocked)} not built (upstream failed) in {time.monotonic() - started:.1f} s "
          f"with {workers} worker(s)")
    for failure in summary.failed_runs + summary.failed_checks:
        print(f"  FAILED: {failure}", file=sys.stderr)
    for warning in summary.check_warnings:
        print(f"  WARNING: {warning}", file=sys.stderr)
    if summary.interrupted:
        return 130
    return 0 if summary.ok else 1


@contextlib.contextmanager
def _removed_after(directory: Path) -> Iterator[None]:
    try:
        yield
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _plan(app: AppConfig, home: Path, select: list[str] | None) -> int:
    with imports_without_gc():
        from vlm_assets.definitions import build_definitions
        from vlm_assets.orchestration.instance import open_instance
        from vlm_assets.orchestration.scheduler import plan_graph

    defs = build_definitions(str(app.path))
    with open_instance(home) as instance:
        states = plan_graph(defs, app, instance, select, echo=_echo)
    building = [name for name, state in states.items() if state.value != "up to date"]
    print(f"{len(building)} of {len(states)} asset partition(s) to build first; what reads them follows "
          "if their fingerprints change")
    return 0


def _selected(args: argparse.Namespace) -> list[str] | None:
    items = [name.strip() for name in args.select.split(",") if name.strip()] if args.select else None
    for item in items or ():
        selected_asset(item)
    return items


def _echo(line: str) -> None:
    print(line, flush=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-assets", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {importlib.metadata.version('vlm-assets')}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="materialise the asset graph (or a selection and its upstream) through Dagster",
        description="Materialise the configured sources' asset graph (or --select and everything it reads) on the "
        "Dagster instance, one run per asset partition, skipping what is up to date.",
        epilog=f"assets, upstream first: {', '.join(ASSET_NAMES)}. Exit codes: 0 everything built and checked "
        "(WARN check failures are reported as warnings); 1 a run or an ERROR check failed, or something was not "
        f"built because of it; 2 a config or usage error; {EXIT_INSTANCE_UNREACHABLE} the Dagster instance's "
        "database is unreachable; 130 stopped by a signal.",
    )
    run.add_argument("--config", default=os.environ.get(CONFIG_ENV_VAR), help=f"config YAML (default ${CONFIG_ENV_VAR})")
    run.add_argument("--select", help="comma-separated asset keys, or `asset[partition]` for one partition "
                     "(e.g. 'sample_lengths[my_source]'); what they read runs too, for the same partition where it is "
                     "partitioned alike")
    run.add_argument("--dagster-home", help="instance directory (default $DAGSTER_HOME, else the one named in the project .env, else .dagster_home in the project directory: the nearest one at or above the config holding workspace.yaml)")
    run.add_argument("--workers", type=whole_number(minimum=1), default=None,
                     help="runs at a time, each in its own worker process, at least 1 (default: the number of cores)")
    run.add_argument("--force", action="store_true",
                     help="rebuild every selected asset, even those whose inputs and settings are unchanged")
    run.add_argument("--plan", action="store_true",
                     help="build nothing: print each selected asset partition's state as the UI shows it (up to date, "
                     "missing, failed or stale); the ones not up to date are what a run builds first")
    run.add_argument("--executor", choices=("in_process", "ray", "celery"), default="in_process",
                     help="where steps execute: in the run's worker process; there with their chunks as tasks on "
                          "a Ray cluster (--address); or on Celery workers (`vlm-assets worker`; needs "
                          "$VLM_ASSETS_CELERY_BROKER)")
    run.add_argument("--address", help="with --executor ray: the cluster, as `ray start` printed it (HOST:PORT), "
                     "ray://HOST:PORT for Ray Client, or auto for the cluster this machine is a node of "
                     f"(default ${RAY_ADDRESS_ENV_VAR}, else auto)")
    run.set_defaults(func=_cmd_run)

    demo = commands.add_parser(
        "demo", help="write the deterministic demo dataset and its config",
        description="Write the demo dataset (three sources: images, a video, a WebDataset tar) and its config, "
        "DIRECTORY/vlm_assets.yaml, for `vlm-assets run --config`. Files whose bytes are already there are not "
        "rewritten, and a vlm_assets.yaml you edited is kept.")
    demo.add_argument("directory", help="where to write it (created if missing)")
    demo.set_defaults(func=_cmd_demo)

    for module in ("vlm_assets.package.cli", "vlm_assets.frames.cli", "vlm_assets.scale_out.cli"):
        try:
            __import__(module, fromlist=["register"]).register(commands)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        # Output that fits the buffer reaches a reader who left (`| head -1`) only here.
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        return _reader_gone()
    except InstanceUnreachable as error:
        return _failed(error, f"error: {error}", EXIT_INSTANCE_UNREACHABLE)
    except ConfigError as error:
        return _failed(error, f"config error: {error}", 2)
    except (FileNotFoundError, ValueError) as error:
        return _failed(error, f"error: {error}", 2)
    except OSError as error:
        # Disk full, read-only filesystem, permissions: the operator needs the reason and the path.
        reason = error.strerror or str(error)
        return _failed(error, f"error: {reason}: {error.filename}" if error.filename else f"error: {reason}", 1)
    except Exception as error:
        # The instance's PostgreSQL gone (at start, or mid-run past Dagster's retries) surfaces as
        # whatever storage call noticed it first; its chain says so. Anything else stays a traceback.
        outage = as_outage(error, Path(os.environ["DAGSTER_HOME"])) if os.environ.get("DAGSTER_HOME") else None
        if outage is None:
            raise
        return _failed(error, f"error: {outage}", EXIT_INSTANCE_UNREACHABLE)


def _reader_gone() -> int:
    """Whoever read stdout stopped early: end quietly with the status of a tool SIGPIPE ended."""
    # Unflushed output would raise again on the way out.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def _failed(error: BaseException, line: str, code: int) -> int:
    """One line on stderr (after the traceback when $VLM_ASSETS_TRACEBACK is set); the exit code."""
    if os.environ.get(TRACEBACK_ENV_VAR, "").strip().lower() in ("1", "true", "yes"):
        traceback.print_exception(error, file=sys.stderr)
    print(line, file=sys.stderr)
    return code


def console_main() -> NoReturn:
    """The `vlm-assets` command. Its exit skips the interpreter's teardown: unloading what `run`
    imported (Dagster, pandas, SQLAlchemy) would keep the shell waiting another second."""
    exit_without_teardown(main())


if __name__ == "__main__":
    console_main()
