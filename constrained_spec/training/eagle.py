"""Training an EAGLE head for a target model, by self-distillation: `constrained-spec train-eagle`.

  1. data: the target answers prompts with this engine, as it will when serving: JSON tasks over the
     JSONSchemaBench dev schemas (schemas/jsonschemabench-dev.jsonl) under their schemas' grammars,
     and general instructions (below). The hand-written schemas (schemas/handwritten, the JSON
     workload of benchmarks/bench_spec.py) are held out: the acceptance measured at the end runs on them.
  2. features: one forward of the target over every prompt + answer gives the last layer's pre-norm
     hidden state f_i at every position (what the head reads while serving, `ModelRunner.features`).
  3. training: the head reads (f_i, token i + 1) and is trained to predict f_{i+1} (smooth-L1 on the
     features scaled to unit RMS) and the target's next-token distribution at i + 2 (cross-entropy
     against softmax(lm_head(norm(f_{i+1}))), weight `p_weight`), on answer positions, with a little
     noise on the input features (the head reads its own guesses beyond depth 1), as in EAGLE.
     The head starts as a copy of the target's last layer; AdamW, warm-up, cosine decay over the time
     budget.
  4. the head is saved (bf16 safetensors + config.json recording how it was made), with the loss
     curves (train_log.json, train_curves.png when matplotlib is there) and the mean accepted length
     the engine measures with it on the held-out JSON tasks.
"""
from __future__ import annotations

import gc
import json
import logging
import math
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .eagle_config import TrainConfig

log = logging.getLogger(__name__)

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"

INSTRUCTIONS = [
    "Explain {t} to a ten-year-old.", "Write a short story about {t}.", "List five facts about {t}.",
    "Write a polite email to a colleague about {t}.", "Summarize what people should know about {t}.",
    "Give step-by-step advice on getting started with {t}.", "Write a haiku about {t}.",
    "What are the pros and cons of {t}?", "Describe a typical day that involves {t}.",
    "Write a product description related to {t}.", "Answer briefly: why does {t} matter?",
    "Write three interview questions about {t}, with short answers.", "Compare {t} with something similar.",
    "Write a short dialogue between two friends about {t}.", "Give a one-paragraph history of {t}.",
    "Write a tweet announcing news about {t}.", "Explain a common misconception about {t}.",
    "Plan a weekend project around {t}.", "Write a limerick about {t}.", "Describe {t} in three sentences.",
]
TOPICS = [
    "photosynthesis", "the stock market", "learning a new language", "volcanoes", "machine learning",
    "baking bread", "the Roman Empire", "climate change", "chess openings", "electric cars", "honeybees",
    "remote work", "the water cycle", "black holes", "jazz music", "recycling", "the human heart",
    "marathon training", "public libraries", "3D printing", "ocean tides", "coffee", "the internet",
    "vaccines", "mountain hiking", "budgeting", "solar panels", "the French Revolution", "sleep",
    "video games", "gardening", "earthquakes", "smartphones", "rainforests", "the moon landing", "cheese",
    "bicycles", "time zones", "password security", "origami",
]
JSON_PHRASES = [
    "Produce an example {name} as JSON.", "Generate realistic data for {name}.",
    "Fill in a plausible {name} record.", "Create a sample {name} for a test suite.",
    "Give one complete example of {name}.",
]


# -- 1. prompts and answers -------------------------------------------------------------------------
def _chat(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _schema_name(row: dict) -> str:
    schema = row["schema"]
    title = schema.get("title") if isinstance(schema, dict) else None
    if isinstance(title, str) and title.strip():
        return title.strip()
    name = row.get("id", "object").split("---")[-1]
    return " ".join(p for p in name.replace("-", "_").split("_") if p and not (len(p) == 8 and p.isalnum()
                                                                               and any(c.isdigit() for c in p)))


def training_prompts(tokenizer, n: int, json_share: float, max_tokens: int, temperature: float, seed: int,
                     max_schema_chars: int = 3000):
    """[(prompt ids, GrammarSpec | None, SamplingParams)]: JSON tasks over the dev schemas (each under
    its schema's grammar), then general instructions; the first use of a prompt text is greedy, its
    repeats sampled (seeded)."""
    from ..grammar import GrammarSpec
    from ..sampling_params import SamplingParams
    rng = random.Random(seed)
    rows = [json.loads(line) for line in (SCHEMAS / "jsonschemabench-dev.jsonl").read_text().splitlines() if line.strip()]
    rows = [r for r in rows if len(json.dumps(r["schema"])) <= max_schema_chars]
    n_json = int(round(n * json_share)) if rows else 0
    out, seen = [], set()
    for i in range(n):
        if i < n_json:
            row = rows[i % len(rows)]
            phrase = JSON_PHRASES[(i // len(rows)) % len(JSON_PHRASES)]
            text = (phrase.format(name=_schema_name(row) or "an object")
                    + f" Answer with JSON matching this schema: {json.dumps(row['schema'])}")
            grammar = GrammarSpec.json_schema(row["schema"])
        else:
            text = rng.choice(INSTRUCTIONS).format(t=rng.choice(TOPICS))
            grammar = None
        params = (SamplingParams(max_tokens=max_tokens, temperature=0) if text not in seen
                  else SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed * 100003 + i))
        seen.add(text)
        out.append((_chat(tokenizer, text), grammar, params))
    rng.shuffle(out)
    return out


def heldout_prompts(tokenizer, n: int):
    """The hand-written JSON tasks (bench_spec's JSON workload), never trained on."""
    from ..grammar import GrammarSpec
    rows = [json.loads(line) for line in (SCHEMAS / "handwritten" / "handwritten.jsonl").read_text().splitlines()
            if line.strip()]
    work = []
    for row in rows[:n]:
        text = (f"{row.get('prompt', 'Produce an example.')} Answer with JSON matching this schema: "
                f"{json.dumps(row['schema'])}")
        work.append((_chat(tokenizer, text), GrammarSpec.json_schema(row["schema"])))
    return work


def generate_answers(engine, prompts, chunk: int, minutes: float = 0.0) -> list[tuple[np.ndarray, int]]:
    """[(prompt + answer ids, prompt length)] for the prompts the engine answered without error.
    Prompts go in `chunk` at a time (several batches: a slow grammar compile holds up only its own
    request while the others decode); with `minutes` > 0 no chunk starts after that long."""
    from tqdm import tqdm
    seqs = []
    t0 = time.perf_counter()
    with tqdm(total=len(prompts), desc="generating", unit="answer") as bar:
        for i in range(0, len(prompts), chunk):
            if minutes and time.perf_counter() - t0 > 60 * minutes:
                log.warning("generation budget of %.1f min spent: %d of %d prompts answered", minutes, i, len(prompts))
                break
            wave = prompts[i:i + chunk]
            outs = engine.generate([ids for ids, _, _ in wave], [p for _, _, p in wave], [g for _, g, _ in wave])
            for (ids, _, _), o in zip(wave, outs):
                if o.error is None and len(o.token_ids) >= 2:
                    seqs.append((np.asarray(ids + o.token_ids, np.int64), len(ids)))
            bar.update(len(wave))
    return seqs


# -- 2. features ----------------------------------------------------------------------------------
@torch.inference_mode()
def capture_features(model, seqs, device, batch_tokens: int, max_len: int) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """One forward of the target over every sequence (cut to max_len): the pre-norm hidden states
    of all positions, [total, H] in one tensor, and (offset, length, prompt length) per sequence."""
    from tqdm import tqdm
    from ..attention import AttentionMetadata, ForwardMode, KVCache, get_attention_backend
    cfg = model.config
    dtype = next(model.parameters()).dtype
    backend = get_attention_backend("auto", str(device))
    seqs = [(ids[:max_len], min(p, max_len)) for ids, p in seqs]
    total = sum(len(ids) for ids, _ in seqs)
    feats = torch.empty(total, cfg.hidden_size, dtype=dtype, device=device)
    index, batches, cur, cur_tokens, off = [], [], [], 0, 0
    for i, (ids, p) in enumerate(seqs):
        index.append((off, len(ids), p))
        off += len(ids)
        if cur and cur_tokens + len(ids) > batch_tokens:
            batches.append(cur)
            cur, cur_tokens = [], 0
        cur.append(i)
        cur_tokens += len(ids)
    if cur:
        batches.append(cur)
    cap = max(batch_tokens, max(len(ids) for ids, _ in seqs)) + 1
    kv = KVCache(cfg.num_layers, cap, cfg.num_kv_heads, cfg.head_dim, dtype, device)
    for batch in tqdm(batches, desc="features", unit="batch"):
        lens = np.array([len(seqs[i][0]) for i in batch], np.int64)
        starts = np.zeros(len(batch) + 1, np.int64)
        np.cumsum(lens, out=starts[1:])
        T, L = int(starts[-1]), int(lens.max())
        slots = torch.arange(1, T + 1, device=device)
        table = torch.zeros(len(batch), L, dtype=torch.int64, device=device)
        for j, s in enumerate(starts[:-1]):
            table[j, :lens[j]] = torch.arange(s + 1, s + 1 + lens[j], device=device)
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lens])).to(device)
        meta = AttentionMetadata(
            mode=ForwardMode.EXTEND, out_slots=slots, q_starts=torch.from_numpy(starts).to(device, torch.int32),
            q_lens=torch.from_numpy(lens).to(device, torch.int32), kv_lens=torch.from_numpy(lens).to(device, torch.int32),
            slot_table=table, max_q_len=L, max_kv_len=L)
        ids = torch.from_numpy(np.concatenate([seqs[i][0] for i in batch])).to(device)
        _, pre_norm = model(ids, positions, kv, meta, backend, features=True)
        for j, i in enumerate(batch):
            o, n, _ = index[i]
            feats[o:o + n] = pre_norm[starts[j]:starts[j] + n]
    return feats, index


# -- 3. training ----------------------------------------------------------------------------------
class Batches:
    """Training batches: sequences of similar length padded together, ~batch_tokens tokens each."""

    def __init__(self, seqs, feats, index, batch_tokens: int, device, seed: int):
        self.seqs, self.feats, self.index = seqs, feats, index
        self.batch_tokens, self.device = batch_tokens, device
        self.rng = random.Random(seed)

    def sample(self, items: list[int]):
        order = sorted(self.rng.sample(items, len(items)), key=lambda i: self.index[i][1])
        batches, cur = [], []
        for i in order:
            width = max([self.index[j][1] for j in cur + [i]])
            if cur and width * (len(cur) + 1) > self.batch_tokens:
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
        self.rng.shuffle(batches)
        return batches

    def tensors(self, batch: list[int]):
        """(features [B, L, H], next ids [B, L], target features [B, L, H], loss mask [B, L], lengths [B]):
        position i reads f_i and token i + 1 and is scored on f_{i+1}, for answer positions."""
        B = len(batch)
        L = max(self.index[i][1] for i in batch) - 1
        H = self.feats.shape[1]
        f_in = torch.zeros(B, L, H, dtype=self.feats.dtype, device=self.device)
        f_out = torch.zeros_like(f_in)
        ids = torch.zeros(B, L, dtype=torch.int64)
        mask = torch.zeros(B, L, dtype=torch.bool)
        lengths = torch.zeros(B, dtype=torch.int64)
        for b, i in enumerate(batch):
            o, n, p = self.index[i]
            f_in[b, :n - 1] = self.feats[o:o + n - 1]
            f_out[b, :n - 1] = self.feats[o + 1:o + n]
            ids[b, :n - 1] = torch.from_numpy(self.seqs[i][0][1:n])
            mask[b, max(p - 1, 0):n - 1] = True
            lengths[b] = n - 1
        return f_in, ids.to(self.device), f_out, mask.to(self.device), lengths.to(self.device)


def unrolled_forward(head, target, features: torch.Tensor, input_ids: torch.Tensor, lengths: torch.Tensor | None,
                     steps: int) -> list[torch.Tensor]:
    """The head's guesses of f_{k+1} at every position k after 1..`steps` draft steps, [B, L, H] each,
    with the attention a draft node sees while serving (EAGLE-3's "training-time test"). Step 1 is
    `head.sequence_forward`: it reads the target's f_k. Step s reads at position k its own step s - 1
    guess from position k - 1 (beside the true token k + 1, as a draft whose earlier tokens were right)
    and attends to the step-1 keys of positions 0..k-s+1 (the context the target verified) and to the
    step-u key of position k-s+u for u = 2..s (its ancestors in the draft, and itself). Positions
    k < s - 1 of step s have no such draft and are padding."""
    from ..kernels.reference import rms_norm_ref, rope_cos_sin_ref, silu_and_mul_ref
    from ..models.eagle import _rotate_half
    B, L, _ = features.shape
    cfg, layer = head.config, head.layer
    attn = layer.self_attn
    dev = features.device
    emb = target.embed_tokens(input_ids).to(features.dtype)
    at = torch.arange(L, device=dev)
    q_pos, k_pos = at[:, None], at[None, :]
    keys_ok = (torch.ones(1, 1, 1, L, dtype=torch.bool, device=dev) if lengths is None
               else (k_pos < lengths[:, None])[:, None, None, :])  # keys past a sequence's end masked
    eye = torch.eye(L, dtype=torch.bool, device=dev)  # (step 1, as sequence_forward: padded rows stay finite)
    keys, values, outs, cos_sin = [], [], [], None
    for s in range(1, steps + 1):
        feat = features if s == 1 else torch.cat([torch.zeros_like(outs[-1][:, :1]), outs[-1][:, :-1]], 1)
        x = head.fc(torch.cat([emb, feat], -1))
        residual = x
        h = rms_norm_ref(x, layer.input_layernorm.weight, cfg.rms_norm_eps)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], -1)
        q = q.reshape(B * L, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B * L, cfg.num_kv_heads, cfg.head_dim)
        if cos_sin is None:
            cos_sin = rope_cos_sin_ref(at.repeat(B), target.rope.cos_sin_cache, q.dtype)
        cos, sin = cos_sin
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        q = q.view(B, L, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        keys.append(k.view(B, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2))
        values.append(v.reshape(B, L, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2))
        # [B, 1, L, s * L]: block 1 the verified context, block u (2..s) the step-u key of position k-s+u
        context = (k_pos <= q_pos - (s - 1))[None, None] & keys_ok
        blocks = [context | eye if s == 1 else context]
        blocks += [k_pos == q_pos - (s - u) for u in range(2, s + 1)]
        mask = torch.cat([b.expand(B, 1, L, L) for b in blocks], -1)
        out = F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask,
                                             scale=attn.scale, enable_gqa=True)
        x = attn.o_proj(out.transpose(1, 2).reshape(B, L, attn.q_size))
        residual = residual + x
        h = rms_norm_ref(residual, layer.post_attention_layernorm.weight, cfg.rms_norm_eps)
        outs.append(layer.mlp.down_proj(silu_and_mul_ref(layer.mlp.gate_up_proj(h))) + residual)
    return outs


def _losses(head, target, batch, scale: float, p_weight: float, noise: float, steps: int = 1,
            scored: int | None = None):
    """(loss, feature loss, distribution loss, top-1, [top-1 at each draft step]). With `steps` > 1
    the head also drafts on its own guesses (`unrolled_forward`): step s is scored where positions
    k - s + 1..k are all answer positions, against the same targets; the loss is the mean of the
    first `scored` steps' (default: all), the other figures are step 1's."""
    from ..kernels.reference import rms_norm_ref
    f_in, ids, f_out, mask, lengths = batch
    f_in = f_in.float()
    if noise:
        f_in = f_in + (torch.rand_like(f_in) * 2 - 1) * (noise * scale)
    if steps > 1:
        preds = unrolled_forward(head, target, f_in, ids, lengths, steps)
    else:
        preds = [head.sequence_forward(target, f_in, ids, lengths)]
    want = f_out[mask].float()
    norm_w, eps = target.norm.weight.float(), target.config.rms_norm_eps
    w = target.head_weight
    with torch.no_grad():
        teacher = F.linear(rms_norm_ref(want, norm_w, eps).to(w.dtype), w).float()
        top = teacher.argmax(-1)
        teacher = teacher.softmax(-1)
    losses, first, accs = [], None, []
    for s, pred in enumerate(preds, 1):
        m = mask.clone()
        if s > 1:  # the draft's root, position k - s + 1, is an answer position too
            m[:, :s - 1] = False
            m[:, s - 1:] &= mask[:, :mask.shape[1] - s + 1]
        sel = m[mask]
        p = pred[m]
        n = max(p.shape[0], 1)  # a deep step may have no position in a batch of short answers
        v_loss = F.smooth_l1_loss(p / scale, want[sel] / scale, reduction="sum") / (n * p.shape[-1])
        student = F.linear(rms_norm_ref(p, norm_w, eps).to(w.dtype), w).float().log_softmax(-1)
        p_loss = -(teacher[sel] * student).sum() / n
        acc = (student.argmax(-1) == top[sel]).float().sum() / n
        if s == 1:
            first = (v_loss, p_loss, acc)
        if s <= (scored or steps):
            losses.append(v_loss + p_weight * p_loss)
        accs.append(acc.detach())
    return torch.stack(losses).mean(), *first, accs


WARMUP_STEPS = 20
EVAL_DRAFT_STEPS = 3  # held-out top-1 is reported at draft steps 1..3 (the head reading its own guesses)


def learning_rate(peak: float, step: int, progress: float) -> float:
    """Linear warm-up over the first WARMUP_STEPS steps, then cosine decay from `peak` to a tenth of
    it over the run's progress (0 to 1: steps done / max_steps, or seconds spent / time budget)."""
    warm = min(1.0, (step + 1) / WARMUP_STEPS)
    return peak * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0))))


def train_head(head, target, data: Batches, train_items, val_items, cfg: TrainConfig, scale: float):
    """Trains `head` in place; returns its history. `cfg.unroll` > 1 trains on that many draft steps at once (`unrolled_forward`): a step costs ~2.3x
    at 3 (SmolLM2, CPU), so a time budget runs fewer of them."""
    from tqdm import tqdm
    unroll = max(1, int(cfg.unroll))
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if data.device.type == "cuda"
                else torch.autocast("cpu", enabled=False))
    budget = cfg.train_minutes * 60
    history = {"step": [], "loss": [], "feature_loss": [], "dist_loss": [], "top1": [], "lr": [], "val_step": [],
               "val_top1": [], "val_loss": [], "val_top1_by_step": [], "unroll": unroll}
    val_batches = data.sample(val_items)[:4] if val_items else []
    step, t0, best = 0, time.perf_counter(), None
    bar = tqdm(total=cfg.max_steps or None, desc="training", unit="step")
    done = False
    while not done:
        for batch in data.sample(train_items):
            # the run's progress: steps done of max_steps, or the share of the time budget spent. (The
            # budget once became a step count estimated from the first 20 steps' speed, which CUDA's
            # first-call costs made ~18x too slow on the H100: the cosine reached its floor within
            # ~500 of 8,930 steps, and 95% of the run trained at a tenth of the learning rate.)
            progress = step / cfg.max_steps if cfg.max_steps else (time.perf_counter() - t0) / budget
            lr = learning_rate(cfg.lr, step, progress)
            for g in opt.param_groups:
                g["lr"] = lr
            head.train()
            with autocast:
                loss, v, p, acc, _ = _losses(head, target, data.tensors(batch), scale, cfg.p_weight, cfg.noise,
                                             steps=unroll)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            opt.step()
            step += 1
            elapsed = time.perf_counter() - t0
            last = bool(cfg.max_steps and step >= cfg.max_steps) or (not cfg.max_steps and elapsed >= budget)
            if step % 10 == 0 or step == 1 or last:  # the last step too: info["steps"] is the count
                history["step"].append(step)
                for k, x in (("loss", loss), ("feature_loss", v), ("dist_loss", p), ("top1", acc)):
                    history[k].append(float(x.detach()))
                history["lr"].append(lr)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", top1=f"{float(acc):.3f}", lr=f"{lr:.1e}")
            if val_batches and (step % 100 == 0):
                best = _checkpoint(head, target, data, val_batches, scale, cfg, autocast, history, step, best)
            bar.update(1)
            if last:
                done = True
                break
    bar.close()
    if val_batches:
        best = _checkpoint(head, target, data, val_batches, scale, cfg, autocast, history, step, best)
        head.load_state_dict(best[2])
        history["best_step"], history["best_val_loss"] = best[0], best[1]
    history["seconds"] = time.perf_counter() - t0
    return history


def _checkpoint(head, target, data, val_batches, scale, cfg, autocast, history, step, best):
    """Evaluates on the held-out answers; returns the best (step, loss, weights) so far: a small data
    set is soon learned by heart, and the head kept is the one that predicted held-out answers best."""
    vl, va, by_step = _evaluate(head, target, data, val_batches, scale, cfg, autocast, history.get("unroll", 1))
    history["val_step"].append(step)
    history["val_loss"].append(vl)
    history["val_top1"].append(va)
    history["val_top1_by_step"].append(by_step)
    if best is None or vl < best[1]:
        best = (step, vl, {k: v.detach().clone() for k, v in head.state_dict().items()})
    return best


@torch.no_grad()
def _evaluate(head, target, data, batches, scale, cfg, autocast, unroll: int = 1) -> tuple[float, float, list]:
    """(loss as trained, top-1, top-1 at draft steps 1..max(unroll, EVAL_DRAFT_STEPS)) on `batches`.
    Top-1 at step 1 only says little of deep drafts (each deeper one reads the head's own guess)."""
    head.eval()
    losses, accs, by_step = [], [], []
    with autocast:
        for batch in batches:
            loss, _, _, acc, steps = _losses(head, target, data.tensors(batch), scale, cfg.p_weight, 0.0,
                                             steps=max(unroll, EVAL_DRAFT_STEPS), scored=unroll)
            losses.append(float(loss))
            accs.append(float(acc))
            by_step.append([float(a) for a in steps])
    return float(np.mean(losses)), float(np.mean(accs)), [round(float(x), 4) for x in np.mean(by_step, 0)]


def plot_history(history: dict, path: Path) -> bool:
    """train_curves.png: losses and top-1 agreement with the target; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(history["step"], history["loss"], label="train loss")
    a.plot(history["step"], history["feature_loss"], label="feature loss")
    if history["val_step"]:
        a.plot(history["val_step"], history["val_loss"], "o-", label="held-out loss")
    a.set_xlabel("step")
    a.set_yscale("log")
    a.legend()
    b.plot(history["step"], history["top1"], label="train top-1 = target's")
    if history["val_step"]:
        b.plot(history["val_step"], history["val_top1"], "o-", label="held-out top-1")
    if history.get("acceptance"):
        b.axhline(history["acceptance"]["mean_accepted"] / 10, ls="--", color="gray",
                  label=f"engine mean accepted length / 10 ({history['acceptance']['mean_accepted']:.2f})")
    b.set_xlabel("step")
    b.set_ylim(0, 1)
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- 4. the command ---------------------------------------------------------------------------------
def measure_acceptance(loaded, engine_kw: dict, head_dir: Path, cfg: TrainConfig, max_tokens: int,
                       masked_depths: int = 1) -> dict:
    """The engine with a head on the held-out JSON tasks (greedy, speculating at every step), the grammar
    masking draft depths 1..`masked_depths` (1: the serving default). Pinned and recorded: the shipped
    head's 2.67 was measured when every depth was masked (before eagle_masked_depths), and the same
    head accepts far fewer deep drafts with depth 1 alone (CPU fp32, 30 tasks: 2.37 all masked, 2.07 at
    1), so figures under other masking, or another engine, are not comparable."""
    from ..engine import Engine
    from ..sampling_params import SamplingParams
    work = heldout_prompts(loaded.tokenizer, cfg.eval_prompts)
    engine_kw = {**engine_kw, "max_running_requests": max(32, len(work))}  # fewer graphs to capture
    with Engine(loaded=loaded, **engine_kw, speculative_algorithm="eagle", eagle_head=str(head_dir),
                speculative_policy="always", speculative_min_accept=0.0, eagle_topk=cfg.eagle_topk,
                eagle_depth=cfg.eagle_depth, eagle_masked_depths=masked_depths,
                speculative_num_draft_tokens=cfg.draft_tokens) as engine:
        t0 = time.perf_counter()
        outs = engine.generate([p for p, _ in work], SamplingParams(max_tokens=max_tokens, temperature=0),
                               [g for _, g in work])
        seconds = time.perf_counter() - t0
        st = engine.spec.stats
        return {"prompts": len(work), "tokens": sum(len(o.token_ids) for o in outs), "seconds": round(seconds, 2),
                "mean_accepted": round(st.mean_accepted, 3), "spec_steps": st.steps,
                "histogram": st.histogram[:cfg.draft_tokens + 1], "masked_depths": masked_depths}


def shipped_head(model: str | None, out: Path) -> Path | None:
    """The head shipped for `model` (None where none ships, or it is the one being written)."""
    from ..models.eagle import HeadMismatch, default_head_dir
    try:
        path = default_head_dir(model)
    except HeadMismatch:
        return None
    if not (path / "model.safetensors").is_file() or path.resolve() == Path(out).resolve():
        return None
    return path


def train_eagle(cfg: TrainConfig) -> Path:
    from ..engine import Engine
    from ..engine.engine import resolve_device
    from ..models import load_model
    from ..models.eagle import EagleHead, init_head, save_head
    t_start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    device = resolve_device(cfg.device)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(cfg.model, dtype=cfg.dtype, device=str(device))
    # from the last layer as loaded (before an engine repacks the model's CPU projections)
    head = init_head(EagleHead(loaded.config), loaded.model, cfg.seed).to(device=device, dtype=torch.float32)
    engine_kw = dict(device=str(device), max_running_requests=max(cfg.gen_batch, 8), grammar_compile_timeout_s=10.0,
                     **({"kv_cache_slots": 1 << 16} if device.type == "cpu" else {}))

    prompts = training_prompts(loaded.tokenizer, cfg.prompts, cfg.json_share, cfg.max_tokens, cfg.temperature,
                               cfg.seed)
    t = time.perf_counter()
    with Engine(loaded=loaded, **engine_kw, max_queued_requests=4 * cfg.gen_batch + 8) as engine:
        seqs = generate_answers(engine, prompts, 4 * cfg.gen_batch, cfg.gen_minutes)
    gen_seconds = time.perf_counter() - t
    del engine
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if len(seqs) < 2:
        raise RuntimeError(f"only {len(seqs)} answers were generated; nothing to train on")
    answer_tokens = sum(len(ids) - p for ids, p in seqs)
    log.info("generated %d answers, %d answer tokens, in %.1f s", len(seqs), answer_tokens, gen_seconds)

    target = loaded.model
    target.requires_grad_(False)
    feats, index = capture_features(target, seqs, device, cfg.batch_tokens, cfg.max_len)
    scale = float(feats[::max(1, len(feats) // 65536)].float().pow(2).mean().sqrt())
    items = list(range(len(seqs)))
    random.Random(cfg.seed).shuffle(items)
    n_val = max(1, len(items) // 20) if len(items) >= 20 else 0
    val_items, train_items = items[:n_val], items[n_val:]
    data = Batches(seqs, feats, index, cfg.batch_tokens, device, cfg.seed)
    history = train_head(head, target, data, train_items, val_items, cfg, scale)

    info = {"target": loaded.name, "made_by": "constrained-spec train-eagle", "config": asdict(cfg),
            "answers": len(seqs), "answer_tokens": answer_tokens, "tokens": int(feats.shape[0]),
            "feature_rms": scale, "steps": history["step"][-1] if history["step"] else 0,
            "train_seconds": round(history["seconds"], 1), "generate_seconds": round(gen_seconds, 1),
            "final_top1": history["top1"][-1] if history["top1"] else None,
            "heldout_top1": (history["val_top1"][history["val_step"].index(history["best_step"])]
                             if history.get("best_step") is not None else None),
            "heldout_top1_by_step": (history["val_top1_by_step"][history["val_step"].index(history["best_step"])]
                                     if history.get("best_step") is not None else None),
            "kept_step": history.get("best_step"), "heldout_loss": history.get("best_val_loss"),
            "torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    head_dtype = torch.bfloat16 if device.type == "cuda" else next(target.parameters()).dtype
    save_head(head, out, dtype=head_dtype, info=info)
    del feats, data
    gc.collect()
    if cfg.eval_prompts:
        max_tokens = min(cfg.max_tokens, 192)
        history["acceptance"] = measure_acceptance(loaded, engine_kw, out, cfg, max_tokens)
        info["heldout_acceptance"] = history["acceptance"]
        if cfg.eagle_depth > 1:  # every depth masked: how the shipped head's figure was measured
            info["heldout_acceptance_all_masked"] = measure_acceptance(loaded, engine_kw, out, cfg, max_tokens,
                                                                       masked_depths=cfg.eagle_depth)
        baseline = shipped_head(cfg.model, out)
        if baseline is not None:  # the head shipped now, on this engine, machine and tasks: a fair comparison
            info["baseline_acceptance"] = {**measure_acceptance(loaded, engine_kw, baseline, cfg, max_tokens),
                                           "head": str(baseline)}
        history["acceptance_all_masked"] = info.get("heldout_acceptance_all_masked")
        history["baseline_acceptance"] = info.get("baseline_acceptance")
        save_head(head, out, dtype=head_dtype, info=info)
    info["total_seconds"] = round(time.perf_counter() - t_start, 1)
    save_head(head, out, dtype=head_dtype, info=info)
    (out / "train_log.json").write_text(json.dumps(history) + "\n")
    plot_history(history, out / "train_curves.png")
    log.info("EAGLE head written to %s (%.0f s in all)", out, info["total_seconds"])
    return out
