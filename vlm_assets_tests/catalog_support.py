"""A small source's whole catalogue as a frame, for tests and benches (the product streams a
catalogue to its Parquet file: vlm_assets.catalog.table.write_catalog)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from vlm_assets.catalog.build import MediaValidator, iter_catalog_chunks
from vlm_assets.catalog.schema import CATALOG_COLUMNS
from vlm_assets.config import SourceConfig

LIST_COLUMNS = ("media_files", "media_kinds", "media_refs", "media_keys", "media_stamps", "media_views")


def build_catalog(source: SourceConfig, text_key: str = "messages", validator: MediaValidator | None = None) -> pd.DataFrame:
    """The whole catalogue in memory. `validator` (default: 64 video frames, nothing remembered) may
    carry a check log, compacted at the end."""
    validator = validator or MediaValidator()
    rows = []
    try:
        for chunk in iter_catalog_chunks(source, text_key, validator):
            rows.extend(chunk)
    finally:
        if validator.check_log is not None:
            validator.check_log.close()
    if validator.check_log is not None:
        validator.check_log.compact()
    return pd.DataFrame(rows, columns=list(CATALOG_COLUMNS))


def read_catalog(path: Path) -> pd.DataFrame:
    """A catalogue file as a frame, its list columns as Python lists."""
    frame = pd.read_parquet(path)
    for column in LIST_COLUMNS:
        frame[column] = frame[column].map(list)
    return frame
