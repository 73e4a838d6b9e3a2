"""Incremental detokenization with stop sequences, for streaming text out of token ids.

Decoding follows the prefix/read-offset method of TGI and vLLM: the text of the newest tokens is
the difference between decoding a short window with and without them, and is held back while it
ends in an incomplete UTF-8 sequence. Text that could still be the beginning of a stop sequence
is held back too, and the output ends before the first stop sequence found.
"""
from __future__ import annotations

from collections.abc import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.text = ""  # all decoded text so far (up to a stop sequence, if one matched)
        self.emitted = 0  # characters of `text` handed out by take()
        self.stopped = False
        self._prefix = 0  # token offsets of the decoding window
        self._read = 0

    def push(self, token_id: int) -> bool:
        """Adds one token; returns True when a stop sequence matched (the text now ends before it)."""
        if self.stopped:
            raise RuntimeError("TextStream already stopped")
        start = self._advance([token_id])
        return False if start is None else self._check_stop(start)

    def extend(self, token_ids: Sequence[int]) -> None:
        """Adds a step's tokens at once: two decodes for the step instead of two per token.
        Only without stop sequences (they are looked for token by token, with `push`)."""
        if self.stop:
            raise RuntimeError("a stream with stop sequences takes its tokens one by one (push)")
        if self.stopped:
            raise RuntimeError("TextStream already stopped")
        if token_ids:
            self._advance(token_ids)

    def _advance(self, token_ids: Sequence[int]) -> int | None:
        """Appends the tokens and the text they complete; returns where that text starts in
        `text`, None while it is still an incomplete UTF-8 sequence."""
        self.ids.extend(token_ids)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = len(self.text)
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
            return start
        return None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""

    def _check_stop(self, start: int) -> bool:
        longest = max((len(s) for s in self.stop), default=0)
        window_start = max(0, start - longest + 1)
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True
        return self.stopped

    def take(self) -> str:
        """Text not handed out yet, minus a tail that may still begin a stop sequence."""
        end = len(self.text) if self.stopped else len(self.text) - self._held_back()
        piece = self.text[self.emitted:end]
        self.emitted = max(self.emitted, end)
        return piece

    def finish(self) -> str:
        """All remaining text (call at the end of the generation)."""
        piece = self.text[self.emitted:]
        self.emitted = len(self.text)
        return piece

    def _held_back(self) -> int:
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
