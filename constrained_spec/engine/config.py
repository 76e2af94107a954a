"""Engine settings. CLI flags map one to one onto these fields."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import ClassVar


@dataclass
class EngineConfig:
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on CUDA and CPUs with native bfloat16, else float32 (models.loader.resolve_dtype)
    attention_backend: str = "auto"  # auto: triton on CUDA, torch on CPU
    kv_cache_memory_gb: float | None = None  # None: 1 GiB on CPU, 40% of free memory on CUDA
    kv_cache_slots: int | None = None  # exact token capacity; overrides kv_cache_memory_gb
    max_running_requests: int = 128
    max_model_len: int | None = None  # None: the model's max position (capped at 8192)
    max_prefill_tokens: int = 2048  # per step; longer prompts are prefilled in chunks
    max_queued_requests: int = 1024
    disable_prefix_cache: bool = False  # prefix caching: a radix tree of cached prompts/outputs over the KV pool
    disable_overlap: bool = False
    disable_cuda_graph: bool = False
    jump_forward: bool = False  # emit grammar-forced strings without sampling
    grammar_backend: str = "auto"  # xgrammar | llguidance | auto (per grammar; grammar/backend.py)
    # grammar compile workers; None: half the cores this process may use, 2 to 16 (the other half
    # is the step's: its thread and the mask threads). Compiles queue for them; the timeout below
    # counts a grammar's own compile time, not its wait
    grammar_threads: int | None = None
    # threads filling grammar bitmask rows (the native fill pool's); None: `default_mask_threads()`
    grammar_mask_threads: int | None = None
    # draft paths a walk at least (`MaskFiller.fill_paths`: an EAGLE frontier's or verify tree's rows,
    # a request's paths cut into walks on forks of its matcher while the pool has threads for them)
    grammar_paths_per_walk: int = 4
    grammar_mask_budget_ms: float | None = None  # per step; requests whose mask is not ready by then
    #   skip the step (losslessly) instead of holding the batch. None or 0: wait for every mask
    grammar_max_whitespace: int | None = 16  # whitespace run allowed between JSON tokens; None: unbounded
    #   (a small model can loop on whitespace forever when it is unbounded)
    grammar_compile_timeout_s: float = 30.0
    # compiled grammars kept across restarts (per tokenizer and options); None: the default folder,
    # $CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR or ~/.cache/constrained-spec/grammars; "none": no disk cache
    grammar_cache_dir: str | None = None
    # that folder's bound for these options' subfolder, MiB (least recently used files out first)
    grammar_disk_cache_mb: int = 1024
    # compiled grammars kept in memory, MiB (least recently used out first; also at most 512 of them)
    grammar_cache_mb: int = 512
    speculative_algorithm: str | None = None  # "ngram" or "eagle"; None: plain decoding
    speculative_num_draft_tokens: int = 8  # draft tree width N, root included
    speculative_max_batch: int = 32  # larger decode batches run plain (speculation loses there)
    speculative_min_accept: float = 0.3  # policy "always": mean accepted drafts below this pause speculation a while
    speculative_policy: str = "measured"  # "measured": per batch size, speculate while its measured tokens/s beat
    #   plain decoding's (grammar and drafting CPU time included); "always": whenever the rules above allow
    eagle_head: str | None = None  # EAGLE head folder; None: the head shipped for the default model
    eagle_topk: int = 4  # EAGLE tree: children drafted per node, and nodes expanded per depth
    eagle_depth: int = 6  # EAGLE tree: deepest draft node (head steps per speculative step)
    eagle_masked_depths: int = 1  # EAGLE tree: depths masked by the grammar while drafted (each past the first
    #   costs a host sync and a row fill per frontier node; the traversal before verify prunes the rest)
    eagle_fused_chain: bool = True  # EAGLE chains (eagle_topk 1): verify and the next chain's draft in one launch,
    #   one read a step ("naive EAGLE", speculative/chain_step.py); greedy batches (sampled ones draft apart)
    ngram_branches: int = 1  # children per draft node: 1 = chain, >1 = tree
    ngram_max_match: int = 8  # longest context suffix the trie matches
    ngram_min_match: int = 1
    ngram_capacity: int = 1 << 17  # shared trie nodes (eviction past this)
    seed: int = 0  # base for requests that do not give their own seed

    # the options' smallest values (the CLI checks its flags against them too): below them an engine
    # never admitted a request (max_running_requests 0: every generate waited forever) or failed late
    AT_LEAST: ClassVar[dict] = {
        "max_running_requests": 1, "max_queued_requests": 0, "max_prefill_tokens": 1, "kv_cache_slots": 1,
        "max_model_len": 1, "grammar_threads": 1, "grammar_mask_threads": 1, "grammar_paths_per_walk": 1,
        "grammar_max_whitespace": 0, "grammar_mask_budget_ms": 0.0, "speculative_num_draft_tokens": 1,
        "speculative_max_batch": 1, "speculative_min_accept": 0.0, "eagle_topk": 1, "eagle_depth": 1,
        "eagle_masked_depths": 0, "ngram_branches": 1, "ngram_max_match": 1, "ngram_min_match": 1,
        "ngram_capacity": 1}
    POSITIVE: ClassVar[tuple] = ("kv_cache_memory_gb", "grammar_compile_timeout_s", "grammar_cache_mb",
                                 "grammar_disk_cache_mb")
    CHOICES: ClassVar[dict] = {"dtype": ["auto", "float32", "float16", "bfloat16"],
                               "attention_backend": ["auto", "torch", "triton"],
                               "grammar_backend": ["auto", "xgrammar", "llguidance"],
                               "speculative_algorithm": ["ngram", "eagle"],  # or None: plain decoding
                               "speculative_policy": ["measured", "always"]}
    DEVICE: ClassVar = re.compile(r"cpu|cuda(:\d+)?|auto")

    def problem(self) -> str | None:
        """What is out of range among the options (a sentence naming it), or None."""
        for name, low in self.AT_LEAST.items():
            value = getattr(self, name)
            if value is None and self.__dataclass_fields__[name].default is None:  # None: its default behaviour
                continue
            if not _number(value) or (isinstance(low, int) and not isinstance(value, int)):
                return f"{name} must be {'an integer' if isinstance(low, int) else 'a number'}; got {value!r}"
            if value < low:
                return f"{name} must be at least {low}; got {value}"
        for name in self.POSITIVE:
            value = getattr(self, name)
            if value is not None and not (_number(value) and 0 < value < math.inf):
                return f"{name} must be a positive number; got {value!r}"
        if not isinstance(self.device, str) or not self.DEVICE.fullmatch(self.device):
            return f"device must be cpu, cuda, cuda:N or auto; got {self.device!r}"
        for name, choices in self.CHOICES.items():
            value = getattr(self, name)
            if name == "dtype" and not isinstance(value, str):  # a torch.dtype (`models.loader.resolve_dtype`)
                continue
            if value not in choices and not (value is None and name == "speculative_algorithm"):
                return f"{name} must be one of {', '.join(choices)}; got {value!r}"
        if self.ngram_min_match > self.ngram_max_match:
            return f"ngram_min_match ({self.ngram_min_match}) must not exceed ngram_max_match ({self.ngram_max_match})"
        if self.speculative_algorithm is not None:
            nodes = self.speculative_num_draft_tokens  # the tree's root (the last verified token) included
            if nodes < 2:
                return f"speculative_num_draft_tokens must be at least 2 with speculative_algorithm; got {nodes}"
            eagle = self.speculative_algorithm == "eagle"
            if eagle and not self.eagle_depth < nodes:
                return f"eagle_depth must be below speculative_num_draft_tokens ({nodes}); got {self.eagle_depth}"
            # compared with the mean accepted drafts per request-step: a step accepts at most the tree's
            # nodes but its root, an EAGLE step one a depth; above that, speculation would always pause
            most = self.eagle_depth if eagle else nodes - 1
            if self.speculative_min_accept > most:
                return (f"speculative_min_accept must be at most {most}, the most drafts a step accepts "
                        f"({'eagle_depth' if eagle else 'speculative_num_draft_tokens - 1'}); "
                        f"got {self.speculative_min_accept}")
        return None

    @property
    def max_held_requests(self) -> int:
        """Requests the engine holds at most, running and waiting: past it, a new one is refused."""
        return self.max_running_requests + self.max_queued_requests


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def default_mask_threads(reserved: int = 0) -> int:
    """All the cores but two (the fill runs beside the step's own Python work: engine/mask_filler.py)
    and but `reserved`: a split server's front-end processes need theirs, or a fill thread that
    claimed a row waits for a core while the step waits for it (on the H100 host, 16 cores, four
    front-ends, JSON at 128 streaming clients, one run each: 33.6k tok/s with 8 threads, 28.1k with
    4, 28.9k and 30.2k with 14)."""
    from ..cpus import available_cores  # here: the CLI loads this file alone for --help
    return max(1, min(16, available_cores() - 2 - reserved))
