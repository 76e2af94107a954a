"""Weights in, model out: GGUF → cached Hugging Face folder (dequantized once), HF folder → CausalLM.

GGUF conversion uses transformers' GGUF machinery (`load_gguf_checkpoint` for the config and the
tokenizer metadata, its tensor processors and name map for the weights, `AutoTokenizer(gguf_file=)`
for the tokenizer) but never materializes a transformers model: the name map is computed on a model
built on the `meta` device, and each tensor is dequantized, cast to the cache dtype and kept once.
The result is written as config.json + model.safetensors + tokenizer files + generation_config.json
under `<cache>/converted/<name>-<key>/`, key = hash of (size, first and last 8 MiB of the file,
converter version, cache dtype); a later load of the same GGUF — from any path — reads it back.

Loading an HF folder allocates `CausalLM` once, directly on the target device/dtype with weight
initializers skipped, and streams tensors from the safetensors files (`safe_open`, one tensor at a time) into `load_weights`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .config import SUPPORTED_ARCHITECTURES, ModelConfig
from .llama import CausalLM
from .registry import cache_dir

log = logging.getLogger(__name__)

CONVERTER_VERSION = 4  # 2, 3: byte-level BPE tokenizer files settled (`_settle_byte_level_tokenizer`); 4: unused tail dropped
# Models up to this many parameters are cached in float32 (exactly the dequantized values, so the
# CPU reference runs on the GGUF's own numbers); bigger ones in bfloat16 to halve disk and RAM.
FP32_CACHE_MAX_PARAMS = 1_000_000_000

CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# End-of-turn tokens that stop generation whenever the vocabulary has them as special tokens.
_END_OF_TURN = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>")


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one our forward code implements."""


# -- dtype / device --------------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: torch.dtype | str | None, device: str | torch.device) -> torch.dtype:
    """"auto"/None: bfloat16 on CUDA and on CPUs that compute it natively (AMX-BF16 or
    AVX512-BF16), float32 on other CPUs.

    docs/models.md has the measurements: with native bfloat16 dot products a bfloat16 step streams
    half the bytes and decodes several times faster than float32, on AMX batch-invariant like it.
    float32 buys output bit-exact with `transformers` (ask for it with dtype="float32"); on CPUs
    without native bfloat16, bfloat16 projections are emulated and slower than float32 ones."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or str(dtype).lower() == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_computes_bf16() else torch.float32
    key = str(dtype).lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[key]


def cpu_computes_bf16() -> bool:
    """This CPU has bfloat16 dot-product instructions (AMX-BF16 or AVX512-BF16)."""
    from ..kernels import cpu_native
    return cpu_native.amx_linear_available() or bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


# -- GGUF → HF folder ------------------------------------------------------------------------------

def gguf_cache_key(path: str | os.PathLike) -> str:
    """Content key of a GGUF: size + first/last 8 MiB (header and tail), without reading it all."""
    path = Path(path)
    size = path.stat().st_size
    h = hashlib.sha256(f"v{CONVERTER_VERSION}:{size}".encode())
    chunk = 8 << 20
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if size > chunk:
            f.seek(max(size - chunk, chunk))
            h.update(f.read())
    return h.hexdigest()[:16]


def converted_dir_for(gguf_path: str | os.PathLike) -> Path:
    gguf_path = Path(gguf_path)
    stem = gguf_path.name.removesuffix(".gguf")
    return cache_dir() / "converted" / f"{stem}-{gguf_cache_key(gguf_path)}"


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike | None = None,
                 force: bool = False) -> Path:
    """Dequantize a GGUF into an HF folder (cached); returns the folder. Reuses an earlier conversion."""
    gguf_path = Path(gguf_path).resolve()
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")
    out = Path(out_dir) if out_dir is not None else converted_dir_for(gguf_path)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file() and not force:
        log.debug("reusing converted %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    t0 = time.perf_counter()
    log.warning("converting %s to a Hugging Face folder (once; cached at %s)", gguf_path.name, out)
    try:
        info = _convert_gguf_into(gguf_path, tmp)
        info.update(source=str(gguf_path), size=gguf_path.stat().st_size,
                    converter_version=CONVERTER_VERSION, seconds=round(time.perf_counter() - t0, 2))
        (tmp / "gguf_source.json").write_text(json.dumps(info, indent=1))
        if force and out.exists():
            shutil.rmtree(out)
        try:
            os.replace(tmp, out)
        except OSError:  # another process finished the same conversion first
            if not (out / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.warning("converted %s in %.1f s", gguf_path.name, time.perf_counter() - t0)
    return out


def _convert_gguf_into(gguf_path: Path, out: Path) -> dict:
    import numpy as np
    from gguf import GGUFReader, dequantize
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    t0 = time.perf_counter()
    try:
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=False)
    except ValueError as e:  # transformers: "GGUF model with architecture X is not supported yet."
        raise UnsupportedModelError(f"{gguf_path.name}: {e}") from e
    cfg_dict = dict(parsed["config"])
    model_type = cfg_dict.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{gguf_path.name}: architecture {model_type!r} is not supported; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}")
    cfg_dict.pop("_model_name_or_path", None)
    hf_config = AutoConfig.for_model(**cfg_dict)

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(hf_config)
    n_params = sum(p.numel() for p in meta_model.parameters())
    store_dtype = torch.float32 if n_params <= FP32_CACHE_MAX_PARAMS else torch.bfloat16
    hf_config.architectures = [type(meta_model).__name__]
    hf_config.dtype = store_dtype

    t1 = time.perf_counter()
    reader = GGUFReader(str(gguf_path))
    architecture = read_field(reader, "general.architecture")[0]
    tokenizer_fields = _gguf_tokenizer_fields(reader)
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=parsed["config"])
    name_map = get_gguf_hf_weights_map(meta_model, processor)
    expected = {k for k in meta_model.state_dict() if not k.endswith("rotary_emb.inv_freq")}
    if getattr(hf_config, "tie_word_embeddings", False):
        expected.discard("lm_head.weight")
    del meta_model

    tensors: dict[str, torch.Tensor] = {}
    parsed["tensors"] = tensors
    for t in tqdm(reader.tensors, desc=f"dequantizing {gguf_path.name}", unit="tensor", mininterval=1.0):
        weights = dequantize(t.data, t.tensor_type)
        res = processor.process(weights=weights, name=t.name, tensor_key_mapping=name_map,
                                parsed_parameters=parsed)
        if res.name not in name_map:
            continue
        tensors[name_map[res.name]] = torch.from_numpy(np.array(res.weights, copy=True)).to(store_dtype)
    missing = expected - tensors.keys()
    if missing:
        raise ValueError(f"{gguf_path.name}: conversion produced no tensor for {sorted(missing)[:5]}"
                         f"{' ...' if len(missing) > 5 else ''}")
    del reader

    t2 = time.perf_counter()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    hf_config.save_pretrained(out)
    GenerationConfig.from_model_config(hf_config).save_pretrained(out)
    t3 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(out)
    if tokenizer_fields.get("model") == "gpt2":
        _settle_byte_level_tokenizer(out, tokenizer_fields)
    _drop_unused_tail(out, tokenizer_fields.get("types") or [])
    log.info("conversion phases: metadata+config %.1f s, dequantize %.1f s, write %.1f s, tokenizer %.1f s",
             t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
    return {"model_type": model_type, "parameters": n_params, "dtype": str(store_dtype).removeprefix("torch.")}


def _gguf_tokenizer_fields(reader) -> dict:
    """The GGUF's tokenizer kind ('gpt2': byte-level BPE) and its special token ids."""
    from transformers.modeling_gguf_pytorch_utils import read_field
    out = {}
    for key, name in (("tokenizer.ggml.model", "model"), ("tokenizer.ggml.bos_token_id", "bos"),
                      ("tokenizer.ggml.eos_token_id", "eos"), ("tokenizer.ggml.padding_token_id", "pad"),
                      ("tokenizer.ggml.unknown_token_id", "unk")):
        if key in reader.fields:
            value = read_field(reader, key)
            out[name] = value[0] if value else None
    if "tokenizer.ggml.token_type" in reader.fields:
        out["types"] = [int(t) for t in read_field(reader, "tokenizer.ggml.token_type")]
    return out


_UNUSED = 5  # GGUF's token type of a vocabulary slot that only pads the table


def _drop_unused_tail(out: Path, types: list[int]) -> None:
    """Takes the GGUF's unused slots at the vocabulary's end out of the tokenizer (Qwen2.5's 271,
    151,665 to 151,935): kept, they were ordinary BPE entries whose text is `[PAD151900]`, which the
    grammars let into strings and a sampler at T=1 drew now and then. Without them the tokenizer is
    the model's own (151,665 ids) and the head's rows past it are never sampled
    (`CausalLM.text_vocab_size`)."""
    n = len(types)
    while n and types[n - 1] == _UNUSED:
        n -= 1
    if n == len(types):
        return
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data.get("model", {}).get("vocab")
    if not isinstance(vocab, dict):
        return
    added = {int(t["id"]) for t in data.get("added_tokens") or []}
    dropped = {s for s, i in vocab.items() if i >= n and i not in added}
    data["model"]["vocab"] = {s: i for s, i in vocab.items() if s not in dropped}
    # (a merge that makes or takes a dropped token goes too; Qwen's padding is in none)
    pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in data["model"].get("merges") or []]
    data["model"]["merges"] = [m for m, (a, b) in zip(data["model"].get("merges") or [], pairs)
                               if not {a, b, a + b} & dropped]
    path.write_text(json.dumps(data, ensure_ascii=False))


# The byte-level BPE a GGUF with tokenizer.ggml.model 'gpt2' describes, as tokenizers writes it
_BYTE_LEVEL_DECODER = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
_BPE_PLAIN = {"unk_token": None, "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": False,
              "byte_fallback": False}


def _settle_byte_level_tokenizer(out: Path, fields: dict) -> None:
    """Writes the tokenizer files of a byte-level BPE GGUF as the GGUF says they are, whatever the
    transformers version made of them: transformers 5.17 gave SmolLM2's tokenizer a sentencepiece
    decoder with byte fallback and <|im_start|> for its EOS (5.24 does not); llguidance, which reads
    the tokenizer's JSON, then took <|im_start|> for a JSON string's opening quote and its masks
    disagreed with its own accepts (the H100 stress run under `--grammar-backend auto`)."""
    path = out / "tokenizer.json"
    data = json.loads(path.read_text())
    # the normalizer and pre-tokenizer are left alone: they are the model's (Qwen2's NFC and split regex)
    data["decoder"] = dict(_BYTE_LEVEL_DECODER)
    data["model"].update(_BPE_PLAIN)
    path.write_text(json.dumps(data, ensure_ascii=False))
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    texts = {int(t["id"]): t["content"] for t in data.get("added_tokens") or []}
    vocab = {i: s for s, i in data["model"]["vocab"].items()}
    for name in ("bos", "eos", "pad", "unk"):
        config.pop(f"{name}_token_id", None)
        token_id = fields.get(name)
        text = None if token_id is None else texts.get(int(token_id), vocab.get(int(token_id)))
        if text is not None:
            config[f"{name}_token"] = text
        elif name == "unk":
            config.pop("unk_token", None)
    config["clean_up_tokenization_spaces"] = False
    config_path.write_text(json.dumps(config, indent=1, ensure_ascii=False))


# -- HF folder → CausalLM --------------------------------------------------------------------------

def read_model_config(folder: str | os.PathLike) -> tuple[dict, ModelConfig]:
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; not a Hugging Face model folder")
    raw = json.loads(cfg_path.read_text())
    if "text_config" in raw and "num_hidden_layers" not in raw:
        raw = {**raw["text_config"], **{k: raw[k] for k in ("eos_token_id", "bos_token_id") if k in raw}}
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        arch = raw.get("architectures") or []
        raise UnsupportedModelError(
            f"{str(folder)!r}: architecture {model_type!r}{f' ({arch[0]})' if arch else ''} is not supported; "
            f"supported model_type values: {sorted(SUPPORTED_ARCHITECTURES)} (Llama 2/3, SmolLM2, Mistral, "
            "Qwen2/2.5)")
    return raw, ModelConfig.from_hf(raw)


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / f for f in dict.fromkeys(weight_map.values())]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index}: shard(s) {absent} are missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in folder.glob("*.bin"))
        raise FileNotFoundError(
            f"{str(folder)!r} has no *.safetensors weights"
            + (f" (found {bins}; convert them to safetensors first)" if bins else ""))
    return files


def iter_safetensors(files: list[Path]):
    from safetensors import safe_open
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for name in sf.keys():
                yield name, sf.get_tensor(name)


_BUILD_LOCK = threading.Lock()


@contextmanager
def _uninitialized(dtype: torch.dtype, device: str | torch.device):
    """Construct modules directly on `device` in `dtype`, skipping Linear/Embedding initializers.

    (Building on `meta` then `to_empty` works too, but the first meta construction in a process costs
    ~2-4 s of one-time dispatcher setup; this costs ~0.2 s for SmolLM2.)"""
    patched = (nn.Linear, nn.Embedding)
    with _BUILD_LOCK:
        saved = [cls.reset_parameters for cls in patched]
        old_dtype = torch.get_default_dtype()
        try:
            for cls in patched:
                cls.reset_parameters = lambda self: None
            torch.set_default_dtype(dtype)
            with torch.device(device):
                yield
        finally:
            torch.set_default_dtype(old_dtype)
            for cls, fn in zip(patched, saved):
                cls.reset_parameters = fn


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device) -> CausalLM:
    """Allocate CausalLM once on the target device/dtype without running weight initializers.
    Rotary tables stay float32 (they are built with explicit dtypes)."""
    with _uninitialized(dtype, device):
        return CausalLM(cfg)


def load_hf_folder(folder: str | os.PathLike, dtype: torch.dtype, device: str | torch.device) -> tuple[CausalLM, ModelConfig]:
    _, cfg = read_model_config(folder)
    files = safetensors_files(folder)
    model = build_model(cfg, dtype, device)
    model.load_weights(iter_safetensors(files))
    model.eval().requires_grad_(False)
    return model, cfg


# -- tokenizer -------------------------------------------------------------------------------------

def load_folder_tokenizer(folder: str | os.PathLike):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    if not getattr(tok, "chat_template", None):
        log.warning("tokenizer in %s has no chat template; falling back to ChatML", folder)
        tok.chat_template = CHATML_TEMPLATE
    return tok


def collect_eos_ids(folder: str | os.PathLike, cfg: ModelConfig, tokenizer) -> list[int]:
    """config eos + generation_config eos + tokenizer eos + end-of-turn specials the vocab has."""
    ids: list[int] = list(cfg.eos_token_ids)
    gen = Path(folder) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids += [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(tokenizer.eos_token_id)
    vocab = tokenizer.get_vocab()
    specials = set(getattr(tokenizer, "all_special_tokens", []) or [])
    specials |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
                 if getattr(t, "special", False)}
    for tok in _END_OF_TURN:
        if tok in vocab and tok in specials:
            ids.append(vocab[tok])
    return [i for i in dict.fromkeys(ids) if 0 <= i < max(cfg.vocab_size, len(vocab))]
