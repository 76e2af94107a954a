"""The settings of `constrained-spec train-eagle` (`eagle.py`), apart so that the command
line builds its flags without importing torch. Each field's `help` is its flag's."""
from __future__ import annotations

from dataclasses import dataclass, field


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    out: str
    model: str | None = _opt(None, "the model to train a head for (a path or alias; default: SmolLM2-135M-Instruct)")
    device: str = _opt("auto", "cpu, cuda, cuda:N or auto")
    dtype: str = _opt("auto", "auto, bfloat16, float16 or float32")
    prompts: int = _opt(3000, "training prompts (JSON tasks and general instructions)")
    json_share: float = _opt(0.6, "of the prompts, the share that are JSON-schema tasks")
    max_tokens: int = _opt(256, "tokens per generated answer")
    gen_batch: int = _opt(128, "requests generated together")
    temperature: float = _opt(0.7, "for the repeats of a prompt (its first answer is greedy)")
    gen_minutes: float = _opt(2.5, "no new chunk of prompts is started after this long (0: no limit)")
    max_len: int = _opt(1536, "training sequences are cut to this many tokens")
    batch_tokens: int = _opt(16384, "tokens per training batch")
    train_minutes: float = _opt(4.0, "time budget of the training loop")
    max_steps: int = _opt(0, "training steps (0: as many as the time budget allows)")
    lr: float = _opt(3e-4, "peak learning rate (it decays over the time budget)")
    p_weight: float = _opt(0.1, "weight of the distribution loss beside the feature loss")
    noise: float = _opt(0.05, "uniform noise on the input features, relative to their RMS")
    unroll: int = _opt(1, "draft steps trained at once (EAGLE-3's training-time test; 3 costs ~2.3x a step)")
    eval_prompts: int = _opt(30, "held-out JSON tasks for the acceptance measured at the end (0: skip)")
    eagle_topk: int = _opt(4, "the acceptance check's draft tree: children per node")
    eagle_depth: int = _opt(6, "the acceptance check's draft tree: depth")
    draft_tokens: int = _opt(8, "the acceptance check's draft tree: nodes verified")
    seed: int = _opt(0, "seed of the prompts' order, the sampling and the head's initialization")
