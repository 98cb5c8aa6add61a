"""Imported for what it imports: the modules loading a Hugging Face processor needs (transformers'
processor classes, torch, torchvision), seconds of a core.

The fork server of `vlm-assets run` (vlm_assets.orchestration.workers) imports this once when the
run measures token lengths, and each worker forked from it starts with them in memory instead of
importing them itself.
"""

from vlm_assets.tokens.processor import import_processor_classes

import_processor_classes()
