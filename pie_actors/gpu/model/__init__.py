"""The model side, one concept a file:

    llama.py     Llama / Qwen2 / Qwen3 in one file (they differ only in config flags)
    qwen3_5.py   Qwen3.5: gated DeltaNet layers (recurrent state) among gated attention layers
    config.py    ModelConfig, parsed from a Hugging Face config.json (no torch)
    loader.py    safetensors folders and GGUF conversion
    tp.py        collectives (gloo, NCCL) and column/row-parallel layers
    adapters.py  fwd.adapter: traced f(x, y) at projection sites (LoRA)
"""
from .config import ModelConfig, UnsupportedModel
from .llama import LlamaModel
from .qwen3_5 import Qwen3_5Model

__all__ = ["ModelConfig", "UnsupportedModel", "LlamaModel", "Qwen3_5Model", "build_model"]


def build_model(cfg: ModelConfig, comm=None) -> LlamaModel:
    return (Qwen3_5Model if cfg.architecture == "qwen3_5" else LlamaModel)(cfg, comm)
