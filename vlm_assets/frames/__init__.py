"""Video frame cache (docs/formats.md): sampled frames of every unique video as one JPEG mosaic each.

probe -> plan (append-only shard assignment) -> shard (decode, tile, JPEG, tar) -> index -> reader.
"""
