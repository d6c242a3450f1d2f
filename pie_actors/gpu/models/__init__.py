"""Model families. Llama, Qwen2 and Qwen3 differ only in config flags, so they share one file."""
from .config import ModelConfig, UnsupportedModel
from .llama import LlamaModel

__all__ = ["ModelConfig", "UnsupportedModel", "LlamaModel", "build_model"]


def build_model(cfg: ModelConfig, comm=None) -> LlamaModel:
    return LlamaModel(cfg, comm)
