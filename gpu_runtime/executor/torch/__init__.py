"""The real executor: our own paged-KV forward pass over transformers weights."""

from gpu_runtime.executor.torch.executor import TorchExecutor, bundled_gguf, load_hf

__all__ = ["TorchExecutor", "bundled_gguf", "load_hf"]
