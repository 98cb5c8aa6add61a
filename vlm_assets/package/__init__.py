"""Training packages: one verified file holding the packed dataset and the training recipe."""

from vlm_assets.package.compression import (
    COMPRESSIONS,
    detect_compression,
    package_file_name,
)
from vlm_assets.package.manifest import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    FileEntry,
    Manifest,
    PackageError,
)
from vlm_assets.package.reader import (
    VerifyReport,
    extract_package,
    read_manifest,
    verify_package,
)
from vlm_assets.package.recipe import load_recipe, spec_from_config
from vlm_assets.package.train import prepare_workdir, train_from_package
from vlm_assets.package.writer import (
    PackagePart,
    PackageSpec,
    PackResult,
    write_package,
)

__all__ = [
    "COMPRESSIONS",
    "FORMAT_VERSION",
    "MANIFEST_NAME",
    "FileEntry",
    "Manifest",
    "PackResult",
    "PackageError",
    "PackagePart",
    "PackageSpec",
    "VerifyReport",
    "detect_compression",
    "extract_package",
    "load_recipe",
    "package_file_name",
    "prepare_workdir",
    "read_manifest",
    "spec_from_config",
    "train_from_package",
    "verify_package",
    "write_package",
]
