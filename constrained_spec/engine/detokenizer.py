"""Incremental detokenization with stop strings.

Decodes a small window of recent tokens so multi-byte characters split across tokens come out
whole, and holds back text that could still turn into a stop string.

This runs for every token of every request on the engine thread, so it calls the Rust
`tokenizers.Tokenizer` behind a fast Hugging Face tokenizer directly: the same text as
`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, without the
Python wrapper that costs several times the decoding itself.

Each token decodes two windows: the text before it (usually the one token before it) and the text
with it. The one-token windows come from a per-tokenizer table of single-token decodes (exact: a
decode of the same ids is the same text), so a token usually costs one call into the tokenizer.

Under stop strings the tokens are held back with their text (`release`): an update hands out whole
tokens' text and lists those tokens, and a matched stop string's tokens are never listed, so that
the tokens (and their logprobs) of an answer, and of each streamed chunk, join to its text.
"""
from __future__ import annotations

import weakref
from bisect import bisect_left, bisect_right

# tokenizer -> {token id: decode([id])}; at most one entry per vocabulary entry
_SINGLE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _single_decodes(tokenizer) -> dict:
    try:
        table = _SINGLE.get(tokenizer)
        if table is None:
            table = _SINGLE[tokenizer] = {}
        return table
    except TypeError:  # not weak-referenceable: a table for this detokenizer alone
        return {}


def first_stop(text: str, stops: list[str]) -> tuple[int, str] | None:
    """The stop string in `text` that ends first (of two that end together, the longer) and where it
    starts, or None. Text fed in pieces, a stop string's length - 1 characters kept back each time
    (`hold`), finds the same one where the pieces are cut."""
    best = None
    for s in stops:
        at = text.find(s)
        if at != -1 and (best is None or (at + len(s), at) < (best[0] + len(best[1]), best[0])):
            best = (at, s)
    return best


def stop_hold(stops: list[str]) -> int:
    """How many characters of text fed in pieces wait for the next piece: a stop string may begin there."""
    return max((len(s) for s in stops), default=1) - 1


class StopScan:
    """Text in pieces, let through up to the first stop string (`first_stop`, as the detokenizer
    finds one): the last `stop_hold` characters wait for the next piece, or the end (a tool call's
    visible text: server/tools.py)."""

    def __init__(self, stops):
        self.stops = list(stops)
        self.hold = stop_hold(self.stops)
        self.matched: str | None = None
        self._held = ""

    def feed(self, piece: str, final: bool) -> str:
        if self.matched is not None:
            return ""
        text = self._held + piece
        hit = first_stop(text, self.stops)
        if hit is not None:
            self._held, self.matched = "", hit[1]
            return text[:hit[0]]
        cut = len(text) if final else max(0, len(text) - self.hold)
        self._held = text[cut:]
        return text[:cut]


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        # called as decode(ids, skip_special_tokens) with both arguments positional
        self._decode_ids = (backend.decode if backend is not None else
                            lambda ids, skip_special_tokens: tokenizer.decode(
                                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False))
        self._single = _single_decodes(tokenizer)
        self.ids = list(prompt_ids[-6:])  # a little prompt context for leading-space handling
        self.prefix_offset = max(len(self.ids) - 1, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = stop_hold(self.stop)
        self.emitted = 0  # characters of `text` handed to the caller
        self._pending = ""  # decoded text not handed out yet (the end of `text`)
        self._stopped = False  # a stop string was found: nothing after it is text
        # a stop string found only by the final take, in the text its last tokens held back (the
        # request ended by its length there, and ends by the stop string instead)
        self.late_stop: str | None = None
        self._out: list[str] = []  # the text handed out, in pieces (joined now and then)
        # under stop strings (`release`): per decoded output token, where its text starts in the
        # output (the tokens decoded together, a character split across them, start together);
        # characters decoded; where a matched stop string cut the text; tokens not released yet
        self._starts: list[int] = []
        self._chars = 0
        self._cut = 0
        self._held_ids: list[int] = []
        self._held_lps: list = []
        self._released = 0

    @property
    def text(self) -> str:
        """All output text decoded so far (cut at a stop string once one is found)."""
        return "".join(self._out) + self._pending

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, True)

    def add(self, new_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now appears in the output."""
        ids = self.ids
        ids.extend(new_ids)
        start, read = self.prefix_offset, self.read_offset
        if read - start == 1:
            prefix = self._single.get(ids[start])
            if prefix is None:
                prefix = self._single[ids[start]] = self._decode_ids(ids[start:read], True)
        else:
            prefix = self._decode_ids(ids[start:read], True)
        full = self._decode_ids(ids[start:], True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._append(full[len(prefix):], start, read, len(prefix))
        return self._cut_at_stop() if self.stop else None

    def _append(self, piece: str, start: int, read: int, base: int) -> None:
        """The text of ids[read:] (decoded after ids[start:read], `base` characters) joins the output."""
        self._pending += piece
        if self.stop:
            self._note_starts(self.ids, start, read, base)
            self._chars += len(piece)
        self.prefix_offset = read
        self.read_offset = len(self.ids)

    def _cut_at_stop(self) -> str | None:
        """The stop string the pending text now holds, cut there (callers have stop strings). One that
        completes now lies in it: `take` keeps back the last `hold` characters (a stop string's
        length - 1), so none of one can have been handed out."""
        hit = first_stop(self._pending, self.stop)
        if hit is None:
            return None
        at, s = hit
        self._cut = self._chars - len(self._pending) + at
        self._pending = self._pending[:at]
        self._stopped = True
        return s

    def _note_starts(self, ids: list[int], start: int, read: int, base: int) -> None:
        """Where the text of each token decoded now (ids[read:]) starts: one decode per token past
        the first (a token inside a character starts where the character does)."""
        starts, at = self._starts, self._chars
        starts.append(at)
        for j in range(read + 1, len(ids)):
            text = self._decode_ids(ids[start:j], True).rstrip("\ufffd")
            at = max(at, self._chars + len(text) - base)
            starts.append(at)

    def take(self, final: bool) -> str:
        """The text not yet handed out; keeps back a possible stop-string prefix unless final. The
        final take first adds one by one the tokens still held back because their text ended
        inside a character: the text is then what a token-by-token feed gives (an unfinished last
        character left out), however the tokens came. Held back whole, several tokens added at
        once (a speculative step's) lost all their text when the request ended there."""
        if final and not self._stopped and self.read_offset < len(self.ids):
            held = self.ids[self.read_offset:]
            del self.ids[self.read_offset:]
            for token in held:
                self.late_stop = self.add([token]) or self.late_stop
            if not self._stopped and self.read_offset < len(self.ids):
                self.late_stop = self._append_whole_characters()
        pending = self._pending
        if final or not self.stop:
            out, self._pending = pending, ""
        else:
            cut = self._token_bound(max(0, len(pending) - self.hold))
            out, self._pending = pending[:cut], pending[cut:]
        if out:
            self.emitted += len(out)
            parts = self._out
            parts.append(out)
            if len(parts) >= 256:  # (text is kept for `text` only; a list, so no step copies it all)
                self._out = ["".join(parts)]
        return out

    def _append_whole_characters(self) -> str | None:
        """At the end, the text of the last tokens up to the character they end inside: a token of a
        space and an emoji's first bytes holds the space (it was left out with the emoji). Returns
        the stop string that text completes, if any."""
        ids, start, read = self.ids, self.prefix_offset, self.read_offset
        prefix = self._decode_ids(ids[start:read], True)
        whole = self._decode_ids(ids[start:], True).rstrip("\ufffd")
        if len(whole) <= len(prefix):
            return None
        self._append(whole[len(prefix):], start, read, len(prefix))
        return self._cut_at_stop() if self.stop else None

    def _token_bound(self, cut: int) -> int:
        """`cut` (characters of the pending text that may go out) moved back to where a token's text
        starts, unless it takes all of it: a chunk hands out its tokens' text whole, so the tokens
        `release` lists with it (and their logprobs) are its text, not a token whose end waits."""
        if cut >= len(self._pending) or not self._starts:
            return cut
        at = self.emitted + cut
        i = bisect_right(self._starts, at) - 1
        return max(0, self._starts[i] - self.emitted) if i >= 0 else 0

    def release(self, ids: list[int], logprobs: list | None, final: bool) -> tuple[list[int], list | None]:
        """After `take`: of the tokens held back and `ids` (with their logprobs, if any), those
        whose text begins in what `take` has handed out. Without stop strings, `ids` as they come.
        Under stop strings a token whose text is held back (it may begin a stop string) waits with
        it, and the tokens of a matched stop string are dropped at the end (a token that begins
        before the stop string and ends inside it is kept: it holds some of the text)."""
        if not self.stop:
            return ids, logprobs
        held, held_lps = self._held_ids, self._held_lps
        held += ids
        if logprobs:
            held_lps += logprobs
        if final and not self._stopped:
            n = len(held)
        else:
            n = bisect_left(self._starts, self._cut if self._stopped else self.emitted) - self._released
            n = max(0, min(n, len(held)))
        out, out_lps = held[:n], held_lps[:n]
        if final:
            held.clear()
            held_lps.clear()
        else:
            del held[:n], held_lps[:n]
        self._released += n
        return out, (out_lps or None)


class _NoText:
    """The detokenizer of a request whose caller detokenizes itself (`add_request(detokenize=False)`):
    no text, no stop strings."""
    stop: list[str] = []
    text = ""
    late_stop = None

    def add(self, new_ids: list[int]) -> None:
        return None

    def take(self, final: bool) -> str:
        return ""

    def release(self, ids: list[int], logprobs: list | None, final: bool) -> tuple[list[int], list | None]:
        return ids, logprobs


NO_TEXT = _NoText()
