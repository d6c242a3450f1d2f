"""Token ids to text as they stream in, for the decoders that look for tags in generated text."""
from __future__ import annotations

__all__ = ["TextStream", "tag_prefix_len"]


class TextStream:
    """Decodes a growing token stream incrementally.

    `feed(tokens)` returns the text the new tokens complete. A character split across tokens
    (byte-level BPE spells some characters in several tokens) is held back until its last
    token arrives, so no "\\ufffd" leaks out. Special tokens are kept as their text (a
    `<think>` that is one added token still reads "<think>").
    """

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer
        self._tokens: list[int] = []
        self._prefix = 0     # start of the window decoded again for context
        self._read = 0       # tokens whose text has been returned

    def feed(self, tokens: list[int]) -> str:
        """The text `tokens` complete; a ValueError (an id out of the vocabulary) leaves the
        stream as it was."""
        n = len(self._tokens)
        self._tokens.extend(tokens)
        # decode a short window, not the whole history: (prefix..read) for context, then the new ids
        before = self.tok.decode(self._tokens[self._prefix:self._read])
        try:
            after = self.tok.decode(self._tokens[self._prefix:])
        except ValueError:
            del self._tokens[n:]
            raise
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return after[len(before):]


def tag_prefix_len(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`: the part of streamed
    text to hold back until the next tokens tell whether it is the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
