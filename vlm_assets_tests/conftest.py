from __future__ import annotations

from pathlib import Path

import pytest

from vlm_assets.config import AppConfig, load_config
from vlm_assets.demo import write_demo

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real sample data not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def demo_config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo dataset, written once per test session (read-only for tests)."""
    return write_demo(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="session")
def demo_app(demo_config_path: Path) -> AppConfig:
    return load_config(demo_config_path)


@pytest.fixture(scope="session")
def processor():
    from vlm_assets.config import ModelConfig
    from vlm_assets.tokens.processor import load_processor

    return load_processor(ModelConfig(processor_kwargs={"min_pixels": 3136, "max_pixels": 1003520}))
