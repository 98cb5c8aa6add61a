"""`package_verifies`: reopen the written package and recompute every checksum."""

import dagster as dg

from vlm_assets.defs.resources import VlmConfig
from vlm_assets.package.manifest import PackageError
from vlm_assets.package.reader import verify_package

_SHOWN_PROBLEMS = 20


@dg.asset_check(asset=dg.AssetKey("training_package"), blocking=True, description="Every file's sha256 in the package matches its manifest.")
def package_verifies(context: dg.AssetCheckExecutionContext, vlm_config: VlmConfig) -> dg.AssetCheckResult:
    package, layout = vlm_config.app.package, vlm_config.layout
    path = layout.package_file(package.name, package.compress)
    try:
        with vlm_config.locked_to_read(context.log, "training_package"):
            report = verify_package(path, log=context.log.info)
    except PackageError as error:
        return dg.AssetCheckResult(passed=False, metadata={"path": str(path), "error": str(error)})
    metadata: dict[str, object] = {
        "path": dg.MetadataValue.path(str(path)),
        "files_checked": report.checked_files,
        "files_in_manifest": len(report.manifest.files),
        "mb_checked": round(report.checked_bytes / 1e6, 3),
        "problem_count": len(report.problems),
    }
    if report.problems:
        shown = "\n".join(f"- `{problem}`" for problem in report.problems[:_SHOWN_PROBLEMS])
        more = len(report.problems) - _SHOWN_PROBLEMS
        metadata["problems"] = dg.MetadataValue.md(shown + (f"\n- … and {more} more" if more > 0 else ""))
    return dg.AssetCheckResult(passed=report.ok, metadata=metadata)
