"""Readers for the three input kinds (docs/formats.md, Inputs): each yields raw records with a media resolver.

One module per kind: `flat_dir` (a folder of JSON files), `jsonl` (JSON lines or a JSON array),
`wds` (WebDataset tar shards, read in place). Every input record becomes exactly one raw record
(ok or carrying its reject reason), so the catalogue accounts for all of them. What a record's
media names may resolve to is vlm_assets.catalog.media_resolution.
"""

from __future__ import annotations

from collections.abc import Iterator

from vlm_assets.catalog.media_resolution import SourceScope
from vlm_assets.catalog.readers.flat_dir import read_flat_dir
from vlm_assets.catalog.readers.jsonl import read_jsonl
from vlm_assets.catalog.readers.raw_record import RawRecord
from vlm_assets.catalog.readers.wds import read_wds
from vlm_assets.catalog.records import RecordLimits
from vlm_assets.config import SourceConfig
from vlm_assets.object_store import exists


def read_source(source: SourceConfig) -> Iterator[RawRecord]:
    if not exists(source.path):
        raise FileNotFoundError(f"source {source.name!r}: {source.path} does not exist")
    readers = {"flat_dir": read_flat_dir, "jsonl": read_jsonl, "wds": read_wds}
    yield from readers[source.kind](source, SourceScope(source), RecordLimits.of(source))
