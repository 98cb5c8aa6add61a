"""`vlm-assets`: run the graph, write the demo, and the package / frames tools."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from vlm_assets.config import CONFIG_ENV_VAR, ConfigError, load_config


def _cmd_demo(args: argparse.Namespace) -> int:
    from vlm_assets.demo import write_demo

    config_path = write_demo(args.directory)
    print(f"demo dataset written under {config_path.parent}")
    print(f"config: {config_path}")
    print(f"next:   vlm-assets run --config {config_path}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    app = load_config(args.config)
    # The code location reads the same file, so the UI and this run agree on settings.
    os.environ[CONFIG_ENV_VAR] = str(app.path)
    from vlm_assets.runner import ensure_dagster_home, print_outputs, run_graph

    home = ensure_dagster_home(Path(args.dagster_home) if args.dagster_home else app.path.parent / ".dagster_home")
    print(f"Dagster instance: {home}  (see the runs with: DAGSTER_HOME={home} dagster dev)")
    import dagster as dg

    from vlm_assets.definitions import build_definitions

    defs = build_definitions(str(app.path))
    select = [name.strip() for name in args.select.split(",") if name.strip()] if args.select else None
    with dg.DagsterInstance.get() as instance:
        summary = run_graph(defs, app, instance, select)
    print_outputs(app)
    print(f"{summary.runs} run(s), {len(summary.materialized)} materialisation(s), "
          f"{len(summary.failed_runs)} failed run(s), {len(summary.failed_checks)} failed check(s)")
    for failure in summary.failed_runs + summary.failed_checks:
        print(f"  FAILED: {failure}", file=sys.stderr)
    return 0 if summary.ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlm-assets", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="materialise the asset graph (or a selection and its upstream) through Dagster")
    run.add_argument("--config", default=os.environ.get(CONFIG_ENV_VAR), help=f"config YAML (default ${CONFIG_ENV_VAR})")
    run.add_argument("--select", help="comma-separated asset keys; their upstream assets run too")
    run.add_argument("--dagster-home", help="instance directory (default $DAGSTER_HOME, else .dagster_home beside the config)")
    run.set_defaults(func=_cmd_run)

    demo = commands.add_parser("demo", help="write the deterministic demo dataset and its config")
    demo.add_argument("directory", help="where to write it")
    demo.set_defaults(func=_cmd_demo)

    for module in ("vlm_assets.package.cli", "vlm_assets.frames.cli"):
        try:
            __import__(module, fromlist=["register"]).register(commands)
        except ModuleNotFoundError as error:
            if error.name != module:
                raise
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
