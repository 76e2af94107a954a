"""Token text for logprobs: each token id as OpenAI shows it (text plus its raw UTF-8 bytes), and an
answer's logprobs in the shapes of /v1/chat/completions and /v1/completions."""
from __future__ import annotations

from functools import lru_cache


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet (the same table `transformers` uses)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_BYTE_DECODER = {c: b for b, c in _bytes_to_unicode().items()}


def logprob_chunk(out) -> tuple[list[int], list[dict]]:
    """An update's (token ids, logprob entries) for a response's `logprobs`. The stop token that
    ended the answer (EOS, a `stop_token_ids` entry) is no part of its text, and OpenAI lists none:
    it is left out, so that the listed tokens join to the answer's content."""
    ids, entries = list(out.new_token_ids), out.logprobs or []
    if out.finished and isinstance(out.matched_stop, int) and ids and ids[-1] == out.matched_stop:
        ids.pop()
        entries = entries[:len(ids)]
    return ids, entries


class TokenTexts:
    """Maps token ids to (text, bytes); cached, safe to share between requests."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        tok = self.tokenizer.convert_ids_to_tokens(int(token_id))
        raw: bytes | None = None
        if isinstance(tok, str):
            if tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:  # sentencepiece byte fallback
                try:
                    raw = bytes([int(tok[3:5], 16)])
                except ValueError:
                    raw = None
            elif all(ch in _BYTE_DECODER for ch in tok):
                raw = bytes(_BYTE_DECODER[ch] for ch in tok)
        if raw is None:
            text = self.tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)
            raw = text.encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]

    def entry(self, token_id: int, logprob: float) -> dict:
        text, raw = self.lookup(token_id)
        return {"token": text, "logprob": finite_logprob(logprob), "bytes": raw}

    def chat_logprobs(self, chunks: list[tuple[list[int], list[dict]]], top_n: int) -> dict:
        """`choices[].logprobs` of a chat completion from (token ids, their logprob entries) chunks."""
        content = []
        for token_ids, entries in chunks:
            for tid, lp in zip(token_ids, entries):
                e = self.entry(tid, lp["logprob"])
                e["top_logprobs"] = [self.entry(t, v) for t, v in (lp.get("top") or [])[:top_n]]
                content.append(e)
            for tid in token_ids[len(entries):]:  # grammar-forced tokens (jump-forward): probability 1
                e = self.entry(tid, 0.0)
                e["top_logprobs"] = [self.entry(tid, 0.0)] if top_n else []
                content.append(e)
        return {"content": content, "refusal": None}

    def completion_logprobs(self, chunks, top_n: int, offset0: int = 0) -> dict:
        """The legacy completions shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`)."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = offset0
        for token_ids, entries in chunks:
            for k, tid in enumerate(token_ids):
                text = self.text(tid)
                lp = entries[k] if k < len(entries) else {"logprob": 0.0, "top": [(tid, 0.0)]}
                tokens.append(text)
                token_lps.append(finite_logprob(lp["logprob"]))
                top = {}
                for t, v in (lp.get("top") or [])[:top_n]:
                    top.setdefault(self.text(t), finite_logprob(v))
                tops.append(top)
                offsets.append(off)
                off += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


# OpenAI's logprob for a token that cannot be sampled (one a grammar masks, when fewer tokens than
# top_logprobs asks for are allowed); -inf would go out as JSON null, which its schema does not allow
IMPOSSIBLE_LOGPROB = -9999.0


def finite_logprob(logprob: float) -> float:
    v = float(logprob)
    return v if v > IMPOSSIBLE_LOGPROB else IMPOSSIBLE_LOGPROB
