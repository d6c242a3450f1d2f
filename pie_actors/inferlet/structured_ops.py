"""The `grammar.*`, `tools.*` and `reasoning.*` host operations: `GrammarOps`, `ToolOps`, `ReasoningOps`.

Each receives the run's `RunState` (for `tok`, the model's Tokenizer, `chat`, its ChatTokens, and
`info["vocab_size"]`, the model's output vocabulary) and the run's one `HandleTable`: the guest SDK
holds integer handles, and the grammars, matchers and decoders behind them live there, whichever
interface made them (`tools.grammar` makes a grammar for `grammar.matcher`).

Each op's arguments and result: the table in ops.py.

Bad input (an invalid schema, regex or grammar, unknown handles, malformed tool specs) fails
the operation with a message; the guest sees HostError.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Literal

from typing_extensions import NotRequired, TypedDict

from .grammar import Grammar, GrammarCompiler, Matcher
from .host import HostOpError
from .host_op import Handle, HandleTokens, Tokens, host_op, shape
from .reasoning import ReasoningDecoder
from .run_state import RunState
from .tools import ToolCallDecoder, ToolFormat

__all__ = ["HandleTable", "GrammarOps", "ToolOps", "ReasoningOps"]


def _clean_errors(op: Callable) -> Callable:
    """Report the plain classes' ValueErrors (GrammarError, ToolError, bad token ids) as the
    operation's own message, without a Python type name in front."""
    @functools.wraps(op)
    def wrapped(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return op(self, *args, **kwargs)
        except HostOpError:
            raise
        except ValueError as e:
            raise HostOpError(str(e)) from None
    return wrapped


@shape
class Compile(TypedDict):
    kind: Literal["json_schema", "regex", "ebnf", "json"]
    source: dict[str, Any] | str | None      # a JSON schema (or its text), a regex, a grammar; json: null


@shape
class Rollback(TypedDict):
    handle: int
    n: int


@shape
class Equip(TypedDict):
    specs: list[dict[str, Any]]       # OpenAI-style tool specs, or their bare function objects
    system: NotRequired[str | None]


@shape
class Answer(TypedDict):
    name: str
    value: Any


@shape
class Specs(TypedDict):
    specs: list[dict[str, Any]]       # OpenAI-style tool specs, or their bare function objects


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

    def get(self, handle: int, kind: type, what: str) -> Any:
        """The object of `handle`, which must be a `kind` (`what` names it in the error)."""
        obj = self._objects.get(handle)
        if not isinstance(obj, kind):
            raise HostOpError(f"unknown {what} {handle!r}")
        return obj


class GrammarOps:
    interface = "grammar"

    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    def _matcher(self, handle: int) -> Matcher:
        return self.handles.get(handle, Matcher, "matcher")

    @host_op("grammar.compile", Compile, wire="list")
    @_clean_errors
    def compile(self, kind: str, source: dict[str, Any] | str | None) -> int:
        compiler = grammar_compiler(self.run)
        if kind == "json":
            return self.handles.put(compiler.any_json())
        build = {"json_schema": compiler.json_schema, "regex": compiler.regex, "ebnf": compiler.ebnf}
        return self.handles.put(build[kind](source))

    @host_op("grammar.matcher", Handle)
    @_clean_errors
    def matcher(self, handle: int) -> int:
        return self.handles.put(Matcher(self.handles.get(handle, Grammar, "grammar")))

    @host_op("grammar.mask", Handle)
    @_clean_errors
    def mask(self, handle: int) -> list[int]:
        return self._matcher(handle).mask()

    @host_op("grammar.accept", HandleTokens, wire="list")
    @_clean_errors
    def accept(self, handle: int, tokens: list[int]) -> bool:
        return self._matcher(handle).accept_tokens(tokens)

    @host_op("grammar.is_terminated", Handle)
    @_clean_errors
    def is_terminated(self, handle: int) -> bool:
        return self._matcher(handle).is_terminated()

    @host_op("grammar.fork", Handle)
    @_clean_errors
    def fork(self, handle: int) -> int:
        return self.handles.put(self._matcher(handle).fork())

    @host_op("grammar.rollback", Rollback, wire="list")
    @_clean_errors
    def rollback(self, handle: int, n: int) -> None:
        self._matcher(handle).rollback(n)

    @host_op("grammar.reset", Handle)
    @_clean_errors
    def reset(self, handle: int) -> None:
        self._matcher(handle).reset()


class ToolOps:
    interface = "tools"

    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    def _format(self) -> ToolFormat:
        return ToolFormat(self.run.chat.source)

    @host_op("tools.equip", Equip)
    @_clean_errors
    def equip(self, specs: list[dict[str, Any]], system: str | None = None) -> list[int]:
        return self._format().equip(self.run.chat, specs, system)

    @host_op("tools.answer", Answer, wire="list")
    @_clean_errors
    def answer(self, name: str, value: Any) -> list[int]:
        return self._format().answer(self.run.chat, name, value)

    @host_op("tools.grammar", Specs)
    @_clean_errors
    def grammar(self, specs: list[dict[str, Any]]) -> int:
        return self.handles.put(grammar_compiler(self.run).lark(self._format().grammar(specs, self.run.tok)))

    @host_op("tools.decoder")
    @_clean_errors
    def decoder(self) -> int:
        return self.handles.put(ToolCallDecoder(self.run.tok, self._format().family))

    @host_op("tools.feed", HandleTokens, wire="list")
    @_clean_errors
    def feed(self, handle: int, tokens: list[int]) -> list[dict]:
        return self.handles.get(handle, ToolCallDecoder, "tool decoder").feed(tokens)

    @host_op("tools.finish", Handle)
    @_clean_errors
    def finish(self, handle: int) -> list[dict]:
        return self.handles.get(handle, ToolCallDecoder, "tool decoder").finish()


class ReasoningOps:
    interface = "reasoning"

    def __init__(self, run: RunState, handles: HandleTable) -> None:
        self.run, self.handles = run, handles

    @host_op("reasoning.decoder", Tokens)
    @_clean_errors
    def decoder(self, tokens: list[int]) -> int:
        """A decoder of the reasoning that follows the reply's cue `tokens`."""
        return self.handles.put(ReasoningDecoder.for_cue(self.run.tok, tokens))

    @host_op("reasoning.feed", HandleTokens, wire="list")
    @_clean_errors
    def feed(self, handle: int, tokens: list[int]) -> list[dict]:
        return self.handles.get(handle, ReasoningDecoder, "reasoning decoder").feed(tokens)
