"""Packing lineage domain logic: bins, packed records, WebDataset shards, Energon metadata (no Dagster here)."""
