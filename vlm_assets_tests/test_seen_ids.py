"""The ids a catalogue build has seen: exact answers from hashes in memory and ids read back from disk."""

from __future__ import annotations

import pandas as pd
import pytest

from vlm_assets.atomic import write_parquet
from vlm_assets.catalog import seen_ids
from vlm_assets.catalog.seen_ids import SeenIds


def _fill(seen: SeenIds, count: int, prefix: str = "id") -> None:
    for number in range(count):
        assert f"{prefix}{number}" not in seen
        seen[f"{prefix}{number}"] = f"file.jsonl:{number + 1}"


@pytest.mark.parametrize("colliding", [False, True], ids=["python hash", "every id of a length alike"])
def test_ids_are_found_with_their_first_origin_across_merges_and_hash_collisions(tmp_path, monkeypatch, colliding):
    monkeypatch.setattr(seen_ids, "MERGE_EVERY", 50)
    if colliding:  # many ids per hash: every answer must come from the ids themselves
        monkeypatch.setattr(seen_ids, "id_hash", len)
    with SeenIds(tmp_path / "catalog.parquet") as seen:
        _fill(seen, 175)
        assert len(seen) == 175
        assert [f"id{number}" in seen for number in (0, 49, 50, 149, 174)] == [True] * 5
        assert seen["id0"] == "file.jsonl:1" and seen["id123"] == "file.jsonl:124" and seen["id174"] == "file.jsonl:175"
        assert "id175" not in seen and "ID1" not in seen and "" not in seen
        with pytest.raises(KeyError):
            seen["nope"]
        scratch = list(tmp_path.glob(".catalog.parquet*"))
        assert len(scratch) == 1  # a temp file of the catalogue's, removed by a later build if this one is killed
    assert not list(tmp_path.iterdir())


def test_an_earlier_catalogue_counts_as_seen_and_gives_its_origins(tmp_path, monkeypatch):
    monkeypatch.setattr(seen_ids, "MERGE_EVERY", 40)
    monkeypatch.setattr(seen_ids, "id_hash", len)
    catalog = tmp_path / "catalog.parquet"
    write_parquet(pd.DataFrame({"sample_id": [f"old{number}" for number in range(100)],
                                "origin": [f"old.jsonl:{number + 1}" for number in range(100)]}), catalog)
    with SeenIds(catalog, earlier=catalog) as seen:
        assert len(seen) == 100
        assert seen["old7"] == "old.jsonl:8" and seen["old99"] == "old.jsonl:100"
        _fill(seen, 60, prefix="new")
        assert len(seen) == 160 and seen["new59"] == "file.jsonl:60" and seen["old0"] == "old.jsonl:1"
        assert "old100" not in seen and "new60" not in seen
