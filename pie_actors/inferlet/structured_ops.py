"""The `grammar.*`, `tools.*` and `reasoning.*` host operations (mixins of InferletHost via ChatOps).

The guest SDK holds integer handles; the grammars, matchers and decoders live here in a
per-run table (created on first use: the host object is one run). The mixins need the host's
`tok` (the model's Tokenizer) and `chat` (its ChatTokens, from ChatOps); the model's output
vocabulary comes from `info["vocab_size"]` when the host has it.

    grammar.compile [kind, source] -> grammar     kind: json_schema | regex | ebnf | json
    grammar.matcher grammar -> matcher
    grammar.mask matcher -> [int32 words]         grammar.accept [matcher, tokens] -> bool
    grammar.is_terminated matcher -> bool         grammar.fork matcher -> matcher
    grammar.rollback [matcher, n]                 grammar.reset matcher
    tools.equip {"specs", "system"} -> tokens     tools.answer [name, value] -> tokens
    tools.grammar specs -> grammar                tools.decoder -> decoder
    tools.feed [decoder, tokens] -> events        tools.finish decoder -> events
    reasoning.decoder cue_tokens -> decoder       reasoning.feed [decoder, tokens] -> events

Bad input (an invalid schema, regex or grammar, unknown handles, malformed tool specs) fails
the operation with a message; the guest sees HostError.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from .grammar import Grammar, GrammarCompiler, Matcher
from .host import HostOpError
from .reasoning import ReasoningDecoder
from .tools import ToolCallDecoder, ToolFormat

__all__ = ["GrammarOps", "ToolOps", "ReasoningOps"]


def _clean_errors(op: Callable) -> Callable:
    """Report the plain classes' ValueErrors (GrammarError, ToolError, bad token ids) as the
    operation's own message, without a Python type name in front."""
    @functools.wraps(op)
    def wrapped(self, args):
        try:
            return op(self, args)
        except HostOpError:
            raise
        except ValueError as e:
            raise HostOpError(str(e)) from None
    return wrapped


def _tokens(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(type(t) is not int for t in value):
        raise HostOpError(f"{what} takes a list of token ids")
    return value


def _pair(args: Any, what: str) -> tuple[Any, Any]:
    if not (isinstance(args, list) and len(args) == 2):
        raise HostOpError(f"{what} takes two arguments")
    return args[0], args[1]


@functools.lru_cache(maxsize=8)
def _compiler(tokenizer, vocab_size: int, stop_tokens: tuple[int, ...]) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, vocab_size, list(stop_tokens))   # ~0.2 s: once per model


class HandleOps:
    """The per-run table behind the guest's handles."""

    def _handle_table(self) -> dict[int, Any]:
        table = getattr(self, "_sdk_handles", None)
        if table is None:
            table = self._sdk_handles = {}
        return table

    def _handle_put(self, obj: Any) -> int:
        table = self._handle_table()
        handle = len(table) + 1
        table[handle] = obj
        return handle

    def _handle_get(self, handle: Any, kind: type, what: str) -> Any:
        obj = self._handle_table().get(handle) if type(handle) is int else None
        if not isinstance(obj, kind):
            raise HostOpError(f"unknown {what} {handle!r}")
        return obj


class GrammarOps(HandleOps):
    GRAMMAR_OPS: dict[str, str] = {
        "grammar.compile": "_grammar_compile", "grammar.matcher": "_grammar_matcher",
        "grammar.mask": "_grammar_mask", "grammar.accept": "_grammar_accept",
        "grammar.is_terminated": "_grammar_is_terminated", "grammar.fork": "_grammar_fork",
        "grammar.rollback": "_grammar_rollback", "grammar.reset": "_grammar_reset",
    }

    def grammar_compiler(self) -> GrammarCompiler:
        info = getattr(self, "info", None) or {}
        tok = self.tok
        stops = self.chat.stop_tokens() if tok.chat_template is not None else tok.eos_ids
        return _compiler(tok, max(tok.vocab_size, info.get("vocab_size", 0)), tuple(stops))

    def _matcher(self, handle: Any) -> Matcher:
        return self._handle_get(handle, Matcher, "matcher")

    @_clean_errors
    def _grammar_compile(self, args) -> int:
        kind, source = _pair(args, "grammar.compile")
        compiler = self.grammar_compiler()
        build = {"json_schema": compiler.json_schema, "regex": compiler.regex, "ebnf": compiler.ebnf}
        if kind == "json":
            return self._handle_put(compiler.any_json())
        if kind not in build:
            raise HostOpError(f"unknown grammar kind {kind!r}")
        return self._handle_put(build[kind](source))

    @_clean_errors
    def _grammar_matcher(self, handle) -> int:
        return self._handle_put(Matcher(self._handle_get(handle, Grammar, "grammar")))

    @_clean_errors
    def _grammar_mask(self, handle) -> list[int]:
        return self._matcher(handle).mask()

    @_clean_errors
    def _grammar_accept(self, args) -> bool:
        handle, tokens = _pair(args, "grammar.accept")
        return self._matcher(handle).accept_tokens(_tokens(tokens, "grammar.accept"))

    @_clean_errors
    def _grammar_is_terminated(self, handle) -> bool:
        return self._matcher(handle).is_terminated()

    @_clean_errors
    def _grammar_fork(self, handle) -> int:
        return self._handle_put(self._matcher(handle).fork())

    @_clean_errors
    def _grammar_rollback(self, args) -> None:
        handle, n = _pair(args, "grammar.rollback")
        self._matcher(handle).rollback(n)

    @_clean_errors
    def _grammar_reset(self, handle) -> None:
        self._matcher(handle).reset()


class ToolOps(GrammarOps):
    TOOL_OPS: dict[str, str] = {
        "tools.equip": "_tools_equip", "tools.answer": "_tools_answer", "tools.grammar": "_tools_grammar",
        "tools.decoder": "_tools_decoder", "tools.feed": "_tools_feed", "tools.finish": "_tools_finish",
    }

    def tool_format(self) -> ToolFormat:
        return ToolFormat(self.chat.source)

    @_clean_errors
    def _tools_equip(self, args) -> list[int]:
        if not isinstance(args, dict):
            raise HostOpError('tools.equip takes {"specs": [...], "system": text or null}')
        system = args.get("system")
        if system is not None and not isinstance(system, str):
            raise HostOpError("tools.equip: system must be text")
        return self.tool_format().equip(self.chat, args.get("specs"), system)

    @_clean_errors
    def _tools_answer(self, args) -> list[int]:
        name, value = _pair(args, "tools.answer")
        return self.tool_format().answer(self.chat, name, value)

    @_clean_errors
    def _tools_grammar(self, specs) -> int:
        return self._handle_put(self.grammar_compiler().lark(self.tool_format().grammar(specs, self.tok)))

    @_clean_errors
    def _tools_decoder(self, args) -> int:
        return self._handle_put(ToolCallDecoder(self.tok, self.tool_format().family))

    @_clean_errors
    def _tools_feed(self, args) -> list[dict]:
        handle, tokens = _pair(args, "tools.feed")
        return self._handle_get(handle, ToolCallDecoder, "tool decoder").feed(_tokens(tokens, "tools.feed"))

    @_clean_errors
    def _tools_finish(self, handle) -> list[dict]:
        return self._handle_get(handle, ToolCallDecoder, "tool decoder").finish()


class ReasoningOps(HandleOps):
    REASONING_OPS: dict[str, str] = {"reasoning.decoder": "_reasoning_decoder",
                                     "reasoning.feed": "_reasoning_feed"}

    @_clean_errors
    def _reasoning_decoder(self, cue) -> int:
        return self._handle_put(ReasoningDecoder.for_cue(self.tok, _tokens(cue, "reasoning.decoder")))

    @_clean_errors
    def _reasoning_feed(self, args) -> list[dict]:
        handle, tokens = _pair(args, "reasoning.feed")
        return self._handle_get(handle, ReasoningDecoder, "reasoning decoder").feed(_tokens(tokens, "reasoning.feed"))
