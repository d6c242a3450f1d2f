"""Chat formatting on the host: `ChatTokens`, the token ids of conversation pieces, and `ChatOps`,
the `chat.*` host operations.

`ChatTokens` derives every piece from the model's own chat template, so the same inferlet works
on any family. `ChatOps` receives the run's `RunState` (run_state.py), whose `chat` is the model's
ChatTokens.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from typing_extensions import TypedDict

from .host import HostOpError
from .host_op import Text, host_op, shape

if TYPE_CHECKING:      # run_state.py imports chat_tokens from here
    from .run_state import RunState

__all__ = ["ChatTokens", "ChatOps", "EFFORTS", "chat_tokens"]

EFFORTS = ("none", "low", "medium", "high")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EMPTY_THINKING = "<think>\n\n</think>\n\n"      # what Qwen3's template writes to skip thinking
NOT_INCREMENTAL = "the chat template does not render conversations incrementally; cannot split it into turns"


def _msg(role: str, text: str) -> dict:
    return {"role": role, "content": text}


class ChatTokens:
    """Token ids of conversation pieces, derived from a model's chat template by rendering
    message lists and taking differences of the renders, so any template works.

    A piece is the text the template renders for some messages in the middle of a
    conversation, so that concatenating pieces gives the template's rendering of the whole
    conversation (for templates that rewrite history, such as Qwen3 dropping old thinking
    blocks, the rendering as the history of a later turn).
    """

    _FILL_SYS, _FILL_USER = "You are helpful.", "Hello."

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.template = tokenizer.chat_template
        if self.template is None:
            raise HostOpError("the model has no chat template")
        self.source = self.template.source

    # -- rendering ------------------------------------------------------------------------------

    def render(self, messages: list[dict], gen: bool = False, **kw: Any) -> str:
        return self.template.render(messages, add_generation_prompt=gen, **kw)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def context(self) -> list[dict]:
        """A stand-in conversation (system, user) for pieces that only exist inside one."""
        return [_msg("system", self._FILL_SYS), _msg("user", self._FILL_USER)]

    def _suffix(self, before: list[dict], after: list[dict], **kw: Any) -> str:
        """render(after) minus render(before), which must be a prefix of it."""
        a, b = self.render(before, **kw), self.render(after, **kw)
        if not b.startswith(a):
            raise HostOpError(NOT_INCREMENTAL)
        return b[len(a):]

    def _user_text(self, text: str, **kw: Any) -> str:
        sys = [_msg("system", self._FILL_SYS)]
        # after a system turn, so templates that insert a default system message do not
        return self._suffix(sys, sys + [_msg("user", text)], **kw)

    def turn(self, before: list[dict], new: list[dict], **kw: Any) -> str:
        """The text of messages `new` after `before`, as rendered when a user turn follows them
        (templates such as Qwen3 render a turn differently when it is the last one)."""
        closing = self._user_text(self._FILL_USER, **kw)
        full = self.render(before + new + [_msg("user", self._FILL_USER)], **kw)
        if not before:
            head = ""
        elif before[-1]["role"] == "user":
            head = self.render(before, **kw)          # nothing after a user turn changes it
        else:                                          # its rendering may depend on what follows
            head = self.render(before + [_msg("user", self._FILL_USER)], **kw)
            head = head[:len(head) - len(closing)] if head.endswith(closing) else None
        if head is None or not full.startswith(head) or not full.endswith(closing):
            raise HostOpError(NOT_INCREMENTAL)
        return full[len(head):len(full) - len(closing)]

    def _cue_text(self, **kw: Any) -> str:
        ctx = self.context()
        a, b = self.render(ctx, **kw), self.render(ctx, gen=True, **kw)
        if not b.startswith(a):
            raise HostOpError("the chat template's generation prompt changes the conversation before it")
        return b[len(a):]

    # -- pieces ---------------------------------------------------------------------------------

    def prefix(self) -> list[int]:
        if self.tok.add_bos_token and self.tok.bos_id is not None:
            return [self.tok.bos_id]
        return []

    def system(self, text: str) -> list[int]:
        # the opening turn: the whole render (with whatever the template puts first, e.g. BOS)
        return self.encode(self.render([_msg("system", text)]))

    def system_user(self, system: str, user: str) -> list[int]:
        """The opening system and user turns together (templates may merge them into one)."""
        return self.encode(self.render([_msg("system", system), _msg("user", user)]))

    def first_user(self, text: str) -> list[int]:
        """The opening user turn of a conversation without a system message (with whatever the
        template puts before it: a default system message, a date header...)."""
        return self.encode(self.render([_msg("user", text)]))

    def system_thinking(self, text: str, effort: str) -> list[int]:
        """An opening system turn that sets the reasoning effort, the way the template can:
        its `reasoning_effort` variable (gpt-oss style), else the `/think` / `/no_think`
        switches of templates with `enable_thinking` (Qwen3: on or off only), else a plain
        system turn (the model has no such control)."""
        if effort not in EFFORTS:
            raise HostOpError(f"reasoning effort must be one of {', '.join(EFFORTS)}; got {effort!r}")
        if "reasoning_effort" in self.source:
            return self.encode(self.render([_msg("system", text)], reasoning_effort=effort))
        if "enable_thinking" in self.source:
            text = f"{text} {'/no_think' if effort == 'none' else '/think'}"
        return self.system(text)

    def user(self, text: str) -> list[int]:
        return self.encode(self._user_text(text))

    def assistant(self, text: str) -> list[int]:
        """A complete assistant turn, as the history before a later user turn."""
        return self.encode(self.turn(self.context(), [_msg("assistant", text)]))

    @lru_cache(maxsize=None)
    def cue(self) -> list[int]:
        return self.encode(self._cue_text())

    @lru_cache(maxsize=None)
    def cue_thinking(self, thinking: bool) -> list[int]:
        """The start of the reply with thinking on (whatever the template writes for it, e.g.
        an opening `<think>`) or off (`cue_without_thinking`)."""
        if not thinking:
            return self.cue_without_thinking()
        return self.encode(self._cue_text(enable_thinking=True))

    @lru_cache(maxsize=None)
    def cue_without_thinking(self) -> list[int]:
        if "enable_thinking" in self.source:          # Qwen3 style: the template writes the empty block
            return self.encode(self._cue_text(enable_thinking=False))
        cue = self._cue_text()
        if THINK_OPEN in self.source and THINK_CLOSE not in cue:
            opened = cue.rstrip("\n").endswith(THINK_OPEN)   # the template pre-fills the opening tag
            cue = cue.rstrip("\n")[:-len(THINK_OPEN)] + EMPTY_THINKING if opened else cue + EMPTY_THINKING
        return self.encode(cue)

    @lru_cache(maxsize=None)
    def seal(self) -> list[int]:
        """What closes an assistant turn after its text (<|im_end|>\\n, <|eot_id|>...): append it
        to a reply whose stop token was not fed back, before the next turn."""
        marker = "MARKER"
        turn = self.turn(self.context(), [_msg("assistant", marker)])
        return self.encode(turn[turn.rfind(marker) + len(marker):])

    @lru_cache(maxsize=None)
    def stop_tokens(self) -> list[int]:
        stops = list(self.tok.eos_ids)
        eot = self._end_of_turn()
        if eot is not None and eot not in stops:
            stops.append(eot)
        return stops

    def _end_of_turn(self) -> int | None:
        """The first special token of `seal` (<|im_end|>, <|eot_id|>...)."""
        try:
            seal = self.seal()
        except Exception:
            return None
        specials = set(self.tok.backend.get_added_tokens_decoder()) if hasattr(
            self.tok.backend, "get_added_tokens_decoder") else set()
        for t in seal:
            if t in specials:
                return t
        return None


@lru_cache(maxsize=8)
def chat_tokens(tokenizer) -> ChatTokens:
    """The ChatTokens of a tokenizer (one per tokenizer: its pieces are cached)."""
    return ChatTokens(tokenizer)


@shape
class SystemUser(TypedDict):
    system: str
    user: str


@shape
class SystemThinking(TypedDict):
    text: str
    effort: str


@shape
class Thinking(TypedDict):
    thinking: bool


class ChatOps:
    interface = "chat"

    def __init__(self, run: RunState) -> None:
        self.run = run

    @host_op("chat.prefix")
    def prefix(self) -> list[int]:
        return self.run.chat.prefix()

    @host_op("chat.system", Text)
    def system(self, text: str) -> list[int]:
        return self.run.chat.system(text)

    @host_op("chat.user", Text)
    def user(self, text: str) -> list[int]:
        return self.run.chat.user(text)

    @host_op("chat.assistant", Text)
    def assistant(self, text: str) -> list[int]:
        return self.run.chat.assistant(text)

    @host_op("chat.system_user", SystemUser, wire="list")
    def system_user(self, system: str, user: str) -> list[int]:
        return self.run.chat.system_user(system, user)

    @host_op("chat.first_user", Text)
    def first_user(self, text: str) -> list[int]:
        return self.run.chat.first_user(text)

    @host_op("chat.system_thinking", SystemThinking, wire="list")
    def system_thinking(self, text: str, effort: str) -> list[int]:
        return self.run.chat.system_thinking(text, effort)

    @host_op("chat.cue")
    def cue(self) -> list[int]:
        return self.run.chat.cue()

    @host_op("chat.cue_without_thinking")
    def cue_without_thinking(self) -> list[int]:
        return self.run.chat.cue_without_thinking()

    @host_op("chat.cue_thinking", Thinking)
    def cue_thinking(self, thinking: bool) -> list[int]:
        return self.run.chat.cue_thinking(thinking)

    @host_op("chat.seal")
    def seal(self) -> list[int]:
        return self.run.chat.seal()

    @host_op("chat.stop_tokens")
    def stop_tokens(self) -> list[int]:
        return self.run.chat.stop_tokens()
