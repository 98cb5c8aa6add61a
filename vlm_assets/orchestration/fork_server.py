"""Imported by the process the workers of `vlm-assets run` are forked from (orchestration.workers),
first and alone: imports the modules named in $VLM_ASSETS_FORK_SERVER_PRELOAD (comma-separated), in
order, under `imports_without_gc`, so every worker starts with them loaded and frozen.

A module that fails to import is skipped, as the fork server skips its own preloads: the worker that
needs it imports it again and fails with the error.
"""

import importlib
import os

from vlm_assets.orchestration.workers import PRELOAD_ENV_VAR
from vlm_assets.parallel import imports_without_gc

with imports_without_gc():
    for name in filter(None, os.environ.get(PRELOAD_ENV_VAR, "").split(",")):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
