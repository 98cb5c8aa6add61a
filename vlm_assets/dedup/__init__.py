"""Duplicate samples found before the token lengths: signatures, the keep order and its decisions."""
