"""Runs one step on the device: builds the inputs, runs the model, masks and samples.

The step is split in two so the engine can overlap CPU grammar work with the GPU:
`forward()` launches the model and returns at once (on CUDA); `sample()` applies the grammar
bitmask and samples, leaving the tokens in a pinned host buffer behind a CUDA event. Nothing here
reads a device value back except `StepResult.wait()`, the one sync per step.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from ..attention import AttentionMetadata, ForwardMode, KVCache, get_attention_backend
from ..models.cpu_linear import prepack_bf16_linears
from ..models.native_forward import NativeForward
from ..pinned import record_on_current_stream
from .batch import ScheduledBatch
from .config import EngineConfig
from .cuda_graph import CudaGraphRunner, GraphStep
from .kv_cache import OutOfSlots, RequestSlotTable, SlotPool
from .prefix_cache import PrefixCache
from .request import FinishReason
from .sampler import SamplingBatch, sample

DEFAULT_MAX_CONTEXT = 8192  # the context without --max-model-len, where the model has more positions

log = logging.getLogger(__name__)


@dataclass
class _Plan:
    rows: np.ndarray  # [B]
    q_lens: np.ndarray  # [B]
    kv_lens: np.ndarray  # [B]
    q_starts: np.ndarray  # [B+1]
    positions: np.ndarray  # [T]
    out_slots: np.ndarray  # [T]
    token_rows: np.ndarray  # [T]
    host_ids: list[int]  # [T] for EXTEND


@dataclass
class StepResult:
    batch: ScheduledBatch
    tokens_host: torch.Tensor  # [n_sampling] int64, pinned on CUDA
    logprobs_host: tuple[torch.Tensor, ...] | None
    event: torch.cuda.Event | None
    masked: bool = False  # sampled under the runner's bitmask rows (set by the engine)

    def wait(self) -> tuple[list[int], list[dict] | None]:
        if self.event is not None:
            self.event.synchronize()
        tokens = self.tokens_host.tolist()
        if self.logprobs_host is None:
            return tokens, None
        chosen, top_ids, top_vals = (t.tolist() for t in self.logprobs_host)
        return tokens, [
            {"logprob": chosen[i], "top": list(zip(top_ids[i], top_vals[i]))} for i in range(len(tokens))
        ]


class ModelRunner:
    def __init__(self, loaded, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.model = loaded.model
        if device.type == "cpu" and dtype == torch.bfloat16:
            prepack_bf16_linears(self.model)  # AMX / oneDNN layouts: the step's GEMMs 1.3-2x faster
        # bf16 CPU: every step's layers in one native call where every projection is AMX-packed
        self.native_forward = NativeForward.build(self.model) if device.type == "cpu" else None
        self.mcfg = loaded.config
        self.device, self.dtype = device, dtype
        self.cuda_index = (device.index if device.index is not None else torch.cuda.current_device()) \
            if device.type == "cuda" else None
        self.vocab_size = self.mcfg.vocab_size
        self.backend = get_attention_backend(config.attention_backend, str(device))
        # by default at most DEFAULT_MAX_CONTEXT: a request without max_tokens may run to the context's
        # end (Qwen2.5's 32,768 positions: an hour of decode for one request on a CPU)
        self.max_context = min(config.max_model_len or DEFAULT_MAX_CONTEXT, self.mcfg.max_position)
        if config.max_model_len is not None and config.max_model_len > self.max_context:
            # the model has no positions past its own (its RoPE table ends there): capped, said, and
            # the config (the engine's own copy) reports the context in use
            log.warning("max_model_len %d is longer than the model's %d positions; capped at %d",
                        config.max_model_len, self.mcfg.max_position, self.max_context)
            config.max_model_len = self.max_context
        num_slots = self._num_kv_slots(config)
        self.kv = KVCache(self.mcfg.num_layers, num_slots, self.mcfg.num_kv_heads, self.mcfg.head_dim, dtype, device)
        self.pool = SlotPool(num_slots)
        self.max_rows = config.max_running_requests
        self.table = RequestSlotTable(self.max_rows, self.max_context, device)
        self.pad_row = self.table.pad_row
        self.prefix_cache = None if config.disable_prefix_cache else PrefixCache(self)
        self.last_token = torch.zeros(self.max_rows + 1, dtype=torch.int64, device=device)
        self.bitmask_width = (self.vocab_size + 31) // 32
        # grammar masks are filled here by the CPU and copied by the sample step (a graph on CUDA)
        self.bitmask_host = torch.zeros(self.max_rows, self.bitmask_width, dtype=torch.int32,
                                        pin_memory=device.type == "cuda")
        self.token_counts: torch.Tensor | None = None  # [rows, V], allocated when penalties appear
        self.pinned = device.type == "cuda"
        # EAGLE: every forward writes the last layer's pre-norm hidden state of each new token here,
        # at its KV slot, for the draft head (speculative/eagle.py); plain engines skip the write
        self.features = (torch.zeros(num_slots, self.mcfg.hidden_size, dtype=dtype, device=device)
                         if config.speculative_algorithm == "eagle" else None)
        self.graphs = self._capture_graphs(config)
        log.info("KV cache: %d token slots (%.2f GiB), attention backend %s", num_slots,
                 num_slots * KVCache.bytes_per_slot(self.mcfg.num_layers, self.mcfg.num_kv_heads,
                                                    self.mcfg.head_dim, dtype) / 2**30, self.backend.name)

    def _capture_graphs(self, config: EngineConfig) -> CudaGraphRunner | None:
        if self.device.type != "cuda" or config.disable_cuda_graph:
            return None
        if self.backend.name == "torch":
            log.warning("CUDA graphs need the triton attention backend; running the torch backend eagerly")
            return None
        graphs = CudaGraphRunner(self)
        graphs.capture_decode(self.bitmask_host)
        graphs.capture_prefill(config.max_prefill_tokens, self.bitmask_host)
        return graphs

    def _num_kv_slots(self, config: EngineConfig) -> int:
        if config.kv_cache_slots is not None:
            return config.kv_cache_slots + 1  # slot 0 is reserved padding
        per_slot = KVCache.bytes_per_slot(self.mcfg.num_layers, self.mcfg.num_kv_heads, self.mcfg.head_dim, self.dtype)
        if config.kv_cache_memory_gb is not None:
            budget = config.kv_cache_memory_gb * 2**30
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = 0.4 * free
        else:
            budget = 2**30
        slots = int(budget // per_slot)
        if slots < 64:
            raise ValueError(f"KV cache budget of {budget / 2**20:.1f} MiB holds only {slots} tokens; raise it")
        return slots

    # -- host → device ---------------------------------------------------------------------------
    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(array)
        if self.pinned:
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    def plan(self, batch: ScheduledBatch) -> "_Plan":
        """Host side of a step: allocates KV slots for the new tokens and lays out the inputs."""
        if batch.mode is ForwardMode.DECODE:
            return self._plan_decode(batch)
        B = batch.size
        rows = np.empty(B, dtype=np.int64)
        q_lens = np.asarray(batch.num_new_tokens, dtype=np.int64)
        kv_lens = np.empty(B, dtype=np.int64)
        host_ids: list[int] = []
        for i, (req, n) in enumerate(zip(batch.requests, batch.num_new_tokens)):
            if req.row < 0:
                req.row = self.table.take_row()
                self._reset_row_state(req)
                if self.prefix_cache is not None:
                    self.prefix_cache.place_prefix(req)
            rows[i] = req.row
            self.table.append(req.row, self.pool.alloc(n))
            if batch.mode is ForwardMode.EXTEND:
                host_ids.extend(req.ids_range(req.num_cached, req.num_cached + n))
            req.num_cached += n
            kv_lens[i] = req.num_cached
        q_starts = np.zeros(B + 1, dtype=np.int64)
        np.cumsum(q_lens, out=q_starts[1:])
        T = int(q_starts[-1])
        token_rows = np.repeat(rows, q_lens)
        positions = np.arange(T, dtype=np.int64) - np.repeat(q_starts[:-1], q_lens) + np.repeat(kv_lens - q_lens, q_lens)
        out_slots = self.table.host[token_rows, positions]
        batch.sample_index = [i for i, s in enumerate(batch.samples) if s]
        return _Plan(rows, q_lens, kv_lens, q_starts, positions, out_slots, token_rows, host_ids)

    def _plan_decode(self, batch: ScheduledBatch) -> "_Plan":
        """`plan` for a decode step (every request holds a row and adds one token), vectorized:
        it runs every step for the whole batch, so it must not loop over the table in Python."""
        reqs = batch.requests
        B = len(reqs)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=B)
        positions = np.fromiter((r.num_cached for r in reqs), dtype=np.int64, count=B)
        if B and int(positions.max()) >= self.table.max_context:
            raise OutOfSlots(f"context exceeds the maximum of {self.table.max_context} tokens")
        slots = self.pool.alloc(B)
        self.table.host[rows, positions] = slots
        self.table.lengths[rows] = positions + 1
        for r in reqs:
            r.num_cached += 1
        ones = np.ones(B, dtype=np.int64)
        batch.sample_index = list(range(B))
        return _Plan(rows, ones, positions + 1, np.arange(B + 1, dtype=np.int64), positions, slots, rows, [])

    def _eager_forward(self, batch: ScheduledBatch, p: "_Plan") -> torch.Tensor:
        B, T = batch.size, len(p.positions)
        packed = self._to_device(np.concatenate([p.rows, p.q_lens, p.kv_lens, p.q_starts, p.positions, p.out_slots,
                                                 p.token_rows]))
        rows_d, q_lens_d, kv_lens_d, q_starts_d, pos_d, slots_d, token_rows_d = torch.split(
            packed, [B, B, B, B + 1, T, T, T])
        self.table.write_device(token_rows_d, pos_d, slots_d)
        if batch.mode is ForwardMode.DECODE:
            input_ids = self.last_token[rows_d]
        else:
            input_ids = self._to_device(np.asarray(p.host_ids, dtype=np.int64))
        # On CUDA a decode reads the full-width table, as its graph does, so both take the same splits.
        graphed_shape = batch.mode is ForwardMode.DECODE and self.device.type == "cuda"
        max_kv = self.max_context if graphed_shape else int(p.kv_lens.max())
        meta = AttentionMetadata(
            mode=batch.mode, out_slots=slots_d, q_starts=q_starts_d.to(torch.int32), q_lens=q_lens_d.to(torch.int32),
            kv_lens=kv_lens_d.to(torch.int32), slot_table=self.table.device_table[rows_d, :max_kv],
            max_q_len=int(p.q_lens.max()), max_kv_len=max_kv)
        hidden = self.run_model(input_ids, pos_d, meta)
        q_ends = q_starts_d[1:] - 1
        if len(batch.sample_index) != B:
            hidden = hidden[q_ends[self._index(batch.sample_index)]]
            rows_d = rows_d[self._index(batch.sample_index)]
        elif batch.mode is not ForwardMode.DECODE:
            hidden = hidden[q_ends]
        self._rows_d = rows_d
        return self.model.compute_logits(hidden).float()

    def run_model(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of one forward (eager, or being captured): the native CPU step
        where it applies. With `features`, the pre-norm hidden states go to their slots there."""
        if self.features is not None:
            hidden, pre_norm = self.model(input_ids, positions, self.kv, meta, self.backend, features=True)
            self.features.index_copy_(0, meta.out_slots, pre_norm)
            return hidden
        if self.native_forward is not None and self.native_forward.applies(meta):
            return self.native_forward(input_ids, positions, self.kv, meta)
        return self.model(input_ids, positions, self.kv, meta, self.backend)

    def _reset_row_state(self, req) -> None:
        if self.token_counts is not None:
            self.token_counts[req.row].zero_()
            self._count_outputs(req)

    def _count_outputs(self, req) -> None:
        if req.output_ids:
            ids = torch.as_tensor(req.output_ids, device=self.device)
            self.token_counts[req.row].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))

    # -- the step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch) -> "torch.Tensor | GraphStep":
        """Launches the model. Returns the logits [n_sampling, V] (float32) of the rows that sample,
        or, for a graphed decode or prefill step, a GraphStep whose sample tail is a graph too."""
        p = self.plan(batch)
        # the prefixes `plan` placed: a graphed prefill carries them in its input copy
        cache = self.prefix_cache
        writes = cache.take_writes() if cache is not None else None
        if batch.mode is ForwardMode.DECODE and self.graphs is not None and self.graphs.can_decode(batch.size):
            return self.graphs.launch_decode(p.rows, p.positions, p.out_slots, p.kv_lens)
        if batch.mode is ForwardMode.EXTEND and self.graphs is not None:
            launched = self.graphs.launch_prefill(p.rows, np.asarray(p.host_ids, dtype=np.int64), p.positions,
                                                  p.out_slots, p.token_rows, p.q_lens, p.kv_lens,
                                                  batch.sample_index, writes, cache.upload if cache is not None else None)
            if launched is not None:
                return launched
        if writes is not None:
            cache.upload(writes)
        return self._eager_forward(batch, p)

    def _index(self, positions: list[int]) -> torch.Tensor:
        return self._to_device(np.asarray(positions, dtype=np.int64))

    @torch.inference_mode()
    def sample(self, batch: ScheduledBatch, logits: "torch.Tensor | GraphStep", bitmask: torch.Tensor | None,
               apply_bitmask, skip: Sequence[int] = ()) -> StepResult:
        """Masks (bitmask: rows of `self.bitmask_host`, filled by the caller) and samples.

        `skip`: positions among the sampling requests whose sample is void (their grammar mask
        missed the step's budget). The step is undone for them (`_repeat_for`), so that the next
        decode step computes the same position again and samples it with its mask."""
        reqs = batch.sampling_requests()
        result = self._sample_graphed(batch, reqs, logits, bitmask)
        counted = False
        if result is None:
            result = self._sample_eager(batch, reqs, logits, bitmask, apply_bitmask)
            counted = self.token_counts is not None
        if skip:
            self._repeat_for([reqs[i] for i in skip], uncount=counted)
        return result

    def _sample_graphed(self, batch, reqs, logits, bitmask) -> StepResult | None:
        """The sample tail of a graphed forward as a graph replay; None when the step needs the eager path."""
        if not isinstance(logits, GraphStep):
            return None
        step = logits
        self._rows_d = step.rows
        greedy = all(r.params.greedy for r in reqs)
        plain = not any(r.params.logprobs is not None or r.params.adjusts_logits for r in reqs)
        if not (plain and step.graphs.can_sample(step, bitmask is not None, greedy)):
            return None
        params = None if greedy else self._sampling_params_host(reqs)
        tokens_host = step.graphs.launch_sample(step, bitmask is not None, greedy, params)
        event = torch.cuda.Event()
        record_on_current_stream(event, self.cuda_index)
        return StepResult(batch, tokens_host, None, event)

    def _sample_eager(self, batch, reqs, logits, bitmask, apply_bitmask) -> StepResult:
        if isinstance(logits, GraphStep):
            logits = logits.logits
        rows_d = self._rows_d
        if bitmask is not None:
            apply_bitmask(logits, bitmask.to(self.device, non_blocking=True))
        sb = self._sampling_batch(reqs, rows_d)
        tokens = sample(logits, sb) if reqs else torch.empty(0, dtype=torch.int64, device=self.device)
        self.last_token[rows_d] = tokens
        if self.token_counts is not None:
            self.token_counts[rows_d, tokens] += 1
        logprobs = self._logprobs(reqs, logits, tokens)
        return self._to_host(batch, tokens, logprobs)

    def _repeat_for(self, reqs, uncount: bool) -> None:
        """Undoes the step just sampled for these requests: their input token goes back into
        `last_token` (the void sample overwrote it on the device), the void sample leaves the
        penalty counts (`uncount`: the step counted it), and the KV slot of the position the step
        computed is given back. Their next decode step then has the same input, position and
        context as this one. Device work only, queued behind the sample: no sync."""
        n = len(reqs)
        rows = np.fromiter((r.row for r in reqs), dtype=np.int64, count=n)
        inputs = np.fromiter((_token_at(r, r.num_cached - 1) for r in reqs), dtype=np.int64, count=n)
        rows_d, inputs_d = torch.split(self._to_device(np.concatenate([rows, inputs])), [n, n])
        if uncount:
            self.token_counts[rows_d, self.last_token[rows_d]] -= 1
        self.last_token[rows_d] = inputs_d
        for r in reqs:
            self.rewind(r, 1)

    def _sampling_params_host(self, reqs) -> tuple[np.ndarray, np.ndarray]:
        vocab = self.vocab_size
        f = np.array([(r.params.temperature, r.params.top_p, r.params.min_p,
                       r.params.top_k if 0 < r.params.top_k < vocab else vocab) for r in reqs], dtype=np.float32)
        i = np.array([(r.seed, r.num_cached - len(r.prompt_ids)) for r in reqs], dtype=np.int64)
        return f, i

    def _to_host(self, batch, tokens, logprobs) -> StepResult:
        def host(t):
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pinned)
            out.copy_(t, non_blocking=True)
            return out
        lp_host = None if logprobs is None else tuple(host(t) for t in logprobs)
        event = None
        tokens_host = host(tokens)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            record_on_current_stream(event, self.cuda_index)
        return StepResult(batch, tokens_host, lp_host, event)

    def _logprobs(self, reqs, logits, tokens):
        k = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        if k is None:
            return None
        lp = torch.log_softmax(logits, dim=-1)
        chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top_vals, top_ids = lp.topk(max(k, 1), dim=-1)
        return chosen, top_ids, top_vals

    def sample_ahead(self, reqs, logits: torch.Tensor, ahead: np.ndarray) -> torch.Tensor:
        """Row b * N + j of `logits` drawn as a plain decode step of `reqs[b]` would draw it
        `ahead[b, j]` output positions later: same seed, position counter, temperature and filters
        (no penalties). The speculative step's sampled verification; [B, N] tokens on the device."""
        B, N = ahead.shape
        sb = self._sampling_batch(reqs, None)
        expand = lambda t: t.repeat_interleave(N)
        offsets = torch.from_numpy(np.ascontiguousarray(ahead, dtype=np.int64).reshape(-1)).to(logits.device)
        per_node = SamplingBatch(temperature=expand(sb.temperature), top_k=expand(sb.top_k),
                                 top_p=expand(sb.top_p), min_p=expand(sb.min_p), seeds=expand(sb.seeds),
                                 steps=expand(sb.steps) + offsets, needs_filter=sb.needs_filter)
        return sample(logits[:B * N], per_node).view(B, N)

    def _sampling_batch(self, reqs, rows_d) -> SamplingBatch:
        n = len(reqs)
        f = np.empty((6, n), dtype=np.float64)
        for i, r in enumerate(reqs):
            p = r.params
            # top_k past the vocabulary is the vocabulary (as a float past 2**63 it is no int64)
            f[:, i] = (p.temperature, p.top_p, p.min_p, p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size,
                       p.frequency_penalty, p.presence_penalty)
        ints = np.array([[r.seed for r in reqs], [r.num_cached - len(r.prompt_ids) for r in reqs]], dtype=np.int64)
        ints = ints.reshape(2, n)
        fd = self._to_device(f.astype(np.float32))
        idev = self._to_device(ints)
        greedy = bool((f[0] <= 1e-5).all())
        penalties = bool((f[4] != 0).any() or (f[5] != 0).any())
        if penalties and self.token_counts is None:
            self.token_counts = torch.zeros(self.max_rows + 1, self.vocab_size, dtype=torch.int32, device=self.device)
            for r in reqs:  # first use: seed the counts from outputs so far
                self._count_outputs(r)
        return SamplingBatch(
            temperature=fd[0], top_p=fd[1], min_p=fd[2], top_k=fd[3].long(), seeds=idev[0], steps=idev[1],
            frequency_penalty=fd[4] if penalties else None, presence_penalty=fd[5] if penalties else None,
            token_counts=self.token_counts[rows_d] if penalties else None,
            logit_bias=self._logit_bias(reqs),
            all_greedy=greedy,
            needs_filter=bool((f[1] < 1).any() or (f[2] > 0).any() or (f[3] < self.vocab_size).any()),
        )

    def _logit_bias(self, reqs):
        """Every request's logit_bias entries as (batch rows, token ids, biases) on the device, in
        one copy; None when no request has one."""
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if not biased:
            return None
        n = sum(len(b) for _, b in biased)
        host = np.empty((3, n), np.float64)  # token ids and rows are exact in float64
        host[0] = np.repeat([i for i, _ in biased], [len(b) for _, b in biased])
        host[1] = np.fromiter((t for _, b in biased for t in b), np.float64, n)
        host[2] = np.fromiter((v for _, b in biased for v in b.values()), np.float64, n)
        dev = self._to_device(host)
        return dev[0].long(), dev[1].long(), dev[2].float()

    # -- KV release ------------------------------------------------------------------------------
    def rewind(self, req, n: int) -> None:
        """Gives back the KV slots of a request's last `n` cached positions (a step to be repeated)."""
        keep = req.num_cached - n
        self.pool.free(self.table.truncate(req.row, keep))
        req.num_cached = keep

    def release(self, req) -> None:
        """Returns all of a request's KV slots and its table row; with the prefix cache, its
        computed context goes into the cache instead (unless the request failed: an engine error
        may have left its K/V half written)."""
        if self.prefix_cache is not None:
            self.prefix_cache.release(req, keep=req.finish_reason is not FinishReason.ERROR)
            req.row = -1
        elif req.row >= 0:
            self.pool.free(self.table.release_row(req.row))
            req.row = -1
        req.num_cached = 0


def _token_at(req, position: int) -> int:
    """The token at a position of the request's context (prompt, then output)."""
    n = len(req.prompt_ids)
    return req.prompt_ids[position] if position < n else req.output_ids[position - n]
