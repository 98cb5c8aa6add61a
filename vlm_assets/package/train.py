"""Train from a package: verify and extract it once into a reusable workdir, then run its command.

The workdir is `./<package name>.d` in the current directory unless one is given: never
beside the package, which lies among a storage root's outputs. It holds `data/<role>/…`
plus a copy of the manifest written last, as a marker of a complete extraction. A later run reuses the workdir while the
package's manifest is byte-identical (cheap to check: only the first member is
read) and every listed file is present with its size; otherwise it extracts
again. Only `data/` and the marker are ever deleted from a workdir.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vlm_assets.atomic import atomic_write_bytes
from vlm_assets.layout import METADATASET_NAME, StorageLayout
from vlm_assets.package.compression import EXTENSIONS
from vlm_assets.package.manifest import (
    DATA_PREFIX,
    MANIFEST_NAME,
    Manifest,
    PackageError,
    role_root,
)
from vlm_assets.package.reader import extract_package, read_manifest
from vlm_assets.package.recipe import PACKED_WDS
from vlm_assets.package.writer import sha256_file

Log = Callable[[str], None]


@dataclass(frozen=True)
class PreparedWorkdir:
    workdir: Path
    manifest: Manifest
    extracted: bool  # False when an earlier extraction was reused

    def dataset_path(self, role: str) -> Path:
        return self.workdir / role_root(role)

    @property
    def metadataset(self) -> Path | None:
        """The extracted training mix (packed_wds/metadataset.yaml), if the package has one."""
        path = f"{role_root(PACKED_WDS)}/{METADATASET_NAME}"
        return self.workdir / path if path in self.manifest.by_path() else None


def default_workdir(package: Path) -> Path:
    """`<package name>.d` in the current directory (the name is the file's, less .nnpkg or .nnpkg.zst).

    Refused inside a storage root: a copy of the dataset among the outputs it was packed from would
    double their size and sit in the tree the assets own."""
    name = package.name
    for extension in sorted(EXTENSIONS.values(), key=len, reverse=True):
        if name.endswith(extension) and name != extension:
            name = name.removesuffix(extension)
            break
    workdir = Path.cwd() / f"{name}.d"
    for folder in workdir.parents:
        if StorageLayout(folder).owner.is_file():
            raise PackageError(
                f"the default workdir {workdir} would lie inside the storage root {folder}; "
                "run from another directory or pass --workdir DIR"
            )
    return workdir


def _workdir_matches(workdir: Path, manifest_bytes: bytes, manifest: Manifest, rehash: bool) -> bool:
    marker = workdir / MANIFEST_NAME
    if not marker.is_file() or marker.read_bytes() != manifest_bytes:
        return False
    for entry in manifest.files:
        path = workdir / entry.archive_path
        if path.is_symlink() or not path.is_file() or path.stat().st_size != entry.size:
            return False
        if rehash and sha256_file(path) != entry.sha256:
            return False
    return True


def prepare_workdir(package: Path, workdir: Path | None = None, *, rehash: bool = False, log: Log | None = None) -> PreparedWorkdir:
    """Extract `package` into `workdir` unless a complete extraction of the same manifest is there."""
    log = log or (lambda message: None)
    manifest = read_manifest(package)
    workdir = (default_workdir(package) if workdir is None else workdir).resolve()
    manifest_bytes = manifest.to_bytes()
    if _workdir_matches(workdir, manifest_bytes, manifest, rehash):
        log(f"reusing {workdir} (manifest unchanged)")
        return PreparedWorkdir(workdir, manifest, extracted=False)
    marker = workdir / MANIFEST_NAME
    marker.unlink(missing_ok=True)
    data_dir = workdir / DATA_PREFIX
    if data_dir.is_symlink():
        raise PackageError(f"{data_dir} is a symlink; refusing to extract through it")
    if data_dir.exists():
        log(f"manifest changed or extraction incomplete: clearing {data_dir}")
        shutil.rmtree(data_dir)
    log(f"verifying and extracting {package} into {workdir}")
    # The workdir is meant to hold more than the package (training outputs, logs); data/ was cleared above.
    extracted = extract_package(package, workdir, force=True, log=log)
    if extracted.to_bytes() != manifest_bytes:
        raise PackageError(f"{package}: package changed while it was being extracted")
    atomic_write_bytes(marker, manifest_bytes)
    return PreparedWorkdir(workdir, manifest, extracted=True)


def command_values(prepared: PreparedWorkdir) -> dict[str, object]:
    """Placeholder values for the training command (and the environment it gets)."""
    values: dict[str, object] = {role: str(prepared.dataset_path(role)) for role in prepared.manifest.roles}
    if prepared.metadataset is not None:
        values["metadataset"] = str(prepared.metadataset)
    values.update(
        workdir=str(prepared.workdir),
        manifest=str(prepared.workdir / MANIFEST_NAME),
        hyperparameters=json.dumps(prepared.manifest.hyperparameters, sort_keys=True),
        hp=prepared.manifest.hyperparameters,
    )
    return values


def render_command(template: str, prepared: PreparedWorkdir, extra_args: list[str] | None = None) -> list[str]:
    """Split the command like a shell would, then fill placeholders token by token (paths with spaces stay whole)."""
    if not template.strip():
        raise PackageError(
            "no training command: the package has no train_command; pass --command 'python train.py --data {packed_wds}'"
        )
    values = command_values(prepared)
    argv = []
    for token in shlex.split(template):
        try:
            argv.append(token.format(**values))
        except (KeyError, IndexError) as error:
            available = ", ".join("{" + key + "}" for key in values if key != "hp")
            raise PackageError(
                f"training command placeholder {error} is not available (available: {available}, {{hp[KEY]}} "
                f"for hyperparameters {sorted(prepared.manifest.hyperparameters)})"
            ) from error
        except ValueError as error:
            raise PackageError(f"training command token {token!r}: {error} (write literal braces as {{{{ }}}})") from error
    return argv + list(extra_args or [])


def command_environment(prepared: PreparedWorkdir) -> dict[str, str]:
    env = dict(os.environ)
    for role in prepared.manifest.roles:
        env[f"VLM_PACKAGE_DATA_{role.upper().replace('-', '_')}"] = str(prepared.dataset_path(role))
    if prepared.metadataset is not None:
        env["VLM_PACKAGE_METADATASET"] = str(prepared.metadataset)
    env["VLM_PACKAGE_WORKDIR"] = str(prepared.workdir)
    env["VLM_PACKAGE_MANIFEST"] = str(prepared.workdir / MANIFEST_NAME)
    env["VLM_PACKAGE_HYPERPARAMETERS"] = json.dumps(prepared.manifest.hyperparameters, sort_keys=True)
    return env


def train_from_package(
    package: Path,
    *,
    workdir: Path | None = None,
    command: str | None = None,
    extra_args: list[str] | None = None,
    rehash: bool = False,
    log: Log | None = None,
) -> int:
    """Verify + extract (or reuse), run the training command, return its exit code."""
    log = log or (lambda message: None)
    prepared = prepare_workdir(package, workdir, rehash=rehash, log=log)
    argv = render_command(command if command is not None else prepared.manifest.train_command, prepared, extra_args)
    log("running: " + shlex.join(argv))
    try:
        return subprocess.run(argv, env=command_environment(prepared), check=False).returncode
    except FileNotFoundError as error:
        raise PackageError(f"training command not found: {argv[0]}") from error
