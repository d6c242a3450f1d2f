"""Constrained decoding: grammars compiled for the model's vocabulary, and matchers that track
which tokens may come next in one generation.

Both live on the host (llguidance); the guest holds their handles. An invalid schema, regex or
grammar raises HostError with the reason.

    grammar = Grammar.from_json_schema({"type": "object", ...})
    m = Matcher(grammar)
    words = m.mask()              # packed int32 words: bit i % 32 of word i // 32 = token i allowed
    m.accept_tokens([token])      # False (and no change) if the grammar does not allow it
    m.is_terminated()             # complete: nothing but a stop token may follow (or one did)
"""
from __future__ import annotations

from . import _host

__all__ = ["Grammar", "Matcher"]


class Grammar:
    """A grammar compiled on the host for the model's vocabulary. Make one with a classmethod."""

    def __init__(self, handle: int) -> None:
        self._handle = handle

    @classmethod
    def _compile(cls, kind: str, source) -> "Grammar":
        return cls(_host.call("grammar.compile", [kind, source]))

    @classmethod
    def from_json_schema(cls, schema) -> "Grammar":
        """JSON that validates against `schema` (a dict, or its JSON text). Output is compact
        (", " and ": " separators, no free whitespace) unless the schema's "x-guidance" says otherwise."""
        return cls._compile("json_schema", schema)

    @classmethod
    def from_regex(cls, pattern: str) -> "Grammar":
        """Text matching `pattern` as a whole (Rust regex syntax)."""
        return cls._compile("regex", str(pattern))

    @classmethod
    def from_ebnf(cls, grammar: str) -> "Grammar":
        """A context-free grammar: Lark syntax as llguidance reads it (`start: expr`, rules
        `name: a | b`, "literals", /regexes/, TERMINALS) or llama.cpp's GBNF (`root ::= ...`)."""
        return cls._compile("ebnf", str(grammar))

    @classmethod
    def json(cls) -> "Grammar":
        """Any JSON value."""
        return cls._compile("json", None)


class Matcher:
    """The state of one generation under `grammar`."""

    def __init__(self, grammar: Grammar) -> None:
        self._handle = _host.call("grammar.matcher", grammar._handle)

    @classmethod
    def _of(cls, handle: int) -> "Matcher":
        m = cls.__new__(cls)
        m._handle = handle
        return m

    def mask(self) -> list[int]:
        """The tokens allowed next, packed: bit i % 32 of word i // 32 is token i (int32 words;
        inferlet.mask.unpack_mask gives one bool per token)."""
        return _host.call("grammar.mask", self._handle)

    def accept_tokens(self, tokens) -> bool:
        """Advance by `tokens` if the grammar allows all of them (a stop token only where the
        grammar is complete); otherwise change nothing and return False."""
        return _host.call("grammar.accept", [self._handle, [int(t) for t in tokens]])

    def is_terminated(self) -> bool:
        """True once a stop token was accepted, or the grammar is complete and admits no more text."""
        return _host.call("grammar.is_terminated", self._handle)

    def fork(self) -> "Matcher":
        """An independent copy of this matcher's state."""
        return Matcher._of(_host.call("grammar.fork", self._handle))

    def rollback(self, n: int) -> None:
        """Undo the last `n` accepted tokens."""
        _host.call("grammar.rollback", [self._handle, int(n)])

    def reset(self) -> None:
        """Back to the start of the grammar."""
        _host.call("grammar.reset", self._handle)
