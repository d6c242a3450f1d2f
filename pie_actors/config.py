"""User settings: where pie keeps its files, `$PIE_HOME/config.toml`, and device/dtype choice.

Imported by processes that must stay light (inferlet actors), so torch is imported only inside the
functions that need it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL = "smollm2-135m-instruct"

# Every setting, its default and what it means; `pie config init` writes them out from here.
DEFAULTS: dict[str, Any] = {
    "model": DEFAULT_MODEL,
    "device": "auto",
    "dtype": "auto",
    "page_size": 16,
    "kv_memory_mb": 1024,
    "max_batch_tokens": 4096,
    "tp": 1,
    "compile": False,
}
_DOCS = {
    "model": "model to serve: a name from `pie model list`, a model folder or a .gguf file",
    "device": '"auto" (cuda if available, else cpu), "cpu", "cuda" or "cuda:N"',
    "dtype": '"auto" (bfloat16 where the hardware has it, else float32), "float32", "bfloat16" or "float16"',
    "page_size": "tokens per KV-cache page",
    "kv_memory_mb": "memory for the KV-cache page pool, per worker",
    "max_batch_tokens": "most tokens one batched forward pass may hold",
    "tp": "tensor-parallel degree (number of GPU workers a model is split over)",
    "compile": "run decode batches through torch.compile (faster steady state; each batch-size bucket "
               "compiles once, which takes a minute or more on a CPU)",
}


def pie_home() -> Path:
    """$PIE_HOME, else ~/.pie: models, caches and config.toml live here."""
    return Path(os.environ.get("PIE_HOME") or Path.home() / ".pie")


def config_path() -> Path:
    return pie_home() / "config.toml"


def _toml_value(value: Any) -> str:
    return json.dumps(value)  # JSON strings, numbers and booleans are valid TOML values


def init_config(force: bool = False) -> Path:
    """Write config.toml holding the defaults, each with a comment; refuses to overwrite unless `force`."""
    path = config_path()
    if path.exists() and not force:
        raise FileExistsError(f"{path} already exists (use --force to overwrite it)")
    lines = ["# pie settings. Delete a line to use its default.", ""]
    for key, value in DEFAULTS.items():
        lines += [f"# {_DOCS[key]}", f"{key} = {_toml_value(value)}", ""]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def load_config() -> dict[str, Any]:
    """The settings: DEFAULTS overridden by config.toml when it exists.

    Raises ValueError on unknown keys or wrongly typed values, so a typo does not go unnoticed.
    """
    config = dict(DEFAULTS)
    path = config_path()
    if not path.is_file():
        return config
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib
        except ModuleNotFoundError:
            raise RuntimeError(f"reading {path} on Python < 3.11 needs `pip install tomli`") from None
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from e
    for key, value in values.items():
        if key not in DEFAULTS:
            raise ValueError(f"{path}: unknown setting {key!r}; known: {sorted(DEFAULTS)}")
        if type(value) is not type(DEFAULTS[key]):
            raise ValueError(f"{path}: {key} must be a {type(DEFAULTS[key]).__name__}, got {value!r}")
        config[key] = value
    return config


def pick_device(name: str = "auto") -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return device


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`name` as a torch dtype; "auto" is bfloat16 on CUDA and on CPUs with bf16 matrix instructions
    (where it is about twice as fast as float32), float32 elsewhere."""
    import torch

    if name != "auto":
        if name not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use one of auto, {', '.join(sorted(set(_DTYPES.values())))}")
        return getattr(torch, _DTYPES[name])
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if _cpu_has_bf16() else torch.float32


def _cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"avx512_bf16", "amx_bf16"})
    except OSError:  # not Linux: no cheap way to tell, and float32 is always correct
        pass
    return False
