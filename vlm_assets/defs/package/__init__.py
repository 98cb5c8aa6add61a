"""Dagster layer for training packages (the domain code is vlm_assets.package)."""

import dagster as dg

from vlm_assets.defs.package.assets import training_package
from vlm_assets.defs.package.checks import package_verifies

defs = dg.Definitions(assets=[training_package], asset_checks=[package_verifies])
