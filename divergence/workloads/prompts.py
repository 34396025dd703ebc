"""Prompt files (JSON Lines) and the built-in demo prompt set."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ..core.jsonl import MAX_FILE_BYTES, read_lines
from ..core.request import Request, Sampling, engine_seed
from ..errors import PromptError

KNOWN_KEYS = {"id", "prompt", "tokens", "max_tokens", "arrival", "temperature", "top_p", "seed"}

DEMO_R2_PROMPT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result in "
    "descending order. The sort is stable: it guarantees not to change the relative order of elements that "
    "compare equal. This is helpful for sorting in multiple passes, for example sort by department, then "
    "by salary grade. Return the number of items in a container. If the object"
)
# The demo: r1 decodes with speculative decoding (k=3: 4 verify rows)
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


def builtin_requests(encode, *, max_tokens: int | None = None, sampling: dict | None = None) -> list[Request]:
    return [request_from_dict({**(sampling or {}), **d, "max_tokens": max_tokens or d["max_tokens"]}, encode,
                              f"built-in {d['id']}")
            for d in DEMO]


SAMPLING_KEYS = ("temperature", "top_p", "seed")


def sampling_defaults(*, temperature=None, top_p=None, seed=None) -> dict:
    """The command line's sampling defaults (--temperature, --top-p, --seed), checked as a prompt
    line's own keys are: {key: value} of those given, for every line that doesn't set its own."""
    out = {}
    for flag, key, v in (("--temperature", "temperature", temperature), ("--top-p", "top_p", top_p)):
        if v is None:
            continue
        if not math.isfinite(v):
            raise PromptError(f"{flag} must be a finite number, got {v}")
        out[key] = float(v)
    if out.get("temperature", 0.0) < 0:
        raise PromptError(f"--temperature must be >= 0, got {temperature}")
    if "top_p" in out and not 0.0 < out["top_p"] <= 1.0:
        raise PromptError(f"--top-p must be in (0, 1], got {top_p}")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise PromptError(f"--seed must be an integer, got {seed}")
        out["seed"] = seed  # any integer: engine_seed maps it (a prompt line's own seed too)
    return out


MAX_PROMPT_FILE_BYTES = MAX_FILE_BYTES  # a prompt file larger than this is refused, not read into memory
MAX_ID_CHARS = 256
INT32_MAX = 2**31 - 1  # max_tokens and arrival are int32 in a trace


def load_prompts(path, encode, *, max_tokens: int | None = None, sampling: dict | None = None) -> list[Request]:
    """Parse a JSONL prompt file; any malformed line is a PromptError naming it (file:line) and the field.
    sampling: defaults (sampling_defaults) for the lines that don't set temperature, top_p or seed."""
    p = Path(path)
    out, seen = [], set()
    for _, where, d in read_lines(p, PromptError, "prompt file", MAX_PROMPT_FILE_BYTES):
        if not isinstance(d, dict):
            raise PromptError(f"{where}: each line must be a JSON object")
        if max_tokens is not None and "max_tokens" not in d:
            d["max_tokens"] = max_tokens
        for k, v in (sampling or {}).items():
            d.setdefault(k, v)
        d.setdefault("id", f"r{len(out) + 1}")
        req = request_from_dict(d, encode, where)
        if req.id in seen:
            raise PromptError(f"{where}: duplicate request id {req.id!r}")
        seen.add(req.id)
        out.append(req)
    if not out:
        raise PromptError(f"prompt file {p} holds no requests")
    return out


def _int(d: dict, key: str, default: int, lo: int, hi: int) -> int:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PromptError(f"{key!r} must be an integer, got {_show(v)}")
    if not lo <= v <= hi:
        raise PromptError(f"{key!r} must be in {lo}..{hi}, got {_show(v)}")
    return v


def _seed(d: dict) -> int:
    """'seed': any integer, mapped to the engine's seed space (core.request.engine_seed)."""
    v = d.get("seed", 0)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PromptError(f"'seed' must be an integer, got {_show(v)}")
    return engine_seed(v)


def _number(d: dict, key: str, default: float) -> float:
    v = d.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise PromptError(f"{key!r} must be a number, got {_show(v)}")
    try:
        f = float(v)
    except OverflowError:
        f = math.inf
    if not math.isfinite(f):
        raise PromptError(f"{key!r} must be a finite number, got {_show(v)}")
    return f


def _text(v, key: str) -> str:
    """Any JSON string that is text (NUL and other control characters included); a lone
    surrogate (\ud800-\udfff alone) is not text: no tokenizer encodes it."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptError(f"{key!r} holds a lone surrogate (\\ud800-\\udfff), which is not text") from None
    return v


def _id(v) -> str:
    if isinstance(v, bool) or not isinstance(v, (str, int)):
        raise PromptError(f"'id' must be a string (or an integer), got {_show(v)}")
    s = _text(str(v), "id")
    if "\x00" in s:  # (a trace stores ids as HDF5 strings, which end at a NUL)
        raise PromptError("'id' holds a NUL character")
    if not s.strip():
        raise PromptError("'id' must not be empty")
    if len(s) > MAX_ID_CHARS:
        raise PromptError(f"'id' is {len(s)} characters long; at most {MAX_ID_CHARS}")
    return s


def _show(v) -> str:
    text = json.dumps(v) if not isinstance(v, float) else repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def request_from_dict(d: dict, encode, where: str) -> Request:
    unknown = set(d) - KNOWN_KEYS
    if unknown:
        raise PromptError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {', '.join(sorted(KNOWN_KEYS))})")
    if ("prompt" in d) == ("tokens" in d):
        raise PromptError(f"{where}: give exactly one of 'prompt' (text) or 'tokens' (ids)")
    try:
        rid = _id(d["id"])
        if "prompt" in d:
            if not isinstance(d["prompt"], str):
                raise PromptError(f"'prompt' must be a string, got {_show(d['prompt'])}")
            tokens = tuple(encode(_text(d["prompt"], "prompt"))) if d["prompt"] else ()
        else:
            toks = d["tokens"]
            if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
                raise PromptError(f"'tokens' must be a list of integers, got {_show(toks)}")
            if any(not 0 <= t <= INT32_MAX for t in toks):
                bad = next(t for t in toks if not 0 <= t <= INT32_MAX)
                raise PromptError(f"'tokens' holds {_show(bad)}, not a token id (0..{INT32_MAX})")
            tokens = tuple(toks)
        sampling = Sampling(_number(d, "temperature", 0.0), _number(d, "top_p", 1.0), _seed(d))
        if sampling.temperature < 0:
            raise PromptError(f"'temperature' must be >= 0, got {_show(d['temperature'])}")
        if not 0.0 < sampling.top_p <= 1.0:
            raise PromptError(f"'top_p' must be in (0, 1], got {_show(d['top_p'])}")
        return Request(rid, tokens, max_tokens=_int(d, "max_tokens", 64, 1, INT32_MAX),
                       arrival=_int(d, "arrival", 0, 0, INT32_MAX), sampling=sampling,
                       prompt_text=d.get("prompt"))
    except PromptError as e:
        msg = str(e)
        raise PromptError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (TypeError, ValueError) as e:
        raise PromptError(f"{where}: {e}") from None
