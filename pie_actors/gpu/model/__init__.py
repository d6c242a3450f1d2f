"""The model side, one concept a file:

    llama.py     Llama / Qwen2 / Qwen3 in one file (they differ only in config flags)
    config.py    ModelConfig, parsed from a Hugging Face config.json (no torch)
    loader.py    safetensors folders and GGUF conversion
    tp.py        collectives (gloo, NCCL) and column/row-parallel layers
    adapters.py  fwd.adapter: traced f(x, y) at projection sites (LoRA)
"""
from .config import ModelConfig, UnsupportedModel
from .llama import LlamaModel

__all__ = ["ModelConfig", "UnsupportedModel", "LlamaModel", "build_model"]


def build_model(cfg: ModelConfig, comm=None) -> LlamaModel:
    return LlamaModel(cfg, comm)
