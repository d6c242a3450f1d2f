"""Model folders of several chat families for tests, built without the hub.

Each family is the default model's real tokenizer.json with the family's special tokens added,
and the family's real chat template (tests/chat_templates/*.jinja). Pieces rendered by
ChatTokens from such a folder can be compared with transformers' `apply_chat_template` on the
same tokenizer and template.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
QWEN_PLAIN = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
LLAMA_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                 "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]


@dataclass(frozen=True)
class Family:
    name: str
    template: str | None             # file in tests/chat_templates; None: keep the folder's own
    bos: str | None = None
    eos: str | None = None
    special: list[str] = field(default_factory=list)   # added as special tokens
    plain: list[str] = field(default_factory=list)     # added as ordinary added tokens (Qwen's <think>)


FAMILIES = {
    "smollm2": Family("smollm2", None),
    "qwen2.5": Family("qwen2.5", "qwen2.5.jinja", None, "<|im_end|>", plain=QWEN_PLAIN),
    "qwen3": Family("qwen3", "qwen3.jinja", None, "<|im_end|>", plain=QWEN_PLAIN),
    "qwen3-thinking": Family("qwen3-thinking", "qwen3-thinking-2507.jinja", None, "<|im_end|>", plain=QWEN_PLAIN),
    "llama3.1": Family("llama3.1", "llama3.1.jinja", "<|begin_of_text|>", "<|eot_id|>", special=LLAMA_SPECIAL),
}


def make_family_dir(default_model_dir: Path, family: Family, folder: Path, template: str | None = None) -> Path:
    """A tokenizer-only model folder for `family` (or the default model's with `template`)."""
    folder.mkdir(parents=True, exist_ok=True)
    backend = Backend.from_file(str(default_model_dir / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family.special])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.plain])
    backend.save(str(folder / "tokenizer.json"))
    config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    if family.template is not None:
        config.update(bos_token=family.bos, eos_token=family.eos, add_bos_token=False)
    if template is not None or family.template is not None:
        config["chat_template"] = template if template is not None else (TEMPLATES / family.template).read_text()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def thinking_model_dir(default_model_dir: Path, folder: Path) -> Path:
    """The default model's weights behind the Qwen3 thinking (2507) chat template, whose cue
    pre-fills `<think>`. The tokenizer is the default model's (its vocabulary is the model's: no
    added `<think>` token the weights would have no row for), so the tags are ordinary text."""
    template = (TEMPLATES / "qwen3-thinking-2507.jinja").read_text()
    make_family_dir(default_model_dir, FAMILIES["smollm2"], folder, template)
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(default_model_dir / name)
    return folder


def hf_tokenizer(folder: Path):
    """transformers' tokenizer for a folder made by make_family_dir (the reference)."""
    import transformers

    config = json.loads((folder / "tokenizer_config.json").read_text())
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"),
                                              bos_token=config.get("bos_token"), eos_token=config.get("eos_token"))
    hf.chat_template = config["chat_template"]
    return hf


def hf_ids(hf, messages: list[dict], **kw) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)
