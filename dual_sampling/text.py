"""Generated text and stop strings: one definition, shared by the teacher scheduler and the driver.

A sample's text is its generated token ids decoded alone (special tokens skipped), never
primed with the prompt, so every process that decodes them gets the same string. A stop
string ends a sample at the first token whose text completes an occurrence of it, once at
least ``min_tokens`` tokens were generated; occurrences completed earlier do not count.
The sample's text ends before the stop string; a sample ended by a stop token (an EOS or
a stop token id) leaves that token's text out, as vLLM does. Only the teacher scheduler
looks for stop strings, so both engines end a sample at the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["StopStringWatch", "decode", "engine_tokenizer", "sample_text"]

_ENGINE_TOKENIZER_KEY = dict(runner_type="generate", tokenizer_mode="auto", revision=None, trust_remote_code=False)
"""What vLLM's ``cached_tokenizer_from_config`` passes to its cache besides the folder for our engines' settings
(vLLM's defaults), in its order: an ``lru_cache`` key is order-sensitive. A test checks it against a running engine's
``ModelConfig``."""


def engine_tokenizer(folder: str) -> Any:
    """The Hugging Face tokenizer of ``folder``, the very object vLLM's engines in this process use for it.

    Every engine of a dual engine loads the first teacher's tokenizer through vLLM's per-process ``lru_cache``
    (``vllm.tokenizers.cached_tokenizer_from_config``: the front end in the driver, the structured-output manager in
    an EngineCore). Taken from that cache under the same key, the driver's checks and prompts, the leading
    scheduler's stop strings and vLLM share one load per process, and a later dual engine on the same folders loads
    none (a 49k-token tokenizer takes about 0.5 s). Like vLLM's, it stays for the life of the process (also a folder
    loaded only to be compared) and is not reloaded if the folder's files change meanwhile. Read-only: it is vLLM's."""
    from vllm.tokenizers import cached_get_tokenizer

    return cached_get_tokenizer(str(folder), **_ENGINE_TOKENIZER_KEY)


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """The text of generated tokens, decoded on their own."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _new_occurrence(before: str, after: str, stop: str) -> int:
    """Position in ``after`` of an occurrence of ``stop`` that ends beyond the text it shares with ``before``, else -1.

    ``before`` is the text one token earlier. A character that the new token completed (U+FFFD
    in ``before``) or text a decoder's clean-up changed is new text too, not only what was added.
    """
    return after.find(stop, max(0, _common_prefix(before, after) - len(stop) + 1))


class StopStringWatch:
    """Finds the stop string completed by the newest token of one growing sample (one watch per sample).

    Incremental: each :meth:`check` decodes only the tokens added since the last one (with a
    few before them, for decoders that treat a leading space specially) and searches the new
    text together with the last characters before it, one fewer than the longest stop string.
    Its cost per token grows with neither the sample nor the stop strings' lengths.
    """

    _CONTEXT = 6
    """Tokens decoded before the new ones, so a decoder's leading-space handling falls on settled text."""
    _MAX_UNSETTLED = 4
    """A character takes at most 4 byte tokens: text still incomplete after that many is settled as it is."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        if not self.stops or not all(isinstance(s, str) and s for s in self.stops):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stops)!r}")
        self.keep = max(map(len, self.stops)) - 1
        self._read = 0
        """Tokens whose text is settled."""
        self._tail = ""
        """The last ``keep`` characters of the settled text."""

    def check(self, token_ids: Sequence[int]) -> int | None:
        """Index of the stop string that the newest token completes, else None; call it as tokens are added."""
        end = len(token_ids)
        if end <= self._read:
            return None
        if self._read < end - 1:
            # Tokens never checked (before min_tokens): occurrences they complete do not count.
            self._settle(decode(self.tokenizer, token_ids[: end - 1]), end - 1)
        start = max(0, self._read - self._CONTEXT)
        before = decode(self.tokenizer, token_ids[start : self._read])
        now = decode(self.tokenizer, token_ids[start:end])
        # Text the new tokens changed before them (a character completed, a decoder's clean-up of spaces) is
        # new text: it replaces the end of the tail instead of repeating it.
        common = _common_prefix(before, now)
        base = self._tail[: max(0, len(self._tail) - (len(before) - common))]
        text = base + now[common:]
        found = next((i for i, stop in enumerate(self.stops) if _new_occurrence(base, text, stop) >= 0), None)
        # A character still being built from byte tokens is decoded again with the next token.
        if not now.endswith("\ufffd") or end - self._read >= self._MAX_UNSETTLED:
            self._settle(text, end)
        return found

    def _settle(self, text: str, read: int) -> None:
        self._tail, self._read = text[max(0, len(text) - self.keep) :], read


def sample_text(
    tokenizer: Any, token_ids: Sequence[int], stop_string: str | None = None, stop_token: bool = False
) -> str:
    """A sample's text: its tokens decoded, cut before the stop string that ended it, or without its stop token."""
    if stop_token and token_ids:
        return decode(tokenizer, token_ids[:-1])
    text = decode(tokenizer, token_ids)
    if stop_string is None or not token_ids:
        return text
    position = _new_occurrence(decode(tokenizer, token_ids[:-1]), text, stop_string)
    return text[:position] if position >= 0 else text


class TextStream:
    """A sample's text as its tokens arrive: each :meth:`push` returns only text that the end cannot take back.

    Held back until more tokens come: a character still being built from byte tokens, the
    text of a token that would end the sample as a stop token, and the last characters
    that could begin a stop string. :meth:`finish` returns the rest of the final text, so
    the pieces always join into :func:`sample_text`. Each push decodes a few tokens before
    the new ones too, so tokenizers that treat a leading space specially still join right.
    """

    _CONTEXT = 6
    """Tokens decoded before the new ones, so a decoder's leading-space handling falls on text already sent."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = (), stop_token_ids: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.stop_token_ids = frozenset(stop_token_ids)
        self.ids: list[int] = []
        self.text = ""
        """Text of ``ids[:self._read]``, decoded incrementally."""
        self.sent = 0
        """Characters of ``self.text`` already returned."""
        self._read = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that can be shown now."""
        self.ids += token_ids
        end = len(self.ids) - (1 if self.ids and self.ids[-1] in self.stop_token_ids else 0)
        if end > self._read:
            start = max(0, self._read - self._CONTEXT)
            before = decode(self.tokenizer, self.ids[start : self._read])
            now = decode(self.tokenizer, self.ids[start:end])
            if not now.endswith("\ufffd") and now.startswith(before):
                self.text += now[len(before) :]
                self._read = end
        visible = max(self.sent, len(self.text) - self.hold)
        piece, self.sent = self.text[self.sent : visible], visible
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the sample's final text, after everything :meth:`push` returned."""
        shown = self.text[: self.sent]
        return final_text[len(shown) :] if final_text.startswith(shown) else final_text
