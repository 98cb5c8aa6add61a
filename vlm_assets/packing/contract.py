"""The consumer's contract for a packed sample, checked as its reader would meet it (docs/formats.md).

`contract_problems` reads a packed record and the member names of its tar sample the way
LoongForge's cookers and packed encoders do, per sample type, and says what they would miss: a
field absent or of the wrong shape, a media member not where its name says, a placeholder without
its medium (or a medium without its placeholder), a turn that is in the conversation but not in the
texts the encoder reads, a pack of more than one media type, `_meta` that does not add up.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

from vlm_assets.packing.records import CONSUMER_EXTENSIONS, SINGLE_IMAGE_SAMPLE_TYPES, turns_of

PACK_MEDIA_TYPES = ("image", "video", "text")
PLACEHOLDER = {"image": "<image>", "video": "<video>"}


def contract_problems(record: Mapping[str, Any], members: Collection[str]) -> list[str]:
    """What the consumer of `record`'s sample type cannot read in it; `members`: the sample's member
    names after `<key>.` (empty ones left out). Each problem names the child it is in."""
    sample_type = record.get("sample_type")
    sample_ids = record.get("sample_ids")
    if not isinstance(sample_ids, list) or not sample_ids:
        return ["`sample_ids` is not a non-empty list"]
    problems = _meta_problems(record, sample_ids)
    conversations = _conversations(record, len(sample_ids), problems)
    media_type = record.get("media_type")
    if media_type not in PACK_MEDIA_TYPES:
        problems.append(f"`media_type` is {media_type!r}, not one of {', '.join(PACK_MEDIA_TYPES)}")
        return problems
    if sample_type in SINGLE_IMAGE_SAMPLE_TYPES:
        problems += _single_image_problems(record, sample_ids, conversations, members, sample_type)
    elif sample_type in ("packed_multi_mix_qa", "packed_chat_mix"):
        problems += _media_group_problems(record, sample_ids, conversations, members, media_type)
        if sample_type == "packed_multi_mix_qa":
            problems += _turn_list_problems(record, sample_ids, conversations)
    else:
        problems.append(f"unknown sample_type {sample_type!r}")
    return problems


def _meta_problems(record: Mapping[str, Any], sample_ids: list[str]) -> list[str]:
    meta = record.get("_meta")
    if not isinstance(meta, dict):
        return ["`_meta` is missing"]
    problems = []
    if meta.get("pack_id") != record.get("id"):
        problems.append(f"`_meta.pack_id` {meta.get('pack_id')!r} is not the record id {record.get('id')!r}")
    if meta.get("sample_ids") != sample_ids:
        problems.append("`_meta.sample_ids` differ from the record's samples")
    lens = meta.get("token_lens")
    if not isinstance(lens, list) or len(lens) != len(sample_ids) or not all(isinstance(n, int) for n in lens):
        problems.append("`_meta.token_lens` is not one integer per child")
    elif meta.get("total_token_len") != sum(lens):
        problems.append(f"`_meta.total_token_len` {meta.get('total_token_len')!r} is not the sum {sum(lens)}")
    return problems


def _conversations(record: Mapping[str, Any], children: int, problems: list[str]) -> list[list[dict[str, Any]]]:
    messages = record.get("messages")
    if not isinstance(messages, list) or len(messages) != children:
        problems.append(f"`messages` is not one entry per child ({children})")
        return [[] for _ in range(children)]
    conversations = []
    for child, entry in enumerate(messages):
        turns = entry.get("messages") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or not all(isinstance(turn, dict) and isinstance(turn.get("content"), str)
                                                  for turn in turns):
            problems.append(f"child {child}: `messages[{child}].messages` is not a list of role/content turns")
            turns = []
        conversations.append(turns)
    return conversations


def _string_list(record: Mapping[str, Any], field: str, children: int) -> list[str] | None:
    value = record.get(field)
    if isinstance(value, list) and len(value) == children and all(isinstance(item, str) for item in value):
        return value
    return None


def _single_image_problems(record: Mapping[str, Any], sample_ids: list[str], conversations: list[list[dict]],
                           members: Collection[str], sample_type: str) -> list[str]:
    children = len(sample_ids)
    problems = []
    prompts, captions = _string_list(record, "prompts", children), _string_list(record, "captions", children)
    images = _string_list(record, "images", children)
    for field, value in (("prompts", prompts), ("captions", captions), ("images", images)):
        if value is None:
            problems.append(f"top-level `{field}` is not one string per child ({children})")
    if record.get("media_type") != "image":
        problems.append(f"`media_type` is {record.get('media_type')!r}; {sample_type} packs images")
    for child in range(children):
        name = f"img{child}.jpg"
        if name not in members:
            problems.append(f"child {child} ({sample_ids[child]}): member {name!r} is missing")
        if images is not None and images[child] != name:
            problems.append(f"child {child} ({sample_ids[child]}): `images[{child}]` is {images[child]!r}, not {name!r}")
        users, answers = turns_of(conversations[child], "user"), turns_of(conversations[child], "assistant")
        if prompts is not None and users[:1] != [prompts[child]]:
            problems.append(f"child {child} ({sample_ids[child]}): `prompts[{child}]` is not its user turn")
        if captions is not None and answers[:1] != [captions[child]]:
            problems.append(f"child {child} ({sample_ids[child]}): `captions[{child}]` is not its answer")
        if len(users) != 1 or len(answers) != 1:
            problems.append(f"child {child} ({sample_ids[child]}): {len(users)} user turns; {sample_type} carries one")
        if sample_type == "packed_vqa" and prompts is not None and prompts[child].count(PLACEHOLDER["image"]) != 1:
            problems.append(f"child {child} ({sample_ids[child]}): its prompt holds "
                            f"{prompts[child].count(PLACEHOLDER['image'])} <image> placeholders for 1 image")
    return problems


def _media_group_problems(record: Mapping[str, Any], sample_ids: list[str], conversations: list[list[dict]],
                          members: Collection[str], media_type: str) -> list[str]:
    problems = []
    media_files = record.get("media_files")
    if not isinstance(media_files, list) or len(media_files) != len(sample_ids):
        return [f"`media_files` is not one list per child ({len(sample_ids)})"]
    for child, names in enumerate(media_files):
        label = f"child {child} ({sample_ids[child]})"
        if not isinstance(names, list):
            problems.append(f"{label}: `media_files[{child}]` is not a list")
            continue
        if media_type == "text" and names:
            problems.append(f"{label}: a text pack names media {names}")
        for name in names:
            extension = name.rsplit(".", 1)[-1].lower()
            if media_type in CONSUMER_EXTENSIONS and extension not in CONSUMER_EXTENSIONS[media_type]:
                problems.append(f"{label}: member {name!r} is not named as {media_type} "
                                f"({', '.join(CONSUMER_EXTENSIONS[media_type])})")
            if name not in members:
                problems.append(f"{label}: member {name!r} is missing")
        for kind, placeholder in PLACEHOLDER.items():
            written = sum(turn["content"].count(placeholder) for turn in conversations[child])
            carried = len(names) if kind == media_type else 0
            if written != carried:
                problems.append(f"{label}: {written} {placeholder} placeholders for {carried} {kind} members")
    return problems


def _turn_list_problems(record: Mapping[str, Any], sample_ids: list[str], conversations: list[list[dict]]) -> list[str]:
    texts = record.get("texts")
    if not isinstance(texts, dict):
        return ["`texts` is missing"]
    problems = [f"child {child} ({sample_ids[child]}): its system turn has no place in `texts`"
                for child, conversation in enumerate(conversations)
                if any(turn.get("role") == "system" for turn in conversation)]
    for field, role in (("prompts", "user"), ("captions", "assistant")):
        lists = texts.get(field)
        if not isinstance(lists, list) or len(lists) != len(sample_ids):
            problems.append(f"`texts.{field}` is not one list of turns per child ({len(sample_ids)})")
            continue
        for child, turns in enumerate(lists):
            expected = turns_of(conversations[child], role)
            if turns != expected:
                problems.append(f"child {child} ({sample_ids[child]}): `texts.{field}[{child}]` holds "
                                f"{len(turns) if isinstance(turns, list) else 'no'} {role} turns of {len(expected)}")
    return problems
