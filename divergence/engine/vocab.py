"""The vocabulary as traces store it: each token id decoded alone, so that readers need no
tokenizer. Decoding a large vocabulary is a visible part of a traced process's start-up,
paid before its first step; the pieces depend only on the tokenizer's files, so they are
kept in the user cache dir under a digest of those files, and a later process reads them
back (a JSON list, cheaper to read than to decode). With DIVERGENCE_PROOF_CACHE=off,
or where the cache cannot be read or written, they are decoded as before."""
from __future__ import annotations

import json
from pathlib import Path

import xxhash

from ..core.atomic import write_atomic
from .kernels.backend_proofs import cache_dir, cache_off
from .model.loading import LoadedModel

METHOD = "decode-each-1"  # bump when the way pieces are made changes: old entries are then not read
# the files a tokenizer is made from (Hugging Face and tiktoken layouts)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model")


def pieces(loaded: LoadedModel, n: int) -> list[str]:
    """Token ids 0..n-1 each decoded alone: from the cache when this tokenizer's are there."""
    path = _cache_file(loaded, n)
    if path is not None:
        try:
            got = json.loads(path.read_text(encoding="utf-8"))
            if isinstance(got, list) and len(got) == n and all(isinstance(p, str) for p in got[:64]):
                return got
        except (OSError, ValueError):
            pass  # none yet, or unreadable: decode again
    out = decode_each(loaded, n)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, json.dumps(out))  # (ASCII escapes: lone surrogates survive)
        except OSError:  # a read-only home or a full disk: decoded each time
            pass
    return out


def _cache_file(loaded: LoadedModel, n: int) -> Path | None:
    if cache_off():
        return None
    root = Path(loaded.path) if getattr(loaded, "path", None) else None
    files = [root / f for f in TOKENIZER_FILES if root is not None and (root / f).is_file()]
    if not files:
        return None  # a tokenizer not made from files here: nothing to key it on
    h = xxhash.xxh3_64(f"{METHOD}:{n}".encode())
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return cache_dir() / f"vocab-{h.hexdigest()}.json"


def decode_each(loaded: LoadedModel, n: int) -> list[str]:
    """Each token id decoded alone: the tokenizers backend in one batch call (one trip into
    Rust instead of one per id), if it agrees with the wrapper's own decode on a spread of
    ids and the last ones (special tokens); else id by id."""
    hf = getattr(loaded.tokenizer, "_tokenizer", None)
    backend = getattr(hf, "backend_tokenizer", None) or getattr(hf, "_tokenizer", None)
    if hasattr(backend, "decode_batch"):
        try:
            out = backend.decode_batch([[i] for i in range(n)], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - any backend quirk: decode id by id
            out = None
        sample = set(range(0, n, max(1, n // 256))) | set(range(max(0, n - 64), n))
        if out is not None and len(out) == n and all(out[i] == loaded.decode([i]) for i in sample):
            return list(out)
    return [loaded.decode([i]) for i in range(n)]
