"""Constrained decoding on the host: grammars and matchers over a model's vocabulary (llguidance).

`GrammarCompiler` turns a JSON schema, a regular expression, an EBNF/Lark grammar or "any JSON"
into a checked `Grammar`; invalid input raises `GrammarError` with llguidance's message.
`Matcher` tracks one generation. It hides llguidance's differences from the SDK's contract: a
rejected token returns False and leaves the matcher as it was (llguidance would enter an error
state for good), and the mask is the SDK's packed int32 words (bit i % 32 of word i // 32 set:
token i allowed). Once the grammar is complete the mask allows the model's stop tokens.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance as llg
import numpy as np

__all__ = ["GrammarError", "Grammar", "GrammarCompiler", "Matcher", "JSON_STYLE"]

# JSON is written compactly and always the same way (", " and ": ", no free whitespace), so a
# small model cannot run on in blank space; a schema may override it with its own "x-guidance".
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """An invalid schema, regex or grammar, or a matcher used wrongly."""


@dataclass(frozen=True)
class Grammar:
    """A checked llguidance grammar for one compiler's vocabulary."""

    source: str                 # llguidance's grammar text (what LLMatcher takes)
    compiler: "GrammarCompiler"


class GrammarCompiler:
    """Grammars for one tokenizer's vocabulary.

    `vocab_size`: the model's output vocabulary (masks have ceil(vocab_size / 32) words; ids the
    tokenizer does not know are never allowed). `stop_tokens`: what the model may end with once
    the grammar is complete.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_tokens: list[int]) -> None:
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.stop_tokens = frozenset(stop_tokens)
        self.lltok = llg.LLTokenizer(tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                     eos_token=list(stop_tokens) or None)

    def _checked(self, source: str, what: str) -> Grammar:
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(source, self.lltok)
        if is_error:
            raise GrammarError(f"invalid {what}: {messages[0].strip()}")
        return Grammar(source, self)

    def json_schema(self, schema: dict | str) -> Grammar:
        """JSON that validates against `schema` (a dict or its JSON text)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as e:
                raise GrammarError(f"invalid JSON schema: not JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"invalid JSON schema: expected an object, got {type(schema).__name__}")
        try:
            source = llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_STYLE)
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
        return self._checked(source, "JSON schema")

    def any_json(self) -> Grammar:
        """Any JSON value."""
        return self.json_schema({})

    def regex(self, pattern: str) -> Grammar:
        """Text that matches `pattern` as a whole (Rust regex syntax)."""
        if not isinstance(pattern, str):
            raise GrammarError("a regex must be a string")
        return self._checked(llg.LLMatcher.grammar_from_regex(pattern), "regex")

    def ebnf(self, text: str) -> Grammar:
        """A context-free grammar in Lark syntax (`start: ...`, llguidance's dialect) or in
        llama.cpp's GBNF (`root ::= ...`)."""
        if not isinstance(text, str):
            raise GrammarError("an EBNF grammar must be a string")
        try:
            source = llg.grammar_from("ebnf", text)
        except ValueError as e:
            raise GrammarError(f"invalid EBNF grammar: {e}") from None
        return self._checked(source, "EBNF grammar")

    def lark(self, text: str) -> Grammar:
        """A grammar in llguidance's Lark syntax (may embed JSON schemas with %json{...})."""
        return self._checked(llg.LLMatcher.grammar_from_lark(text), "Lark grammar")


class Matcher:
    """The state of one generation under a grammar.

    A stop token is accepted only where the grammar is complete, and ends the generation:
    nothing is accepted after it. Stop tokens never reach llguidance (its history and rollback
    do not count them), so this class keeps that part of the state itself.
    """

    def __init__(self, grammar: Grammar, _matcher: Any = None, _accepted: int = 0, _ended: bool = False) -> None:
        self.grammar = grammar
        self._m = _matcher if _matcher is not None else llg.LLMatcher(
            grammar.compiler.lltok, grammar.source, log_level=0)
        # llguidance enters its error state for good on a rollback past the start: count here
        self._accepted = _accepted
        self._ended = _ended          # a stop token was accepted
        if self._m.is_error():
            raise GrammarError(self._m.get_error())

    def mask_array(self) -> np.ndarray:
        """The allowed next tokens as packed int32 words (a fresh array)."""
        words = (self.grammar.compiler.vocab_size + 31) // 32    # llguidance may pad a word
        if self._ended:
            return np.zeros(words, dtype="<i4")
        return np.frombuffer(self._m.compute_bitmask(), dtype="<i4")[:words].copy()

    def mask(self) -> list[int]:
        return self.mask_array().tolist()

    def accept_tokens(self, tokens: list[int]) -> bool:
        """Advance by `tokens` if the grammar allows all of them; else change nothing, False."""
        tokens = list(tokens)
        if not tokens:
            return True
        if any(not 0 <= t < self.grammar.compiler.vocab_size for t in tokens):
            return False                # an id outside the vocabulary is never allowed
        stops = self.grammar.compiler.stop_tokens
        cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        body, stop = tokens[:cut], tokens[cut:]
        if self._ended or len(stop) > 1 or self._m.validate_tokens(body) < len(body):
            return False
        if body and not self._m.consume_tokens(body):
            raise GrammarError(f"matcher failed after validating its tokens: {self._m.get_error()}")
        if stop and not self._m.is_accepting():
            self._m.rollback(len(body))
            return False
        self._accepted += len(tokens)
        self._ended = bool(stop)
        return True

    def is_terminated(self) -> bool:
        """Nothing more can follow: a stop token was accepted, or the grammar is complete and
        admits no more text (only a stop token)."""
        return self._ended or self._m.is_stopped()

    def fork(self) -> Matcher:
        return Matcher(self.grammar, self._m.deep_copy(), self._accepted, self._ended)

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        if type(n) is not int or n < 0:
            raise GrammarError(f"rollback takes a token count >= 0, got {n!r}")
        if n > self._accepted:
            raise GrammarError(f"cannot roll back {n} tokens: only {self._accepted} were accepted")
        grammar_tokens = n - 1 if n and self._ended else n
        if grammar_tokens and not self._m.rollback(grammar_tokens):
            raise GrammarError(f"cannot roll back {n} tokens: {self._m.get_error()}")
        self._ended = self._ended and n == 0
        self._accepted -= n

    def reset(self) -> None:
        self._m.reset()
        self._accepted = 0
        self._ended = False
