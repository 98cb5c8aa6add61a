"""A sample's text tokens, with the processor or without loading it.

Loading a processor costs seconds (transformers imports torch and torchvision), and every chunk
process of `sample_lengths` would pay that only to render the chat template and tokenise. The
text part needs neither: the template goes through transformers' own Jinja renderer and the
tokenizer's own `tokenizers` model. `text_spec_of` takes both from a loaded processor, and only
when they give exactly what the processor gives on probe conversations; the spec is kept on disk
per processor fingerprint, so chunk processes of later steps start counting at once.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from vlm_assets.atomic import atomic_write_text
from vlm_assets.config import ModelConfig
from vlm_assets.tokens.processor import default_cache_dir, import_transformers, processor_fingerprint

TEXT_SPEC_VERSION = 3
Conversation = list[dict[str, Any]]

# Conversations on which the spec must render and count exactly as the processor does.
PROBE_CONVERSATIONS: tuple[Conversation, ...] = (
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is shown here?"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "A red square on grey."}]}],
    [{"role": "system", "content": [{"type": "text", "text": "Answer briefly."}]},
     {"role": "user", "content": [{"type": "text", "text": "Compare "}, {"type": "video"},
                                  {"type": "text", "text": " and "}, {"type": "image"}]},
     {"role": "assistant", "content": [{"type": "text", "text": "Both show  spaces,\ttabs\nand ünïcödé 漢字 🙂."}]},
     {"role": "user", "content": [{"type": "text", "text": "<|im_start|> is text here"}]},
     {"role": "assistant", "content": [{"type": "text", "text": ""}]}],
)


class TextCounter(Protocol):
    control_tokens: tuple[str, ...]

    def render(self, conversation: Conversation, template: str | None = None) -> str: ...

    def token_counts(self, texts: Sequence[str]) -> list[int]: ...

    def token_spans(self, text: str) -> list[tuple[int, int]]: ...


# Texts tokenised per call: the encodings of a whole length chunk (16,384 samples) at once held
# hundreds of MB, and a long-lived worker kept that high-water mark.
TOKENIZE_BATCH = 1024
# A longer text is tokenised in pieces of about this many characters where the spec allows
# (TextSpec.cut_before): one encoding holds about 75 bytes per character of its text (the
# normalised text's alignments, the tokens and their offsets), 3.7 GB for a 50 MB conversation.
PIECE_CHARS = 1 << 18


def _batches(texts: Sequence[str]) -> Iterator[list[str]]:
    for start in range(0, len(texts), TOKENIZE_BATCH):
        yield list(texts[start:start + TOKENIZE_BATCH])


class ProcessorText:
    """Text rendering and counting by the loaded processor itself."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.control_tokens = control_tokens_of(processor)

    def render(self, conversation: Conversation, template: str | None = None) -> str:
        """`template`: a Jinja chat template instead of the processor's own (vlm_assets.tokens.consumer)."""
        if template is None:
            return self.processor.apply_chat_template(conversation, tokenize=False)
        return self.processor.apply_chat_template(conversation, tokenize=False, chat_template=template)

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        return [len(ids) for batch in _batches(texts) for ids in self.processor.tokenizer(batch)["input_ids"]]

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Each token's (start, end) characters in `text`."""
        encoded = self.processor.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return [(int(start), int(end)) for start, end in encoded["offset_mapping"]]


@dataclass(frozen=True)
class TextSpec:
    """What rendering and tokenising a sample's text needs, without the processor."""

    tokenizer_json: str
    chat_template: str
    template_kwargs: dict[str, Any]  # the tokenizer's special tokens, as apply_chat_template passes them
    control_tokens: tuple[str, ...]  # see control_tokens_of
    # Special tokens of the template a long text may be cut before, each piece counted on its own:
    # the tokenizer splits its text at them before anything else, so the pieces' counts add up to the
    # whole's (proven on the probe conversations; () where they do not).
    cut_before: tuple[str, ...] = ()


class SpecText:
    """Text rendering and counting from a `TextSpec`: no torch, loads in a fraction of a second."""

    def __init__(self, spec: TextSpec) -> None:
        from tokenizers import Tokenizer

        import_transformers()  # its Jinja renderer; a processor may be loading in another thread
        self.spec = spec
        self.control_tokens = tuple(spec.control_tokens)
        self._tokenizer = Tokenizer.from_str(spec.tokenizer_json)
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        cuts = sorted(spec.cut_before, key=len, reverse=True)
        self._cut = re.compile("|".join(re.escape(token) for token in cuts)) if cuts else None
        # What the post-processor adds once per text (a BOS), left out of each piece.
        self._added_per_text = self._tokenizer.num_special_tokens_to_add(False)

    def render(self, conversation: Conversation, template: str | None = None) -> str:
        from transformers.utils.chat_template_utils import render_jinja_template

        prompts, _ = render_jinja_template(
            conversations=[conversation], tools=None, documents=None, chat_template=template or self.spec.chat_template,
            return_assistant_tokens_mask=False, continue_final_message=False, add_generation_prompt=False,
            **self.spec.template_kwargs,
        )
        return prompts[0]

    def token_counts(self, texts: Sequence[str]) -> list[int]:
        long = {index: self.count_in_pieces(text) for index, text in enumerate(texts)
                if len(text) > PIECE_CHARS and self._cut is not None}
        # The ids alone (no offsets): the same counts, less work and memory.
        short = iter([len(encoding.ids)
                      for batch in _batches([text for index, text in enumerate(texts) if index not in long])
                      for encoding in self._tokenizer.encode_batch_fast(batch)])
        return [long[index] if index in long else next(short) for index in range(len(texts))]

    def token_spans(self, text: str) -> list[tuple[int, int]]:
        """Each token's (start, end) characters in `text`."""
        return list(self._tokenizer.encode(text, add_special_tokens=False).offsets)

    def count_in_pieces(self, text: str, piece_chars: int = PIECE_CHARS) -> int:
        """The tokens of `text`, tokenised a piece of about `piece_chars` characters at a time."""
        assert self._cut is not None, "only for a spec with tokens to cut before"
        count, start = self._added_per_text, 0
        while start < len(text):
            cut = self._cut.search(text, start + piece_chars) if len(text) - start > piece_chars else None
            end = cut.start() if cut is not None else len(text)
            [encoding] = self._tokenizer.encode_batch_fast([text[start:end]], add_special_tokens=False)
            count += len(encoding.ids)
            start = end
        return count


def spec_text(spec: TextSpec) -> SpecText:
    """The SpecText of `spec`, built once per process while the spec stays the same: building one
    parses the whole tokenizer (most of a second), and a worker measures source after source."""
    global _last_spec_text
    if _last_spec_text is None or _last_spec_text.spec != spec:
        _last_spec_text = SpecText(spec)
    return _last_spec_text


_last_spec_text: SpecText | None = None


def text_spec_of(processor: Any) -> TextSpec | None:
    """The processor's text spec, or None when it cannot stand in for the processor exactly.

    The SpecText that proved the spec is what `spec_text` then returns for it: the spec's tokenizer
    is parsed once in this process, not once to prove it and again to count with it."""
    global _last_spec_text
    tokenizer = getattr(processor, "tokenizer", None)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    template = chat_template_of(processor) if tokenizer is not None else ""
    if backend is None or not template:
        return None
    template_kwargs = dict(tokenizer.special_tokens_map)
    if not all(isinstance(value, str) or (isinstance(value, list) and all(isinstance(item, str) for item in value))
               for value in template_kwargs.values()):
        return None
    spec = TextSpec(backend.to_str(), template, template_kwargs, control_tokens_of(processor), _cut_candidates(backend, template))
    try:
        ours, theirs = SpecText(spec), ProcessorText(processor)
        texts = [theirs.render(conversation) for conversation in PROBE_CONVERSATIONS]
        if any(ours.render(conversation) != text or ours.token_counts([text]) != theirs.token_counts([text])
               for conversation, text in zip(PROBE_CONVERSATIONS, texts)):
            return None
        # Cut before every such token the probes hold: the counts must not change.
        if spec.cut_before and any(ours.count_in_pieces(text, piece_chars=1) != theirs.token_counts([text])[0]
                                   for text in texts):
            spec = replace(spec, cut_before=())
            ours = SpecText(spec)
    except Exception:  # a template or tokenizer this path does not handle: keep the processor's own
        return None
    _last_spec_text = ours
    return spec


def _cut_candidates(backend: Any, template: str) -> tuple[str, ...]:
    """The special tokens the template writes that the tokenizer splits a text at as they are: matched in
    the raw text, before normalising, and taking no whitespace beside them or a word's edges into account."""
    added = getattr(backend, "get_added_tokens_decoder", None)  # tokenizers 0.15 on
    return tuple(sorted(
        token.content for token in (added() if added is not None else {}).values()
        if token.special and token.content in template and not token.normalized
        and not (token.lstrip or token.rstrip or token.single_word)
    ))


def chat_template_of(processor: Any) -> str:
    template = getattr(processor, "chat_template", None) or getattr(processor.tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else ""


def control_tokens_of(processor: Any) -> tuple[str, ...]:
    """The strings a sample's own text must not hold: they would act as markup, not as text.

    These are the tokenizer's special tokens (role markers, vision markers, media placeholders)
    and its other added tokens that the chat template writes; whitespace tokens are ordinary text.
    It is the set transformers' own `sanitize_control_tokens` escapes. Longest first, so a token
    is named rather than a shorter one inside it.
    """
    template = chat_template_of(processor)
    tokens = {
        token.content
        for token in processor.tokenizer.added_tokens_decoder.values()
        if token.content and (token.special or (token.content in template and not token.content.isspace()))
    }
    for attribute in ("image_token", "video_token"):
        if isinstance(value := getattr(processor, attribute, None), str) and value:
            tokens.add(value)
    return tuple(sorted(tokens, key=lambda token: (-len(token), token)))


def control_token_in(conversation: Conversation, control_tokens: Sequence[str]) -> str:
    """Why the conversation's text cannot be counted as text ("" when it can): the first control token and its turn."""
    if not control_tokens:
        return ""
    pattern = _control_pattern(tuple(control_tokens))
    for turn, message in enumerate(conversation, start=1):
        content = message["content"]
        texts = [content] if isinstance(content, str) else [part.get("text", "") for part in content if part.get("type") == "text"]
        for text in texts:
            if found := pattern.search(text):
                return (f"text holds the processor's control token {found.group(0)!r} (turn {turn}, {message['role']}); "
                        "set the source's special_tokens_in_text: keep to count it as the processor does")
    return ""


@lru_cache(maxsize=8)
def _control_pattern(control_tokens: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(map(re.escape, control_tokens)))


def _spec_path(model: ModelConfig, cache_dir: Path | None) -> Path:
    return (cache_dir or default_cache_dir()) / "text-specs" / f"v{TEXT_SPEC_VERSION}-{processor_fingerprint(model, cache_dir)}.json"


def stored_text_spec(model: ModelConfig, cache_dir: Path | None = None) -> TextSpec | None:
    """The spec `store_text_spec` kept for this processor (files and kwargs), if any."""
    try:
        fields = json.loads(_spec_path(model, cache_dir).read_text(encoding="utf-8"))
        return TextSpec(**{**fields, "control_tokens": tuple(fields["control_tokens"]),
                           "cut_before": tuple(fields["cut_before"])})
    except (FileNotFoundError, json.JSONDecodeError, TypeError, KeyError):
        return None


def store_text_spec(model: ModelConfig, spec: TextSpec, cache_dir: Path | None = None) -> None:
    path = _spec_path(model, cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(asdict(spec)))
