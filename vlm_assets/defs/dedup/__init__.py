"""Dedup domain: `sample_catalog` → `sample_dedup` → `sample_lengths` (per source)."""
