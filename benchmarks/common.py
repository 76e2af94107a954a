"""Shared pieces of the benchmarks: workloads, the Hugging Face baseline, and result writing."""
from __future__ import annotations

import functools
import json
import os
import platform
import time
from contextlib import contextmanager
from pathlib import Path

# $BENCH_RESULTS: another folder (a GPU run writing where its files are fetched from; tests)
RESULTS = Path(os.environ.get("BENCH_RESULTS") or Path(__file__).resolve().parent / "results")
SCHEMAS = Path(__file__).resolve().parent.parent / "schemas"

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string"},
        "skills": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "skills", "active"],
    "additionalProperties": False,
}

TOPICS = ["a chef in Lyon", "a retired pilot", "a data engineer", "a marine biologist", "a jazz pianist",
          "a farmer in Kenya", "a chess coach", "a nurse in Oslo", "a game designer", "a beekeeper"]


def random_weights(cfg, tokenizer, dtype, device, std: float, name: str, eos_ids=None, seed: int = 0):
    """Our model of `cfg`'s shapes with random weights (norms at one), as a LoadedModel: throughput
    work times the same as with real weights and needs none of them on the GPU machine."""
    import torch
    from constrained_spec.models import LoadedModel
    from constrained_spec.models.loader import build_model
    torch.manual_seed(seed)
    model = build_model(cfg, dtype, device)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.ones_like(p) if "norm" in pname else std * torch.randn_like(p))
    eos = list(eos_ids) if eos_ids is not None else list(cfg.eos_token_ids)
    return LoadedModel(model, cfg, tokenizer, eos, name, "")


def chat_prompts(tokenizer, n: int, json_task: bool) -> list[list[int]]:
    out = []
    for i in range(n):
        who = TOPICS[i % len(TOPICS)]
        text = (f"Give a JSON profile of {who} with name, age, email, skills and active." if json_task
                else f"Write a short story about {who}.")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                            add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def hf_generate(hf_model, tokenizer, prompts: list[list[int]], max_new_tokens: int, compiled_grammar=None,
                fixed_length: bool = False, **gen_kwargs) -> tuple[int, float]:
    """transformers.generate (+ xgrammar's logits processor). Returns (new tokens, seconds)."""
    import torch
    import xgrammar as xgr

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=hf_model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=hf_model.device)
    procs = []
    if compiled_grammar is not None:
        procs = [xgr.contrib.hf.LogitsProcessor([compiled_grammar] * len(prompts))]
    extra = {"min_new_tokens": max_new_tokens} if fixed_length else {}
    t0 = time.perf_counter()
    out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                            logits_processor=procs, pad_token_id=pad, **extra, **gen_kwargs)
    if hf_model.device.type == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    new = out[:, width:]
    eos = set([tokenizer.eos_token_id])
    count = 0
    for row in new.tolist():
        n = 0
        for t in row:
            n += 1
            if t in eos:
                break
        count += n
    return count, dt


def machine() -> dict:
    import torch
    info = {"platform": platform.platform(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
            "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        cpuinfo = open("/proc/cpuinfo").read()
        info["cpu"] = next(line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if line.startswith("model name"))
        info["cpu_bf16_units"] = [f for f in ("amx_bf16", "avx512_bf16") if f" {f}" in cpuinfo]
    except (OSError, StopIteration):
        pass
    return info


def write_results(name: str, payload: dict, table_md: str) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(payload, indent=2))
    (RESULTS / f"{name}.md").write_text(table_md)
    print(table_md)


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for r in rows:
        lines.append("| " + " | ".join(f"{c:.2f}" if isinstance(c, float) else str(c) for c in r) + " |")
    return "\n".join(lines) + "\n"


def bar_plot(path: Path, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / len(series)
    for i, (name, vals) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], vals, width, label=name)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(labels))])
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


@contextmanager
def timed_calls(methods, totals: dict[str, list[float]] | None = None):
    """While inside, each (class, method name) of `methods` adds its calls' wall time to
    totals["Class.method"] = [seconds, calls] (the dict yielded)."""
    totals = {} if totals is None else totals
    saved = []
    for cls, name in methods:
        fn = getattr(cls, name)
        saved.append((cls, name, fn))
        entry = totals.setdefault(f"{cls.__name__}.{name}", [0.0, 0])

        def timed(*a, _fn=fn, _entry=entry, **k):
            t0 = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                _entry[0] += time.perf_counter() - t0
                _entry[1] += 1
        setattr(cls, name, functools.wraps(fn)(timed))
    try:
        yield totals
    finally:
        for cls, name, fn in saved:
            setattr(cls, name, fn)
