"""Chat prompts to token ids, with the turns' encodings cached.

Structured-output traffic repeats its turns: the same system prompt with the schema and worked
examples in front of every request, the same conversation growing turn by turn, the template's
own pieces (`<|im_end|>\n`, `<|im_start|>assistant\n`, a default system prompt). Encoding a
1,500-token prompt costs a front-end 2-4 ms, most of a cached request's time to first token when
64 of them arrive together. A chat template separates turns with special tokens (`<|im_start|>`),
and the tokenizer splits its input at special tokens before anything else, so the ids of a prompt
are the ids of its turns, each encoded alone: a turn seen before is a dictionary lookup. The
encoding itself goes to the Rust tokenizer directly where there is one (transformers' `encode`
adds ~50 us of Python a call, more than a short turn's encoding).

That holds for special tokens that take no whitespace from their left (`lstrip`), are matched as
written (not after normalization) and anywhere (not `single_word`); the template's boundaries use
only those, and the encoder checks itself against whole-prompt encoding when it is built (and
encodes whole prompts if it ever disagreed).

A special token's text inside a message (`<|im_end|>` in a tool's result, a user's paste) is text,
as OpenAI's API reads it: encoded as the template's own marker it would end the turn and let
whoever wrote the message, often a tool fetching untrusted pages, open a system turn of their own.
Such texts are swapped for a private-use mark before the template renders and encoded as plain
text where the mark is (`_Literals`).
"""
from __future__ import annotations

import re
import threading
from collections import OrderedDict

_CHECK = [{"role": "system", "content": "You answer in JSON.\n\nSchema: {\"a\": 1}  "},
          {"role": "user", "content": " Describe  a cat.\n"}, {"role": "assistant", "content": "{\"a\": 1}\n\n"},
          {"role": "user", "content": "Again, éè 🙂 <tag> ."}]


# The turn cache's bounds beside its count: a turn longer than this is encoded each time (a 1 MB
# message refused as past the context was kept, ~40 MB of ids and text each; QA 1130b soak D1), and
# the cached turns' text at most (their ids take ~9x its bytes in Python ints).
MAX_CACHED_TURN_CHARS = 65536
MAX_CACHED_CHARS = 8 << 20


class ChatPromptEncoder:
    def __init__(self, tokenizer, cache_size: int = 4096):
        self.tokenizer = tokenizer
        self.cache_size = cache_size  # turns, least recently used out first
        self._cached_chars = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a transformers "fast" tokenizer's own
        if backend is not None and getattr(tokenizer, "split_special_tokens", False):
            backend = None  # transformers then encodes special tokens' text as plain text itself
        self._backend = backend
        self._cache: "OrderedDict[str, list[int]]" = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self._boundary = _boundary_pattern(tokenizer)
        if self._boundary is not None and not self._agrees(_CHECK):
            self._boundary = None
        self._literals = _Literals(tokenizer, backend)

    def __call__(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids from the tokenizer's chat template (as `apply_chat_template` with
        tokenize=True gives them); `tools` (OpenAI's function definitions) for a template that
        `takes_tools`."""
        literals = self._literals
        extra = {} if tools is None else {"tools": literals.hide(tools)}
        text = self.tokenizer.apply_chat_template(literals.hide(messages), tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **extra)
        if self._boundary is None:
            return self._encode(text)
        ids: list[int] = []
        for turn in self._boundary.split(text):
            if turn:
                ids += self._turn(turn)
        return ids

    @property
    def takes_tools(self) -> bool:
        """Whether the chat template renders function definitions passed as `tools`."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):
            template = template.get("tool_use") or template.get("default")
        return isinstance(template, str) and "tools" in template

    @property
    def segmented(self) -> bool:
        """Whether prompts are encoded turn by turn (else whole)."""
        return self._boundary is not None

    def _turn(self, text: str) -> list[int]:
        with self._lock:
            ids = self._cache.get(text)
            if ids is not None:
                self._cache.move_to_end(text)
                self.hits += 1
                return ids
        ids = self._encode(text)
        if len(text) > MAX_CACHED_TURN_CHARS:
            return ids
        with self._lock:
            if text not in self._cache:
                self._cached_chars += len(text)
            self._cache[text] = ids
            while len(self._cache) > self.cache_size or self._cached_chars > MAX_CACHED_CHARS:
                self._cached_chars -= len(self._cache.popitem(last=False)[0])
        return ids

    def _encode(self, text: str) -> list[int]:
        if MARK in text:
            return self._literals.encode(text, self._encode)
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _agrees(self, messages: list[dict]) -> bool:
        for n in range(1, len(messages) + 1):
            text = self.tokenizer.apply_chat_template(messages[:n], tokenize=False, add_generation_prompt=True)
            split = [t for part in self._boundary.split(text) if part for t in self._encode(part)]
            if split != self._encode(text):
                return False
        return True


def _boundary_pattern(tokenizer) -> re.Pattern | None:
    """A pattern matching the empty string before each special token that may start a turn: one
    the tokenizer splits at as written, taking no whitespace from its left; None if there is none."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    tokens = [t.content for t in added.values()
              if getattr(t, "special", False) and not getattr(t, "lstrip", False)
              and not getattr(t, "single_word", False) and not getattr(t, "normalized", False) and t.content]
    if not tokens:
        return None
    return re.compile("(?=" + "|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)) + ")")


MARK = "\ue000"  # then a character naming the text: U+E001 on


class _Literals:
    """Special tokens' texts in messages, kept text: `hide` swaps each (and MARK itself, so that no
    message can forge a mark) for MARK and a character naming it; `encode` encodes a rendered
    prompt with each of them as plain text, the rest as usual."""

    def __init__(self, tokenizer, backend):
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        texts = sorted({t.content for t in added.values() if getattr(t, "special", False) and t.content},
                       key=len, reverse=True)
        self.texts = texts + [MARK]
        self._find = re.compile("|".join(re.escape(t) for t in self.texts))
        self._names = {t: MARK + chr(0xE001 + i) for i, t in enumerate(self.texts)}
        self._marks = re.compile(MARK + "([\ue001-\uf8ff])")
        self._tokenizer = tokenizer
        self._plain = None  # a copy of the Rust tokenizer that reads special tokens' texts as text
        if backend is not None:
            from tokenizers import Tokenizer
            self._plain = Tokenizer.from_str(backend.to_str())
            self._plain.encode_special_tokens = True

    def hide(self, value):
        if isinstance(value, str):
            return self._find.sub(lambda m: self._names[m.group()], value)
        if isinstance(value, dict):
            return {k: self.hide(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.hide(v) for v in value]
        return value

    def encode(self, text: str, encode) -> list[int]:
        pieces = self._marks.split(text)  # text, a mark's name, text, ...
        ids: list[int] = []
        for i, piece in enumerate(pieces):
            if i % 2 == 0:
                ids += encode(piece) if piece else []
            else:
                ids += self._encode_plain(self.texts[ord(piece) - 0xE001])
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if self._plain is not None:
            return self._plain.encode(text, add_special_tokens=False).ids
        return list(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
