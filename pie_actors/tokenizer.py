"""Text <-> token ids, on the `tokenizers` library (no transformers at run time).

`Tokenizer.from_dir` reads a Hugging Face model folder. `tokenizer_from_gguf` rebuilds the same kind of
`tokenizer.json` from a GGUF file's metadata, which is how imported GGUF models get one.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _Backend

from .chat_template import ChatTemplate


class Tokenizer:
    def __init__(self, backend: _Backend, bos_token: str | None = None, eos_ids: list[int] | None = None,
                 add_bos_token: bool = False, chat_template: ChatTemplate | None = None):
        self.backend = backend
        self.bos_token = bos_token
        self.bos_id = backend.token_to_id(bos_token) if bos_token is not None else None
        self.eos_ids = list(eos_ids or [])
        self.add_bos_token = add_bos_token  # whether the model expects BOS before raw (non-chat) text
        self.chat_template = chat_template
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json, generation_config.json and the chat template of `folder`."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = _Backend.from_file(str(path))
        config = _read_json(folder / "tokenizer_config.json")
        bos = _token_text(config.get("bos_token"))
        eos = _token_text(config.get("eos_token"))

        # Stop ids: generation_config.json lists them all (Llama 3 has several); the tokenizer's eos is
        # the fallback for folders without one.
        eos_ids: list[int] = []
        gen_eos = _read_json(folder / "generation_config.json").get("eos_token_id")
        for i in gen_eos if isinstance(gen_eos, list) else [gen_eos]:
            if isinstance(i, int) and i not in eos_ids:
                eos_ids.append(i)
        eos_id = backend.token_to_id(eos) if eos is not None else None
        if eos_id is not None and eos_id not in eos_ids:
            eos_ids.append(eos_id)

        bos_id = backend.token_to_id(bos) if bos is not None else None
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # Llama 3 style folders say it only through tokenizer.json's post-processor.
            add_bos = bos_id is not None and backend.encode("", add_special_tokens=True).ids[:1] == [bos_id]
        template = ChatTemplate.from_dir(folder, bos_token=bos or "", eos_token=eos or "")
        return cls(backend, bos, eos_ids, bool(add_bos), template)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Never adds BOS/EOS: callers add prefix tokens explicitly.
        Special-token text such as "<|im_start|>" becomes its single special id."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} out of range for vocabulary of size {self.vocab_size}")
        return self.backend.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # Older tokenizer_config.json files store special tokens as AddedToken dicts.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


# --- building a tokenizer from GGUF metadata -------------------------------------------------------

# llama.cpp names a vocabulary's pre-tokenizer in `tokenizer.ggml.pre`; these are the splits the
# original Hugging Face tokenizer.json files use for each (llama.cpp's llama-vocab.cpp has the same).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def _gpt2() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _smollm() -> pre_tokenizers.PreTokenizer:
    # SmolLM's tokenizer.json: every digit on its own, then GPT-2's split.
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2()])


# pre name -> (pre-tokenizer factory, normalizer factory or None, BPE ignore_merges)
_PRE_TOKENIZERS = {
    "default": (_gpt2, None, False),
    "gpt2": (_gpt2, None, False),
    "smollm": (_smollm, None, False),
    "llama-bpe": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "llama3": (lambda: _split_then_bytes(_LLAMA3_SPLIT), None, True),
    "qwen2": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
    "deepseek-r1-qwen": (lambda: _split_then_bytes(_QWEN2_SPLIT), normalizers.NFC, False),
}

_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


def tokenizer_from_gguf(meta: dict[str, Any]) -> _Backend:
    """A byte-level BPE tokenizer equivalent to the one described by GGUF metadata `meta`
    (key -> value, as `gguf.ReaderField.contents()` returns them).

    Raises ValueError for vocabularies this does not rebuild (sentencepiece, unknown pre-tokenizers).
    """
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {sorted(_PRE_TOKENIZERS)}")
    make_pre, make_norm, ignore_merges = _PRE_TOKENIZERS[pre]

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    backend = _Backend(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    backend.pre_tokenizer = make_pre()
    backend.decoder = decoders.ByteLevel()
    if make_norm is not None:
        backend.normalizer = make_norm()

    # Control tokens (<|im_start|>, ...) and user-defined ones (<think>, ...) must match whole in text
    # before BPE sees it. llama.cpp pads sparse vocabularies with "[PAD<id>]" user-defined fillers,
    # which are not real tokens of the model.
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    plain = [AddedToken(t, special=False, normalized=False)
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty == _USER_DEFINED and t != f"[PAD{i}]"]
    backend.add_special_tokens(special)
    backend.add_tokens(plain)
    return backend
