"""`vlm-assets package …`: make, inspect, check, unpack and train from packages, no Dagster needed."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from vlm_assets.arguments import whole_number
from vlm_assets.config import ConfigError, load_config
from vlm_assets.layout import StorageLayout
from vlm_assets.object_store import ObjectURL, is_object_url, location_of, location_size, upload_file
from vlm_assets.package.compression import (
    COMPRESSIONS,
    detect_compression,
    package_file_name,
)
from vlm_assets.package.manifest import PackageError
from vlm_assets.package.reader import extract_package, read_manifest, verify_package
from vlm_assets.package.recipe import load_recipe, spec_from_config, starter_recipe
from vlm_assets.package.train import default_workdir, train_from_package
from vlm_assets.package.writer import current_time, source_date_epoch, write_package
from vlm_assets.publish import publish
from vlm_assets.wording import plural

_EPILOG = """\
typical use:
  vlm-assets package new -o recipe.yaml [--config vlm_assets.yaml]   # starter recipe, edit it
  vlm-assets package pack recipe.yaml                                # -> <name>.nnpkg.zst beside it
  vlm-assets package pack --config vlm_assets.yaml                   # what the training_package asset builds
  vlm-assets package info run.nnpkg.zst                              # reads only manifest.json
  vlm-assets package verify run.nnpkg.zst                            # recomputes every sha256
  vlm-assets package extract run.nnpkg.zst -o DIR                    # verified; a non-empty DIR needs --force
  vlm-assets package train run.nnpkg.zst                             # verify, extract once into ./run.d, run train_command
  vlm-assets package train s3://bucket/out/packages/run.nnpkg.zst    # the same, streamed from object storage
"""


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _human(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1000
    return f"{size:.1f} TB"


def _new(args: argparse.Namespace) -> int:
    output = Path(args.output)
    if output.exists() and not args.force:
        raise PackageError(f"{output} already exists (use --force to overwrite)")
    app = load_config(args.config) if args.config else None
    name = args.name or (app.package.name if app else "run")
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(starter_recipe(output, name, app), encoding="utf-8")
    print(f"wrote starter recipe {output}; edit it, then: vlm-assets package pack {output}")
    return 0


def _pack(args: argparse.Namespace) -> int:
    if (args.recipe is None) == (args.config is None):
        raise PackageError("give either a RECIPE file or --config APP_CONFIG")
    published_to = None  # a storage root on object storage, when the package goes under it
    if args.recipe is not None:
        spec = load_recipe(Path(args.recipe))
        default_dir = Path(args.recipe).parent
    else:
        app = load_config(args.config)
        spec = spec_from_config(app, warn=lambda message: _log(f"warning: {message}"))
        default_dir = StorageLayout(app.storage_root).packages
        published_to = None if args.output else app.storage_url
    if args.compress:
        spec = dataclasses.replace(spec, compress=args.compress)
    name = package_file_name(spec.name, spec.compress)
    # A hand-made package records when it was made, unless the build pins a time for reproducibility.
    created_at = source_date_epoch() or current_time()
    with tempfile.TemporaryDirectory(prefix="vlm-assets-package-") as scratch:
        # To object storage: written here, then uploaded whole.
        output = Path(scratch) / name if is_object_url(args.output) else Path(args.output) if args.output else default_dir / name
        result = write_package(spec, output, level=args.level, threads=args.threads, created_at=created_at, log=_log)
        where = str(result.path)
        if is_object_url(args.output):
            upload_file(result.path, ObjectURL.parse(args.output))
            where = args.output
        elif published_to is not None:
            publish(app.storage_root, published_to, [result.path])
            where = f"{result.path} (published below {published_to})"
        print(
            f"{where}: {plural(len(result.manifest.files), 'file')}, {_human(result.data_bytes)} -> {_human(result.package_bytes)} "
            f"(ratio {result.compression_ratio:.2f}, {spec.compress})"
        )
    return 0


def _info(args: argparse.Namespace) -> int:
    path = location_of(args.package)
    manifest = read_manifest(path)
    print(f"package:     {path} ({_human(location_size(path))}, {detect_compression(path)} on disk)")
    print(f"name:        {manifest.name}")
    print(f"created_at:  {manifest.created_at or '(not recorded)'}")
    print(f"compress:    {manifest.compress}")
    print(f"format:      {manifest.format_version}")
    print(f"files:       {len(manifest.files)} ({_human(manifest.total_size)} uncompressed)")
    for role in manifest.roles:
        entries = [entry for entry in manifest.files if entry.role == role]
        print(f"  {role}: {plural(len(entries), 'file')}, {_human(sum(entry.size for entry in entries))}")
    print(f"train_command: {manifest.train_command or '(none)'}")
    print("hyperparameters:")
    for key, value in manifest.hyperparameters.items():
        print(f"  {key}: {value}")
    return 0


def _list(args: argparse.Namespace) -> int:
    manifest = read_manifest(location_of(args.package))
    for entry in manifest.files:
        print(f"{entry.size:>14}  {entry.sha256[:12]}  {entry.role:<12}  {entry.archive_path}")
    return 0


def _extract(args: argparse.Namespace) -> int:
    path = location_of(args.package)
    target = Path(args.output) if args.output else default_workdir(path)
    manifest = extract_package(path, target, force=args.force, log=_log)
    print(f"extracted and verified {plural(len(manifest.files), 'file')} into {target}")
    return 0


def _verify(args: argparse.Namespace) -> int:
    try:
        report = verify_package(location_of(args.package), log=_log)
    except PackageError as error:
        # A package that cannot be read to its end fails verification as one with a mismatch does.
        print(f"error: {error}", file=sys.stderr)
        return 1
    for problem in report.problems:
        print(f"MISMATCH {problem}")
    status = "OK" if report.ok else f"FAILED ({len(report.problems)} problem(s))"
    print(f"{report.path}: {status}: {report.checked_files} of {plural(len(report.manifest.files), 'file')} checked, {_human(report.checked_bytes)}")
    return 0 if report.ok else 1


TRAIN_OPTIONS = ("--workdir", "--command", "--rehash")


def _train(args: argparse.Namespace) -> int:
    # Everything after PACKAGE arrives in `extra`. Train's own options written there are read as
    # options up to a `--`; what follows `--` (or a line that starts with no option of ours)
    # belongs to the training command.
    extra = list(args.extra)
    if "--" in extra:
        cut = extra.index("--")
        options, extra = extra[:cut], extra[cut + 1:]
    elif extra and extra[0].split("=", 1)[0] in TRAIN_OPTIONS:
        options, extra = extra, []
    else:
        options = []
    args.train_parser.parse_args([*options, args.package], namespace=args)
    code = train_from_package(
        location_of(args.package),
        workdir=Path(args.workdir) if args.workdir else None,
        command=args.command,
        extra_args=extra,
        rehash=args.rehash,
        log=_log,
    )
    _log(f"training command exited with {code}")
    return code


def _guarded(handler):
    def run(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except (PackageError, ConfigError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    package = subparsers.add_parser(
        "package",
        help="training packages: recipe + dataset in one verified .nnpkg file",
        description="Bundle the packed WDS datasets (with each source's .nv-meta and the metadataset), optionally the "
        "frame cache, and the training recipe into one file (.nnpkg = gzip tar, .nnpkg.zst = zstd tar; detected by magic number, not name). "
        "manifest.json comes first and lists every file with role, size and sha256.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = package.add_subparsers(dest="package_command", required=True, metavar="COMMAND")

    new = commands.add_parser(
        "new",
        help="write a starter recipe (YAML: name, compress, hyperparameters, train_command, data role -> path)",
        description="Write a commented starter recipe. Keys: name; compress (zstd|gzip); hyperparameters (stored in "
        "the manifest); train_command (placeholders {<role>}, {workdir}, {manifest}, {hyperparameters}, {hp[KEY]}); "
        "data (role -> folder or file; relative to the recipe). With --config, data paths point at that config's "
        "packed_wds root and frame cache.",
    )
    new.add_argument("-o", "--output", default="package_recipe.yaml", help="recipe file to write (default: %(default)s)")
    new.add_argument("--name", help="package name (default: the config's package.name, else 'run')")
    new.add_argument("--config", help="app config whose storage layout fills in the data paths")
    new.add_argument("--force", action="store_true", help="overwrite an existing recipe")
    new.set_defaults(func=_guarded(_new))

    pack = commands.add_parser(
        "pack", help="build a package from a recipe or from the app config's package section",
        description="Build a package: the recipe's data (or, with --config, what the config's `package:` section "
        "describes) with manifest.json listing every file's role, size and sha256, compressed as the recipe says.")
    pack.add_argument("recipe", nargs="?", help="recipe YAML (see `package new`)")
    pack.add_argument("--config", help="app config: package what its `package:` section describes instead of a recipe")
    pack.add_argument("-o", "--output", help="package file, or an s3:// URL to upload it to (default: <name>.nnpkg[.zst] "
                      "beside the recipe, or under storage packages/)")
    pack.add_argument("--compress", choices=COMPRESSIONS, help="override the recipe's compression")
    pack.add_argument("--level", type=whole_number(), help="compression level (default: gzip 6, zstd 3)")
    pack.add_argument("--threads", type=whole_number(minimum=0),
                      help="zstd worker threads (default: all CPUs; 0 compresses in this thread)")
    pack.set_defaults(func=_guarded(_pack))

    for name, handler, text in (
        ("info", _info, "summary from manifest.json only (no unpacking)"),
        ("list", _list, "every file in the manifest: size, sha256 prefix, role, archive path"),
        ("verify", _verify, "recompute every checksum; names each mismatching, missing or unexpected file. Exit codes: "
         "0 intact; 1 a file mismatches, is missing or unexpected, or the package cannot be read (damaged, cut short, "
         "absent); 2 a usage error"),
    ):
        sub = commands.add_parser(name, help=text, description=text)
        sub.add_argument("package", help="package file (.nnpkg or .nnpkg.zst), or its s3:// URL")
        sub.set_defaults(func=_guarded(handler))

    extract = commands.add_parser(
        "extract",
        help="verify and safely extract (refuses absolute paths, '..', links, devices, unlisted members)",
        description="Verify the package against its manifest while extracting it into a folder, refusing absolute "
        "paths, '..', links, devices and members the manifest does not list; a failed extraction leaves the folder "
        "as it was.",
    )
    extract.add_argument("package", help="package file, or its s3:// URL (streamed, never downloaded whole)")
    extract.add_argument(
        "-o", "--output", help="target folder (default: ./NAME.d in the current directory, NAME being the package file's "
        "name less .nnpkg or .nnpkg.zst; refused inside a storage root)",
    )
    extract.add_argument(
        "--force",
        action="store_true",
        help="extract into a folder that is not empty: the package's files replace those at the same paths, "
        "nothing else is touched (a failed extraction still leaves the folder as it was)",
    )
    extract.set_defaults(func=_guarded(_extract))

    train = commands.add_parser(
        "train",
        help="verify, extract once into a reusable workdir, run the package's train_command",
        description="Verify and extract the package into WORKDIR (reused while the manifest is unchanged), then run "
        "the training command with placeholders filled: {<role>} (e.g. {packed_wds}, {frame_cache}) = extracted "
        "folder, {metadataset} = the extracted training mix (packed_wds/metadataset.yaml), {workdir}, {manifest}, "
        "{hyperparameters} (JSON), {hp[KEY]}. Exits with the command's exit code. "
        "Options may come before or after PACKAGE; arguments after `--` are appended to the command.",
    )
    train.add_argument(
        "--workdir", help="extraction folder, reused while the manifest is unchanged (default: ./NAME.d in the current "
        "directory, NAME being the package file's name less .nnpkg or .nnpkg.zst; refused inside a storage root)",
    )
    train.add_argument("--command", help="override the package's train_command")
    train.add_argument("--rehash", action="store_true", help="when reusing the workdir, re-check every extracted file's sha256")
    train.add_argument("package", help="package file, or its s3:// URL")
    train.add_argument(
        "extra", nargs=argparse.REMAINDER, metavar="ARG", help="after `--`: appended to the training command"
    )
    train.set_defaults(train_parser=train)
    train.set_defaults(func=_guarded(_train))
