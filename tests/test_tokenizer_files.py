"""The tokenizer files of a converted GGUF, as llguidance reads them: transformers 5.17 converted
SmolLM2's byte-level BPE with a sentencepiece decoder, byte fallback and <|im_start|> as EOS; llguidance
then read tokens as raw 'Ġ' text and its masks let through tokens its own accepts refused (the H100
stress run under --grammar-backend auto, where transformers is 5.17). The conversion now writes what
the GGUF says, and a tokenizer llguidance misreads is refused up front (auto: xgrammar serves)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from constrained_spec.grammar import GrammarBackend, GrammarError, GrammarSpec
from constrained_spec.grammar.llguidance_backend import llg_tokenizer
from constrained_spec.models.loader import _settle_byte_level_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _break_like_transformers_5_17(folder):
    """What transformers 5.17 wrote for SmolLM2-135M-Instruct.Q4_1.gguf (diffed against 5.24)."""
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    data["normalizer"] = {"type": "Sequence", "normalizers": []}
    data["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]}
    data["model"].update({"unk_token": "<|endoftext|>", "continuing_subword_prefix": None, "end_of_word_suffix": None,
                          "fuse_unk": True, "byte_fallback": True})
    path.write_text(json.dumps(data))
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update({"eos_token": "<|im_start|>", "eos_token_id": 1, "bos_token_id": 1, "clean_up_tokenization_spaces": True})
    cfg_path.write_text(json.dumps(cfg))


@pytest.fixture
def broken_dir(smollm2_dir, tmp_path):
    for name in TOKENIZER_FILES:
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, tmp_path / name)
    _break_like_transformers_5_17(tmp_path)
    return tmp_path


def test_llguidance_refuses_a_tokenizer_it_misreads_and_auto_falls_back(broken_dir):
    tok = AutoTokenizer.from_pretrained(str(broken_dir))
    with pytest.raises(GrammarError, match="other bytes"):
        llg_tokenizer(tok, 49152, [2], [0, 1, 2])
    backend = GrammarBackend(tok, 49152, default_backend="auto", compile_workers=1)
    try:
        spec = GrammarSpec.json_schema(json.dumps({"type": "object", "properties": {"a": {"type": "string"}}}))
        assert backend.compile(spec).backend == "xgrammar"
        with pytest.raises(GrammarError, match="other bytes"):
            backend.compile(GrammarSpec.json_schema('{"type": "string"}').with_backend("llguidance"))
    finally:
        backend.close()


def test_conversion_settles_a_byte_level_tokenizer(broken_dir):
    _settle_byte_level_tokenizer(broken_dir, {"model": "gpt2", "bos": 1, "eos": 2, "unk": 0})
    tok = AutoTokenizer.from_pretrained(str(broken_dir))
    assert tok.eos_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    text = ' {"name": "x y",\n "ok": true}'
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    ll = llg_tokenizer(tok, 49152, [2], [0, 1, 2])  # raises if llguidance misreads it
    assert bytes(ll.decode_bytes(ids)) == text.encode()
