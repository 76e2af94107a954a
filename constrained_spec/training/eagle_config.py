"""The settings of `constrained-spec train-eagle` (`eagle.py`), apart so that the command
line builds its flags without importing torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainConfig:
    out: str
    model: str | None = None  # None: the default model (SmolLM2-135M-Instruct)
    device: str = "auto"
    dtype: str = "auto"
    prompts: int = 3000  # training prompts (JSON tasks and general instructions)
    json_share: float = 0.6  # of the prompts, the share that are JSON-schema tasks
    max_tokens: int = 256  # per answer
    gen_batch: int = 128  # requests generated together
    temperature: float = 0.7  # for the repeats of a prompt (its first answer is greedy)
    gen_minutes: float = 2.5  # no new chunk of prompts is started after this long (0: no limit)
    max_len: int = 1536  # training sequences are cut to this many tokens
    batch_tokens: int = 16384  # tokens per training batch
    train_minutes: float = 4.0  # time budget of the training loop
    max_steps: int = 0  # 0: as many as the time budget allows
    lr: float = 3e-4
    p_weight: float = 0.1  # weight of the distribution loss beside the feature loss
    noise: float = 0.05  # uniform noise on the input features, relative to their RMS
    unroll: int = 1  # draft steps trained at once (EAGLE-3's training-time test); >1 costs ~2.3x a step at 3
    eval_prompts: int = 30  # held-out JSON tasks for the acceptance measured at the end (0: skip)
    eagle_topk: int = 4
    eagle_depth: int = 6
    draft_tokens: int = 8
    seed: int = 0
