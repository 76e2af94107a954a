"""Incremental detokenization with stop strings.

Decodes a small window of recent tokens so multi-byte characters split across tokens come out
whole, and holds back text that could still turn into a stop string.

This runs for every token of every request on the engine thread, so it calls the Rust
`tokenizers.Tokenizer` behind a fast Hugging Face tokenizer directly: the same text as
`tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)`, without the
Python wrapper that costs several times the decoding itself.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._decode_ids = (backend.decode if backend is not None else
                            lambda ids, skip_special_tokens: tokenizer.decode(
                                ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False))
        self.ids = list(prompt_ids[-6:])  # a little prompt context for leading-space handling
        self.prefix_offset = max(len(self.ids) - 1, 0)
        self.read_offset = len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # all output text decoded so far (before stop truncation)
        self.emitted = 0  # characters of `text` handed to the caller

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str | None:
        """Adds tokens; returns the stop string if one now appears in the output."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def take(self, final: bool) -> str:
        """The text not yet handed out; keeps back a possible stop-string prefix unless final."""
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
