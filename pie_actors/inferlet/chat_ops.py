"""Chat formatting on the host: the token ids of conversation pieces (`chat.*` host operations).

`ChatTokens` derives every piece from the model's own chat template, so the same inferlet works
on any family. `ChatOps` is the mixin that gives `InferletHost` the `chat.*` operations; it only
needs the host's `tok` (the model's Tokenizer).
"""
from __future__ import annotations

from functools import lru_cache

from .host import HostOpError

__all__ = ["ChatTokens", "ChatOps"]


class ChatTokens:
    """Token ids of conversation pieces, derived from a model's chat template by rendering
    message lists and taking differences of the renders, so any template works."""

    _FILL_SYS, _FILL_USER = "You are helpful.", "Hello."

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self.template = tokenizer.chat_template
        if self.template is None:
            raise HostOpError("the model has no chat template")
        self.source = self.template.source

    def _render(self, messages, gen: bool = False, **kw) -> str:
        return self.template.render(messages, add_generation_prompt=gen, **kw)

    def _diff(self, before: list[dict], after: list[dict], gen_before=False, gen_after=False, **kw) -> str:
        a, b = self._render(before, gen_before, **kw), self._render(after, gen_after, **kw)
        if not b.startswith(a):
            raise HostOpError("the chat template does not render conversations incrementally; "
                              "cannot split it into turns")
        return b[len(a):]

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    @staticmethod
    def _msg(role: str, text: str) -> dict:
        return {"role": role, "content": text}

    def prefix(self) -> list[int]:
        if self.tok.add_bos_token and self.tok.bos_id is not None:
            return [self.tok.bos_id]
        return []

    def system(self, text: str) -> list[int]:
        # the opening turn: the whole render (with whatever the template puts first, e.g. BOS)
        return self._encode(self._render([self._msg("system", text)]))

    def user(self, text: str) -> list[int]:
        # after a system turn, so templates that insert a default system message do not
        return self._encode(self._diff([self._msg("system", self._FILL_SYS)],
                                       [self._msg("system", self._FILL_SYS), self._msg("user", text)]))

    def assistant(self, text: str) -> list[int]:
        ctx = [self._msg("system", self._FILL_SYS), self._msg("user", self._FILL_USER)]
        return self._encode(self._diff(ctx, ctx + [self._msg("assistant", text)]))

    @lru_cache(maxsize=None)
    def cue(self) -> list[int]:
        ctx = [self._msg("system", self._FILL_SYS), self._msg("user", self._FILL_USER)]
        return self._encode(self._diff(ctx, ctx, gen_after=True))

    @lru_cache(maxsize=None)
    def cue_without_thinking(self) -> list[int]:
        ctx = [self._msg("system", self._FILL_SYS), self._msg("user", self._FILL_USER)]
        if "enable_thinking" in self.source:          # Qwen3 style: the template writes the empty block
            return self._encode(self._diff(ctx, ctx, gen_after=True, enable_thinking=False))
        cue = self._diff(ctx, ctx, gen_after=True)
        if "<think>" in self.source and "<think>" not in cue:
            cue += "<think>\n\n</think>\n\n"
        return self._encode(cue)

    @lru_cache(maxsize=None)
    def stop_tokens(self) -> list[int]:
        stops = list(self.tok.eos_ids)
        eot = self._end_of_turn()
        if eot is not None and eot not in stops:
            stops.append(eot)
        return stops

    def _end_of_turn(self) -> int | None:
        """The first special token after an assistant turn's text (<|im_end|>, <|eot_id|>...)."""
        marker = "MARKER"
        try:
            turn = self._diff([self._msg("system", self._FILL_SYS), self._msg("user", self._FILL_USER)],
                              [self._msg("system", self._FILL_SYS), self._msg("user", self._FILL_USER),
                               self._msg("assistant", marker)])
        except Exception:
            return None
        tail = turn[turn.rfind(marker) + len(marker):]
        specials = set(self.tok.backend.get_added_tokens_decoder()) if hasattr(
            self.tok.backend, "get_added_tokens_decoder") else set()
        for t in self._encode(tail):
            if t in specials:
                return t
        return None


@lru_cache(maxsize=8)
def _chat_tokens(tokenizer) -> ChatTokens:
    return ChatTokens(tokenizer)


class ChatOps:
    """The `chat.*` host operations (mixed into InferletHost, which provides `tok`)."""

    CHAT_OPS: dict[str, str] = {
        "chat.prefix": "_chat_prefix", "chat.system": "_chat_system", "chat.user": "_chat_user",
        "chat.assistant": "_chat_assistant", "chat.cue": "_chat_cue",
        "chat.cue_without_thinking": "_chat_cue_without_thinking",
        "chat.stop_tokens": "_chat_stop_tokens",
    }

    @property
    def chat(self) -> ChatTokens:
        return _chat_tokens(self.tok)

    def _chat_prefix(self, args) -> list[int]:
        return self.chat.prefix()

    def _chat_system(self, text) -> list[int]:
        return self.chat.system(str(text))

    def _chat_user(self, text) -> list[int]:
        return self.chat.user(str(text))

    def _chat_assistant(self, text) -> list[int]:
        return self.chat.assistant(str(text))

    def _chat_cue(self, args) -> list[int]:
        return self.chat.cue()

    def _chat_cue_without_thinking(self, args) -> list[int]:
        return self.chat.cue_without_thinking()

    def _chat_stop_tokens(self, args) -> list[int]:
        return self.chat.stop_tokens()
