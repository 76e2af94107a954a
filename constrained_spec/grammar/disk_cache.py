"""Compiled grammars on disk, so that a restarted server does not compile the schemas it has seen.

A compiled grammar is only valid for the vocabulary and compile options it was built with, so each
combination gets its own folder (`fingerprint`). Files are named by a hash of the normalized
grammar key, zlib-compressed (xgrammar's JSON is several MB for large vocabularies and compresses
well; zlib's checksum also catches a damaged file before xgrammar parses it), written atomically
and evicted oldest-used first past a bound. Every failure is logged and ignored: the cache can only
save a compile, never cost a request.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import os
import tempfile
import threading
import time
import zlib
from typing import Optional

log = logging.getLogger("constrained_spec.grammar")

ENV_DIR = "CONSTRAINED_SPEC_GRAMMAR_CACHE_DIR"
# a temporary file this old is a write that never finished (a crash), not one in progress
STALE_TMP_S = 3600
FORMAT = 2  # bump when the file layout or the meaning of a key changes (2: strings without lone surrogates)


def default_dir() -> str:
    return os.environ.get(ENV_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "constrained-spec",
                                                  "grammars")


def resolve_dir(option: Optional[str]) -> Optional[str]:
    """The config option as a folder: None -> the default, "none" (or "") -> disabled; the
    environment's folder is read by the same rule (`=none` made a folder named none)."""
    if option is None:
        option = os.environ.get(ENV_DIR)
        if not option:  # (set empty: as unset)
            return default_dir()
    if option.strip().lower() in ("", "none", "off"):
        return None
    return os.path.expanduser(option)


def fingerprint(tokenizer_info, vocab_size: int, **options) -> str:
    """What a compiled grammar depends on besides its own key."""
    try:
        xgr_version = importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        xgr_version = "?"
    h = hashlib.sha256()
    h.update(f"format={FORMAT};xgrammar={xgr_version};vocab={vocab_size};".encode())
    h.update(repr(sorted(options.items())).encode())
    h.update(tokenizer_info.serialize_json().encode())
    return h.hexdigest()[:24]


class DiskCache:
    def __init__(self, root: str, fingerprint: str, max_files: int = 4096, max_bytes: int = 1 << 30):
        self.dir = os.path.join(root, fingerprint)
        os.makedirs(self.dir, exist_ok=True)
        self.max_files = max_files
        self.max_bytes = max_bytes
        self._lock = threading.Lock()  # eviction scans are serialized; reads and writes are not

    @staticmethod
    def name(key) -> str:
        return hashlib.sha256(repr(key).encode()).hexdigest()[:32] + ".json.z"

    def get(self, name: str) -> Optional[str]:
        """The stored text, or None (missing, unreadable or damaged: a damaged file is deleted)."""
        path = os.path.join(self.dir, name)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("grammar cache: cannot read %s: %s", path, e)
            return None
        try:
            text = zlib.decompress(data).decode()
        except (zlib.error, UnicodeDecodeError) as e:
            log.warning("grammar cache: %s is damaged (%s); deleting it", path, e)
            self.drop(name)
            return None
        try:
            os.utime(path)  # eviction goes by last use
        except OSError:
            pass
        return text

    def put(self, name: str, text: str) -> None:
        try:
            data = zlib.compress(text.encode(), 1)
            fd, tmp = tempfile.mkstemp(dir=self.dir, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, os.path.join(self.dir, name))  # readers see all of it or nothing
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            log.warning("grammar cache: cannot write to %s: %s", self.dir, e)
            return
        self._evict()

    def drop(self, name: str) -> None:
        try:
            os.unlink(os.path.join(self.dir, name))
        except OSError:
            pass

    def _evict(self) -> None:
        with self._lock:
            try:
                entries, now = [], time.time()
                for e in os.scandir(self.dir):
                    if e.name.endswith(".json.z"):
                        st = e.stat()
                        entries.append((st.st_mtime, st.st_size, e.name))
                    elif e.name.startswith(".tmp-") and now - e.stat().st_mtime > STALE_TMP_S:
                        self.drop(e.name)  # a write a crash cut short: never read, never listed above
            except OSError as e:
                log.warning("grammar cache: cannot list %s: %s", self.dir, e)
                return
            entries.sort()
            total = sum(size for _, size, _ in entries)
            while entries and (len(entries) > self.max_files or total > self.max_bytes):
                _, size, name = entries.pop(0)
                total -= size
                self.drop(name)
