"""`training_package`: the packed dataset (and frame cache) plus the recipe, as one verified file."""

import dagster as dg

from vlm_assets.atomic import remove_stale_temp_files
from vlm_assets.defs.resources import HEAVY_POOL, VlmConfig
from vlm_assets.defs.spec_assets import Built, spec_asset
from vlm_assets.package.compression import COMPRESSIONS
from vlm_assets.package.readiness import input_problems
from vlm_assets.package.recipe import spec_from_config
from vlm_assets.package.writer import PackResult, source_date_epoch, write_package


def _roles_table(result: PackResult) -> str:
    rows = ["| role | files | MB |", "|---|---:|---:|"]
    for role in result.manifest.roles:
        entries = [entry for entry in result.manifest.files if entry.role == role]
        rows.append(f"| {role} | {len(entries)} | {sum(entry.size for entry in entries) / 1e6:.1f} |")
    return "\n".join(rows)


@spec_asset(
    "training_package",
    kinds={"tar"},
    pool=HEAVY_POOL,
    description="packages/<name>.nnpkg (gzip) or .nnpkg.zst (zstd): manifest.json (hyperparameters, "
    "sha256 of every file) + packed WDS (each source's dataset with its .nv-meta, and metadataset.yaml) + frame cache, "
    "per the config's `package:` section. "
    "Refuses to run while a configured source has no shards or the frame cache misses planned videos. "
    "Byte-identical for identical inputs: the manifest's created_at is null unless $SOURCE_DATE_EPOCH is set.",
)
def training_package(context: dg.AssetExecutionContext, vlm_config: VlmConfig) -> Built:
    """Write the package; its bytes depend only on the data and the `package:` settings.

    No wall-clock time goes in, so rematerialising unchanged inputs rewrites the
    same bytes (downstream copies, caches and checksums stay valid). A build that
    wants a timestamp sets $SOURCE_DATE_EPOCH; it becomes the manifest's created_at.
    """
    app, layout = vlm_config.app, vlm_config.layout
    packages_dir = layout.packages
    spec = spec_from_config(app, warn=context.log.warning)
    target = layout.package_file(spec.name, spec.compress)
    problems = input_problems(app, layout)
    if problems:
        raise dg.Failure(
            description="training_package: inputs are not ready, nothing written:\n" + "\n".join(f"- {p}" for p in problems),
            metadata={"problems": dg.MetadataValue.json(problems)},
        )
    for stale in remove_stale_temp_files(packages_dir):
        context.log.info(f"removed temp file of an interrupted run: {stale}")
    result = write_package(spec, target, created_at=source_date_epoch(), log=context.log.info)
    # Only one package per name: a file left by the other compression would be out of date.
    for other in COMPRESSIONS:
        old = layout.package_file(spec.name, other)
        if old != target and old.exists():
            old.unlink()
            context.log.info(f"removed {old} (package now written as {spec.compress})")
    return Built({
        "path": dg.MetadataValue.path(str(result.path)),
        "compress": spec.compress,
        "size_bytes": dg.MetadataValue.int(result.package_bytes),
        "size_mb": dg.MetadataValue.float(round(result.package_bytes / 1e6, 3)),
        "data_mb": dg.MetadataValue.float(round(result.data_bytes / 1e6, 3)),
        "compression_ratio": dg.MetadataValue.float(round(result.compression_ratio, 4)),
        "file_count": dg.MetadataValue.int(len(result.manifest.files)),
        "roles": dg.MetadataValue.md(_roles_table(result)),
        "checksum_seconds": dg.MetadataValue.float(round(result.hash_seconds, 3)),
        "write_seconds": dg.MetadataValue.float(round(result.write_seconds, 3)),
    })
