"""Prompt files (JSON Lines) and the built-in demo prompt set."""
from __future__ import annotations

import json
from pathlib import Path

from .core.request import Request, Sampling
from .errors import PromptError

KNOWN_KEYS = {"id", "prompt", "tokens", "max_tokens", "arrival", "temperature", "top_p", "seed"}

DEMO_R2_PROMPT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result in "
    "descending order. The sort is stable: it guarantees not to change the relative order of elements that "
    "compare equal. This is helpful for sorting in multiple passes, for example sort by department, then "
    "by salary grade. Return the number of items in a container. If the object"
)
# The demo (seed 000): r1 decodes with speculative decoding (k=3: 4 verify rows)
# when r2's 154-token prompt arrives; one concurrent step packs r2's prefill with
# r1's verify rows (158 rows: gemm under threshold:4), r2 finishes in that step,
# and r1 diverges ~120 tokens later from what that step wrote into its cache.
# r3 and r4 arrive after r1 is done and stay identical.
DEMO = [
    {"id": "r1", "prompt": "The socket module provides", "arrival": 0, "max_tokens": 160},
    {"id": "r2", "prompt": DEMO_R2_PROMPT, "arrival": 2, "max_tokens": 1},
    {"id": "r3", "prompt": "Return the number of", "arrival": 120, "max_tokens": 48},
    {"id": "r4", "prompt": "Create a new", "arrival": 122, "max_tokens": 48},
]


def builtin_requests(encode, *, max_tokens: int | None = None) -> list[Request]:
    return [request_from_dict(dict(d, max_tokens=max_tokens or d["max_tokens"]), encode, f"built-in {d['id']}")
            for d in DEMO]


def load_prompts(path, encode, *, max_tokens: int | None = None) -> list[Request]:
    """Parse a JSONL prompt file; any malformed line is a PromptError naming it."""
    p = Path(path)
    if not p.exists():
        raise PromptError(f"prompt file not found: {p}")
    if p.is_dir():
        raise PromptError(f"prompt file is a directory: {p}")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptError(f"cannot read prompt file {p}: {e}") from None
    out, seen = [], set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}:{n}"
        try:
            d = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(d, dict):
            raise PromptError(f"{where}: each line must be a JSON object")
        if max_tokens is not None and "max_tokens" not in d:
            d["max_tokens"] = max_tokens
        d.setdefault("id", f"r{len(out) + 1}")
        req = request_from_dict(d, encode, where)
        if req.id in seen:
            raise PromptError(f"{where}: duplicate request id {req.id!r}")
        seen.add(req.id)
        out.append(req)
    if not out:
        raise PromptError(f"prompt file {p} holds no requests")
    return out


def request_from_dict(d: dict, encode, where: str) -> Request:
    unknown = set(d) - KNOWN_KEYS
    if unknown:
        raise PromptError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(KNOWN_KEYS))})")
    if ("prompt" in d) == ("tokens" in d):
        raise PromptError(f"{where}: give exactly one of 'prompt' (text) or 'tokens' (ids)")
    try:
        if "prompt" in d:
            if not isinstance(d["prompt"], str):
                raise PromptError(f"{where}: 'prompt' must be a string")
            tokens = tuple(encode(d["prompt"])) if d["prompt"] else ()
        else:
            if not isinstance(d["tokens"], list) or not all(isinstance(t, int) for t in d["tokens"]):
                raise PromptError(f"{where}: 'tokens' must be a list of integers")
            tokens = tuple(d["tokens"])
        sampling = Sampling(float(d.get("temperature", 0.0)), float(d.get("top_p", 1.0)), int(d.get("seed", 0)))
        if not 0.0 < sampling.top_p <= 1.0 or sampling.temperature < 0:
            raise PromptError(f"{where}: temperature must be >= 0 and top_p in (0, 1]")
        return Request(str(d["id"]), tokens, max_tokens=int(d.get("max_tokens", 64)),
                       arrival=int(d.get("arrival", 0)), sampling=sampling,
                       prompt_text=d.get("prompt"))
    except PromptError as e:
        msg = str(e)
        raise PromptError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (TypeError, ValueError) as e:
        raise PromptError(f"{where}: {e}") from None
