"""The `grammar.*`, `tools.*` and `reasoning.*` host operations: `GrammarOps`, `ToolOps`, `ReasoningOps`.

Each receives the run's `RunState` (for `tok`, the model's Tokenizer, `chat`, its ChatTokens, and
`info["vocab_size"]`, the model's output vocabulary) and the run's one `HandleTable`: the guest SDK
holds integer handles, and the grammars, matchers and decoders behind them live there, whichever
interface made them (`tools.grammar` makes a grammar for `grammar.matcher`).

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
from .run_state import RunState
from .tools import ToolCallDecoder, ToolFormat

__all__ = ["HandleTable", "GrammarOps", "ToolOps", "ReasoningOps"]


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


def grammar_compiler(run: RunState) -> GrammarCompiler:
    """The model's grammar compiler: masks as wide as the output vocabulary, stopping on the chat
    template's end-of-turn tokens when it has one."""
    tok = run.tok
    stops = run.chat.stop_tokens() if tok.chat_template is not None else tok.eos_ids
    return _compiler(tok, max(tok.vocab_size, run.info.get("vocab_size", 0)), tuple(stops))


class HandleTable:
    """The objects behind the guest's handles, for one run."""

    def __init__(self) -> None:
        self._objects: dict[int, Any] = {}

    def put(self, obj: Any) -> int:
        handle = len(self._objects) + 1
        self._objects[handle] = obj
        return handle

    def get(self, handle: Any, kind: type, what: str) -> Any:
        """The object of `handle`, which must be a `kind` (`what` names it in the error)."""
        obj = self._objects.get(handle) if type(handle) is int else None
        if not isinstance(obj, kind):
            raise HostOpError(f"unknown {what} {handle!r}")
        return obj


class GrammarOps:
    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {
            "grammar.compile": self.compile, "grammar.matcher": self.matcher, "grammar.mask": self.mask,
            "grammar.accept": self.accept, "grammar.is_terminated": self.is_terminated,
            "grammar.fork": self.fork, "grammar.rollback": self.rollback, "grammar.reset": self.reset,
        }

    def _matcher(self, handle: Any) -> Matcher:
        return self.handles.get(handle, Matcher, "matcher")

    @_clean_errors
    def compile(self, args: Any) -> int:
        kind, source = _pair(args, "grammar.compile")
        compiler = grammar_compiler(self.run)
        build = {"json_schema": compiler.json_schema, "regex": compiler.regex, "ebnf": compiler.ebnf}
        if kind == "json":
            return self.handles.put(compiler.any_json())
        if kind not in build:
            raise HostOpError(f"unknown grammar kind {kind!r}")
        return self.handles.put(build[kind](source))

    @_clean_errors
    def matcher(self, handle: Any) -> int:
        return self.handles.put(Matcher(self.handles.get(handle, Grammar, "grammar")))

    @_clean_errors
    def mask(self, handle: Any) -> list[int]:
        return self._matcher(handle).mask()

    @_clean_errors
    def accept(self, args: Any) -> bool:
        handle, tokens = _pair(args, "grammar.accept")
        return self._matcher(handle).accept_tokens(_tokens(tokens, "grammar.accept"))

    @_clean_errors
    def is_terminated(self, handle: Any) -> bool:
        return self._matcher(handle).is_terminated()

    @_clean_errors
    def fork(self, handle: Any) -> int:
        return self.handles.put(self._matcher(handle).fork())

    @_clean_errors
    def rollback(self, args: Any) -> None:
        handle, n = _pair(args, "grammar.rollback")
        self._matcher(handle).rollback(n)

    @_clean_errors
    def reset(self, handle: Any) -> None:
        self._matcher(handle).reset()


class ToolOps:
    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {"tools.equip": self.equip, "tools.answer": self.answer, "tools.grammar": self.grammar,
                "tools.decoder": self.decoder, "tools.feed": self.feed, "tools.finish": self.finish}

    def _format(self) -> ToolFormat:
        return ToolFormat(self.run.chat.source)

    @_clean_errors
    def equip(self, args: Any) -> list[int]:
        if not isinstance(args, dict):
            raise HostOpError('tools.equip takes {"specs": [...], "system": text or null}')
        system = args.get("system")
        if system is not None and not isinstance(system, str):
            raise HostOpError("tools.equip: system must be text")
        return self._format().equip(self.run.chat, args.get("specs"), system)

    @_clean_errors
    def answer(self, args: Any) -> list[int]:
        name, value = _pair(args, "tools.answer")
        return self._format().answer(self.run.chat, name, value)

    @_clean_errors
    def grammar(self, specs: Any) -> int:
        return self.handles.put(grammar_compiler(self.run).lark(self._format().grammar(specs, self.run.tok)))

    @_clean_errors
    def decoder(self, args: Any) -> int:
        return self.handles.put(ToolCallDecoder(self.run.tok, self._format().family))

    @_clean_errors
    def feed(self, args: Any) -> list[dict]:
        handle, tokens = _pair(args, "tools.feed")
        return self.handles.get(handle, ToolCallDecoder, "tool decoder").feed(_tokens(tokens, "tools.feed"))

    @_clean_errors
    def finish(self, handle: Any) -> list[dict]:
        return self.handles.get(handle, ToolCallDecoder, "tool decoder").finish()


class ReasoningOps:
    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    def ops(self) -> dict[str, Callable[[Any], Any]]:
        return {"reasoning.decoder": self.decoder, "reasoning.feed": self.feed}

    @_clean_errors
    def decoder(self, cue: Any) -> int:
        return self.handles.put(ReasoningDecoder.for_cue(self.run.tok, _tokens(cue, "reasoning.decoder")))

    @_clean_errors
    def feed(self, args: Any) -> list[dict]:
        handle, tokens = _pair(args, "reasoning.feed")
        decoder = self.handles.get(handle, ReasoningDecoder, "reasoning decoder")
        return decoder.feed(_tokens(tokens, "reasoning.feed"))
