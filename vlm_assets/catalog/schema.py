"""Column contracts of the catalogue and length tables that downstream assets read (docs/formats.md).

``catalog/<source>.parquet`` — one row per input sample:
  sample_id    str        stable id "<source>/<local id>", unique within the source
  source       str        source name (= partition key)
  origin       str        where the sample came from, for error messages (file, file:line, tar:key)
  status       str        "ok" | "rejected"
  reason       str        why it was rejected ("" when ok)
  messages     str        JSON list of {"role": system|user|assistant, "content": str}; media
                          appear as "<image>" / "<video>" placeholders in media order
  n_turns      int        number of user+assistant messages
  media_files  list[str]  media names as the sample wrote them (file or member name when found by stem)
  media_kinds  list[str]  "image" | "video", parallel to media_files
  media_refs   list[str]  where the bytes are (vlm_assets.media.refs: a path or a tar: ref)
  media_keys   list[str]  "<source>/<path relative to the source's media root>" (frame-cache key)
  media_stamps list[str]  each medium's stamp when it was checked: "<size>:<mtime ns>:<ctime ns>" of
                          its file (a tar member: of the tar), "<size>:<ETag>" of an object
  media_views  list[str]  of a video, what the trainer's decoder (Megatron-Energon's) makes of it, as
                          "<frames> <fps> <height> <width>" (vlm_assets.media.trainer_decoder); "" for an
                          image, or a video it would not read as the catalogue's decoding pass did
  media_type   str        "image" | "video" | "mixed" | "text"

``lengths/<source>.parquet`` — one row per catalogue row, same sample_id order:
  sample_id, status, reason, token_len, text_tokens, image_tokens, video_tokens (ints; 0 when rejected)
"""

from __future__ import annotations

STATUS_OK = "ok"
STATUS_REJECTED = "rejected"

CATALOG_COLUMNS = (
    "sample_id",
    "source",
    "origin",
    "status",
    "reason",
    "messages",
    "n_turns",
    "media_files",
    "media_kinds",
    "media_refs",
    "media_keys",
    "media_stamps",
    "media_views",
    "media_type",
)

LENGTH_COLUMNS = ("sample_id", "status", "reason", "token_len", "text_tokens", "image_tokens", "video_tokens")

PLACEHOLDERS = {"image": "<image>", "video": "<video>"}


def media_type_of(kinds: list[str]) -> str:
    unique = set(kinds)
    if not unique:
        return "text"
    if len(unique) > 1:
        return "mixed"
    return unique.pop()
