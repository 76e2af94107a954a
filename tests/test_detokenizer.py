"""The incremental detokenizer (fast path: the Rust tokenizer called directly) yields exactly what
the Hugging Face tokenizer decodes for the whole sequence, token by token and with stop strings."""
from __future__ import annotations

import random

import pytest

from constrained_spec.engine.detokenizer import IncrementalDetokenizer, first_stop


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from constrained_spec.models.loader import load_folder_tokenizer
    return load_folder_tokenizer(smollm2_dir)


def reference(tok, ids):
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("text", ["Héllo wörld — ünïcode ✓ 日本語 🙂 {\"a\": [1, 2.5e-3]}\n\ttabs  and spaces",
                                  "<|im_end|> special tokens in the middle"])
def test_matches_full_decode_token_by_token(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
    pieces = []
    for i in ids:
        assert d.add([i]) is None
        pieces.append(d.take(final=False))
    pieces.append(d.take(final=True))
    assert "".join(pieces) == reference(tokenizer, ids)


def test_random_tokens_and_chunks(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(2000)]
    d = IncrementalDetokenizer(tokenizer, [5], [])
    i = 0
    while i < len(ids):
        n = rng.randint(1, 5)
        d.add(ids[i:i + n])
        i += n
    # byte-level pieces that never complete a character stay held back as U+FFFD at the very end only
    full = reference(tokenizer, ids)
    assert d.take(final=True) == full[:len(d.text)] and len(full) - len(d.text) <= 4


def test_stop_string_truncates(tokenizer):
    ids = tokenizer.encode("The answer is 42. STOP here and more", add_special_tokens=False)
    d = IncrementalDetokenizer(tokenizer, [1], ["STOP"])
    stop = None
    for i in ids:
        stop = d.add([i]) or stop
        if stop:
            break
    assert stop == "STOP" and d.take(final=True) == "The answer is 42. "


class _Reference:
    """The detokenizer as it was (whole text kept, two decodes per token), for the one-decode table
    and the pending-text stop search to be checked against, update by update."""

    def __init__(self, tok, prompt_ids, stop):
        self.tok = tok
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset, self.read_offset = max(len(self.ids) - 1, 0), len(self.ids)
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.text, self.emitted = "", 0

    def add(self, new_ids):
        self.ids.extend(new_ids)
        prefix = reference(self.tok, self.ids[self.prefix_offset:self.read_offset])
        full = reference(self.tok, self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s)))
            if at != -1:
                self.text = self.text[:at]
                return s
        return None

    def take(self, final):
        end = len(self.text) if final or not self.stop else max(self.emitted, len(self.text) - self.hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out


@pytest.mark.parametrize("stop", [[], ["e"], ["the", "\n\n", "ing "], ["<|im_end|>"], ["é"]])
def test_same_updates_as_the_reference(tokenizer, stop):
    text = ("The king's engineers were thinking, then: \"Héllo wörld\"\n\n🙂 日本語 {\"a\": [1, 2.5e-3]} "
            "<|im_end|> and more text after the end, ending here.") * 3
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(len(stop))
    ids += [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    for seed in range(3):
        rng = random.Random(seed)
        new, ref = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop), _Reference(tokenizer, [1, 2, 3], stop)
        i, new_out, ref_out = 0, "", ""
        while i < len(ids):
            n = 1 if seed == 0 else rng.randint(1, 4)
            got, want = new.add(ids[i:i + n]), ref.add(ids[i:i + n])
            assert got == want, i
            final = got is not None or i + n >= len(ids)
            new_out += new.take(final)
            ref_out += ref.take(final)
            # the same text; handed out as the reference does, but for the start of a token whose
            # text is partly held back (it waits with that token: `test_released_tokens_join_to_the_text`)
            assert new.text == ref.text and new.emitted == len(new_out) <= ref.emitted == len(ref_out)
            assert ref_out.startswith(new_out) and (new_out == ref_out or final is False), i
            if got is not None:
                break
            i += n


@pytest.mark.parametrize("text", ["Héllo wörld — ünïcode ✓ 日本語 🙂🙂 {\"a\": [1, 2.5e-3]}\n\ttabs", "🙂日本語"])
def test_whole_answer_in_one_piece_matches_token_by_token(tokenizer, text):
    """The engine process's front-end decodes a non-streamed answer once, at its end: the same text
    as token by token, for every length the answer may have been cut at (mid-character too)."""
    from constrained_spec.server.engine_client import _add_whole

    ids = tokenizer.encode(text, add_special_tokens=False)
    for cut in range(1, len(ids) + 1):
        step = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
        for i in ids[:cut]:
            step.add([i])
        whole = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
        _add_whole(whole, ids[:cut])
        assert whole.take(final=True) == step.take(final=True), cut


@pytest.mark.parametrize("text", ["Say hello 𝄞 world", "Héllo wörld — ✓ 日本語 🙂🙂 done"])
def test_final_text_does_not_depend_on_how_tokens_came(tokenizer, text):
    """An answer that ends inside a character, its last tokens added in one call (a speculative
    step's): the final take gives what token by token gives. The chunk's text was held back whole
    for the unfinished character and lost when the request ended there."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    rng = random.Random(1)
    for cut in range(1, len(ids) + 1):
        step = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
        for i in ids[:cut]:
            step.add([i])
        expected = step.take(final=True)
        for _ in range(4):
            chunked = IncrementalDetokenizer(tokenizer, [1, 2, 3], [])
            i = 0
            while i < cut:
                n = rng.randint(1, 6)
                chunked.add(ids[i:min(i + n, cut)])
                i += n
            assert chunked.take(final=True) == expected, (cut, ids[:cut])


@pytest.mark.parametrize("stop", [["\n3"], ["3. 3"], [". 4\n5"], ["é w"], ["🙂"], ["never there"]])
def test_released_tokens_join_to_the_text(tokenizer, stop):
    """Under stop strings an update lists the tokens whose text it hands out (a token whose text is
    held back waits with it, and its text's start with it), and a matched stop string's tokens are
    never listed: the listed tokens join to the answer and to each chunk, whatever the chunks (the logprobs of a stop-cut answer listed the
    stop string's tokens: "1. 1\\n2. 2" came with tokens joining to "1. 1\\n2. 2\\n3")."""
    text = "1. 1\n2. 2\n3. 3\n4. 4\n5. 5 Héllo wörld 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    for seed in range(3):
        rng = random.Random(seed)
        d = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)
        out, listed, logprobs, i, final = [], [], [], 0, False
        while not final:
            n = 1 if seed == 0 else rng.randint(1, 4)
            chunk = ids[i:i + n]
            final = d.add(chunk) is not None or i + n >= len(ids)
            piece = d.take(final)
            got, lps = d.release(chunk, [{"token_id": t} for t in chunk], final)
            assert [e["token_id"] for e in lps or []] == got  # the logprobs go with their tokens
            out.append(piece)
            listed += got
            if not final:  # each chunk hands out its listed tokens' text whole, no more, no less: a
                # token's end came a chunk later ('t' with the token 'top', 'op' next)
                assert reference(tokenizer, listed) == "".join(out), (stop, seed, i)
            i += n
        answer = "".join(out)
        assert answer == (text[:text.find(stop[0])] if stop[0] in text else text)
        joined = reference(tokenizer, listed)
        if stop[0] == "🙂":  # one token is " 🙂": it begins in the answer and is listed, the stop's start with it
            assert joined == answer + "🙂" and len(reference(tokenizer, listed[:-1])) < len(answer)
        else:
            assert joined == answer, (stop, seed)


def test_the_stop_string_that_ends_first_wins():
    """`first_stop`: of several stop strings in one piece of text, the one that ends first (as text
    fed a character at a time finds it), of two ending together the longer; the server's tool-call
    envelopes scan their visible text with it too."""
    assert first_stop("abcd", ["abcd", "bc"]) == (1, "bc")
    assert first_stop("abcd", ["bc", "abc"]) == (0, "abc")
    assert first_stop("abcd", ["x", "d"]) == (3, "d") and first_stop("abcd", ["x"]) is None
    text, stops = "xx abcd ab", ["abcd", "bc", "d a"]
    for size in range(1, 6):  # fed in pieces, the last len - 1 characters kept back: the same one
        held, hit = "", None
        for i in range(0, len(text), size):
            pending = held + text[i:i + size]
            hit = first_stop(pending, stops)
            if hit is not None:
                hit = (i - len(held) + hit[0], hit[1])
                break
            held = pending[-3:]
        assert hit == (4, "bc"), size


@pytest.mark.parametrize("stop", [[], ["zz"]])
def test_a_cut_inside_a_character_keeps_the_whole_ones_before_it(tokenizer, stop):
    """A last token of a space and an emoji's first bytes (` \\xf0\\x9f`, SmolLM2's 15107): the space
    is text, the unfinished emoji is not (the space went too: "你好" for "你好 ", QA 1130c Qwen F5)."""
    ids = tokenizer.encode("Hi there", add_special_tokens=False) + [15107]
    assert tokenizer.convert_ids_to_tokens(15107) == "ĠðŁ"
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)
    out = ""
    for i in ids:
        d.add([i])
        out += d.take(final=False)
    out += d.take(final=True)
    assert out == d.text == "Hi there "
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], stop)  # all at once (a speculative step's tokens)
    d.add(ids)
    assert d.take(final=True) == "Hi there " and d.late_stop is None
    d = IncrementalDetokenizer(tokenizer, [1, 2, 3], ["there "])  # a stop string those characters complete
    d.add(ids)
    assert d.take(final=True) == "Hi " and d.late_stop == "there "
