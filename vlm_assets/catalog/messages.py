"""Normalise one raw record into role/content messages with media placeholders.

Accepted conversation fields: the configured text key, ``messages`` (role/content,
content a string or OpenAI-style parts), LLaVA ``conversations`` (from/value) and
``texts``. Media come from ``images``/``videos``/``image``/``video``,
``media_files``/``name`` with ``media``/``media_type``, or inline content parts.
``<image>`` / ``<video>`` placeholders mark positions; without any, media go first
in the first user turn. Text around placeholders is kept verbatim.
The accepted record shapes are described in docs/formats.md (Inputs).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from vlm_assets.catalog.schema import PLACEHOLDERS

ROLE_ALIASES = {
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "system": "system",
}
CONVERSATION_KEYS = ("messages", "conversations", "texts")
PLACEHOLDER_PATTERN = re.compile(r"<image>|<video>")
# Inline media found in content parts are held as sentinels until names are matched to placeholders.
_INLINE = "\x00inline:{kind}:{index}\x00"


class SampleError(ValueError):
    """The record cannot become a sample; the message is the reject reason."""


@dataclass(frozen=True)
class MediaItem:
    kind: str  # "image" | "video"
    name: str  # as written in the record


@dataclass(frozen=True)
class NormalizedSample:
    messages: list[dict[str, str]]
    media: list[MediaItem]  # in placeholder order

    @property
    def n_turns(self) -> int:
        return sum(1 for message in self.messages if message["role"] != "system")


def normalize_record(
    record: Any, text_key: str = "messages", fallback_media: Callable[[], list[MediaItem]] | None = None
) -> NormalizedSample:
    """`fallback_media` supplies media when the record names none (e.g. a same-stem file)."""
    if not isinstance(record, dict):
        raise SampleError(f"record is a {type(record).__name__}, expected a JSON object")
    raw_messages = _pick_conversation(record, text_key)
    inline: list[MediaItem] = []
    messages = [_normalize_message(item, position, inline) for position, item in enumerate(raw_messages)]
    if not any(message["role"] in ("user", "assistant") for message in messages):
        raise SampleError("no messages: the conversation has no user or assistant turn")
    declared = _declared_media(record)
    if not declared and not inline and fallback_media is not None:
        declared = fallback_media()
    return _bind_media(messages, inline, declared)


def _pick_conversation(record: dict[str, Any], text_key: str) -> list[Any]:
    keys = (text_key,) + tuple(key for key in CONVERSATION_KEYS if key != text_key)
    for key in keys:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            # A bare string under `texts` is a caption: the model's answer to the media.
            return [{"role": "assistant", "content": value}]
        if isinstance(value, list) and value:
            return value
        raise SampleError(f"no messages: {key!r} is empty or not a list")
    raise SampleError(f"no messages: none of the keys {', '.join(keys)} is present")


def _normalize_message(item: Any, position: int, inline: list[MediaItem]) -> dict[str, str]:
    if not isinstance(item, dict):
        raise SampleError(f"message {position} is a {type(item).__name__}, expected an object")
    raw_role = item.get("role", item.get("from"))
    role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
    if role is None:
        raise SampleError(f"message {position} has an unknown role {raw_role!r}")
    content = item.get("content", item.get("value"))
    if isinstance(content, str):
        return {"role": role, "content": content}
    if isinstance(content, list):
        return {"role": role, "content": "".join(_part_text(part, position, inline) for part in content)}
    raise SampleError(f"message {position} has no text content")


def _part_text(part: Any, position: int, inline: list[MediaItem]) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise SampleError(f"message {position} has a content part of type {type(part).__name__}")
    part_type = part.get("type")
    if part_type == "text" or (part_type is None and "text" in part):
        return str(part.get("text", ""))
    for kind in ("image", "video"):
        if part_type in (kind, f"{kind}_url") or kind in part or f"{kind}_url" in part:
            name = _part_media_name(part, kind)
            if name is None:
                return PLACEHOLDERS[kind]
            inline.append(MediaItem(kind, name))
            return _INLINE.format(kind=kind, index=len(inline) - 1)
    raise SampleError(f"message {position} has an unsupported content part {part_type!r}")


def _part_media_name(part: dict[str, Any], kind: str) -> str | None:
    for key in (kind, f"{kind}_url", "url", "path"):
        value = part.get(key)
        if isinstance(value, dict):
            value = value.get("url") or value.get("path")
        if isinstance(value, str) and value:
            return value
    return None


def _flatten_names(value: Any, field: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        names: list[str] = []
        for item in value:
            names.extend(_flatten_names(item, field))
        return names
    raise SampleError(f"media field {field!r} holds a {type(value).__name__}, expected names")


def _declared_media(record: dict[str, Any]) -> list[MediaItem]:
    media: list[MediaItem] = []
    for field, kind in (("images", "image"), ("image", "image"), ("videos", "video"), ("video", "video")):
        media.extend(MediaItem(kind, name) for name in _flatten_names(record.get(field), field))
    for field in ("media_files", "name"):
        names = _flatten_names(record.get(field), field)
        if not names:
            continue
        kinds = record.get("media_type", record.get("media"))
        if isinstance(kinds, list):
            kinds = [kind for kind in kinds]
            if len(kinds) != len(names):
                raise SampleError(f"{field} has {len(names)} names but media_type has {len(kinds)} entries")
        else:
            kinds = [kinds] * len(names)
        for name, kind in zip(names, kinds):
            kind = kind if kind in ("image", "video") else None
            media.append(MediaItem(kind or "", name))
        break
    return media


def _bind_media(messages: list[dict[str, str]], inline: list[MediaItem], declared: list[MediaItem]) -> NormalizedSample:
    counts = {kind: sum(message["content"].count(token) for message in messages) for kind, token in PLACEHOLDERS.items()}
    declared_counts = {kind: sum(1 for item in declared if item.kind == kind) for kind in PLACEHOLDERS}
    untyped = [item for item in declared if not item.kind]
    if untyped:
        # media_files without a media_type: the kind comes from the resolver (extension or content).
        if any(counts.values()):
            raise SampleError("media_files without media_type cannot be matched to <image>/<video> placeholders")
        prefix = "".join(f"\x00untyped:{index}\x00" for index in range(len(untyped)))
        _prepend_to_first_user(messages, prefix)
        return _expand(messages, inline, {"untyped": untyped})

    if counts["image"] == 0 and counts["video"] == 0 and declared:
        _prepend_to_first_user(messages, "".join(PLACEHOLDERS[item.kind] for item in declared))
        counts = declared_counts
    for kind in PLACEHOLDERS:
        if counts[kind] != declared_counts[kind]:
            raise SampleError(
                f"{counts[kind]} {PLACEHOLDERS[kind]} placeholder(s) in the text but {declared_counts[kind]} {kind}(s) listed"
            )
    by_kind = {kind: [item for item in declared if item.kind == kind] for kind in PLACEHOLDERS}
    return _expand(messages, inline, by_kind)


def _prepend_to_first_user(messages: list[dict[str, str]], prefix: str) -> None:
    for message in messages:
        if message["role"] == "user":
            message["content"] = prefix + message["content"]
            return
    insert_at = 1 if messages and messages[0]["role"] == "system" else 0
    messages.insert(insert_at, {"role": "user", "content": prefix})


def _expand(messages: list[dict[str, str]], inline: list[MediaItem], queues: dict[str, list[MediaItem]]) -> NormalizedSample:
    """Replace sentinels and placeholders in reading order, collecting media in that order."""
    ordered: list[MediaItem] = []
    cursors = {kind: 0 for kind in queues}
    token_pattern = re.compile(r"\x00inline:(image|video):(\d+)\x00|\x00untyped:(\d+)\x00|<image>|<video>")

    def replace(match: re.Match[str]) -> str:
        if match.group(1):
            item = inline[int(match.group(2))]
            ordered.append(item)
            return PLACEHOLDERS[item.kind]
        if match.group(3) is not None:
            ordered.append(queues["untyped"][int(match.group(3))])
            return "\x00media\x00"
        kind = "image" if match.group(0) == "<image>" else "video"
        queue = queues.get(kind, [])
        if cursors.get(kind, 0) >= len(queue):
            raise SampleError(f"more {match.group(0)} placeholders than {kind}s listed")
        ordered.append(queue[cursors[kind]])
        cursors[kind] += 1
        return match.group(0)

    expanded = [{"role": m["role"], "content": token_pattern.sub(replace, m["content"])} for m in messages]
    return NormalizedSample(messages=expanded, media=ordered)


def finalize_untyped(sample: NormalizedSample, kinds: list[str]) -> NormalizedSample:
    """Give media without a declared type their resolved kind and placeholder."""
    kind_iter = iter(kinds)
    messages = [
        {"role": m["role"], "content": re.sub("\x00media\x00", lambda _m: PLACEHOLDERS[next(kind_iter)], m["content"])}
        for m in sample.messages
    ]
    media = [MediaItem(kind, item.name) for kind, item in zip(kinds, sample.media)]
    return NormalizedSample(messages=messages, media=media)


def split_on_placeholders(content: str) -> list[dict[str, str]]:
    """Chat-template parts for one message: text pieces and {"type": image|video}."""
    parts: list[dict[str, str]] = []
    position = 0
    for match in PLACEHOLDER_PATTERN.finditer(content):
        if match.start() > position:
            parts.append({"type": "text", "text": content[position:match.start()]})
        parts.append({"type": "image" if match.group(0) == "<image>" else "video"})
        position = match.end()
    if position < len(content):
        parts.append({"type": "text", "text": content[position:]})
    return parts
