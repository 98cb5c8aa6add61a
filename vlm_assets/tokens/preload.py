"""What measuring token lengths with the configured model reads, loaded ahead into a process's
caches: transformers' processor classes, torch and torchvision, the processor itself, the tokenizer
of its stored text spec and its stored media tokens (seconds of a core).

`vlm-assets run` loads them in its own process just before it forks its workers
(vlm_assets.orchestration.workers), when the run may measure token lengths
(asset_specs.may_measure_lengths): each worker starts with them in memory instead of loading its
own copy.
"""

from vlm_assets.config import load_config
from vlm_assets.tokens.processor import import_processor_classes, shared_processor
from vlm_assets.tokens.profile import stored_media_tokens
from vlm_assets.tokens.text import spec_text, stored_text_spec


def load_for_measuring(config_path: str) -> None:
    """Load the config's processor, its stored text spec's tokenizer and its stored media tokens into
    this process's caches (those not stored yet are left to the first run that stores them)."""
    import_processor_classes()
    app = load_config(config_path)
    shared_processor(app.model)
    spec = stored_text_spec(app.model)
    if spec is not None:
        spec_text(spec)
    stored_media_tokens(app.model, app.frame_cache)
