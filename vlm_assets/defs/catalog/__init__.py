"""Catalogue domain: the sources' files → `sample_catalog` → `sample_length_chunk` → `sample_lengths` (per source)."""
