"""Dagster layer for training packages (the domain code is vlm_assets.package)."""
