"""Runtime LoRA adapters (``app.services.lora_adapters``) on a real migrated SQLite DB: the names listed and served
once the settings change under adapters already loaded."""

from __future__ import annotations

import json

import pytest

from app.services import lora_adapters
from app.settings import Settings


def _adapter_dir(path) -> str:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    (path / "adapter_model.safetensors").write_bytes(b"")  # a worker loads it; the API checks it is there
    return str(path)


def test_a_runtime_adapter_named_by_the_settings_since_is_listed_once_and_can_be_unloaded(tmp_path, db_url):
    """Adapters loaded at runtime whose names a restart then gives a configured adapter (COSERVE_LORA_MODULES) or
    the model (an alias): /v1/models lists each name once, and an admin can still remove the runtime rows."""
    settings = Settings(data_dir=tmp_path, database_url=db_url, model_name="tiny", runtime_lora=True)
    for name in ("rt-a", "rt-b", "rt-c"):
        lora_adapters.load(settings, name, _adapter_dir(tmp_path / name))
    restarted = settings.model_copy(update={"lora_modules": {"rt-a": "/adapters/a"}, "model_aliases": ("rt-b",)})
    assert lora_adapters.listed_models(restarted) == ("tiny", "rt-b", "rt-a", "rt-c")
    assert lora_adapters.served_models(restarted) == ("tiny", "rt-a", "rt-c")
    lora_adapters.unload(restarted, "rt-a")
    lora_adapters.unload(restarted, "rt-b")
    assert set(lora_adapters.loaded(restarted, fresh=True)) == {"rt-c"}
    with pytest.raises(lora_adapters.AdapterError, match="configured by COSERVE_LORA_MODULES; remove it there"):
        lora_adapters.unload(restarted, "rt-a")  # the configured adapter itself stays
    with pytest.raises(lora_adapters.AdapterError, match="'rt-b' is not loaded"):
        lora_adapters.unload(restarted, "rt-b")
