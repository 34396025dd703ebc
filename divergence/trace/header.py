"""What a trace says about its run, read from its groups and attributes: the /meta
settings, model, draft and environment, the requests, the vocabulary. Each reader checks
what it reads (a damaged trace is one TraceError naming what)."""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from ..core.request import Sampling
from . import schema as S
from . import validate, validate_header


@dataclass(frozen=True)
class TraceRequest:
    id: str
    prompt_tokens: tuple
    arrival: int
    max_tokens: int
    sampling: Sampling


def read_meta(f, path, attrs: dict) -> dict:
    """/meta's JSON attributes (settings, model, draft, environment) and the file's run attributes
    (`attrs`: the file's attributes, checked)."""
    try:
        m = f[S.META].attrs
    except Exception as e:  # noqa: BLE001  (HDF5: a damaged object header)
        raise validate.damaged(path, f"/meta cannot be read ({e})") from None
    out = {}
    for k in ("settings", "model", "draft", "environment"):
        try:
            out[k] = json.loads(m[k])
        except KeyError:
            raise validate.damaged(path, f"/meta has no attribute {k!r}") from None
        except (TypeError, ValueError) as e:
            raise validate.damaged(path, f"/meta attribute {k!r} is not JSON ({e})") from None
        except OSError as e:  # HDF5: a damaged attribute heap
            raise validate.damaged(path, f"/meta attribute {k!r} cannot be read ({e})") from None
    validate_header.meta(path, out)
    for k in ("schedule", "policy", "created", "top_k"):
        v = attrs.get(k)
        out[k] = v.item() if hasattr(v, "item") else v
    out["completed"] = validate_header.status(path, f)
    return out


def read_requests(f, path) -> list[TraceRequest]:
    """The requests /requests holds (a live run's later ones are in /live_requests)."""
    try:
        g = f[S.REQUESTS]
        raw_ids = g["id"][()]
        ids = [x.decode() if isinstance(x, bytes) else str(x) for x in raw_ids]
        off = g["prompt_offsets"][()]
        flat = g["prompt_tokens"][()]
        arr, mt = g["arrival"][()], g["max_tokens"][()]
        temp, top_p, seed = g["temperature"][()], g["top_p"][()], g["seed"][()]
    except Exception as e:  # noqa: BLE001  (a dataset missing, or not an array)
        raise validate.damaged(path, f"/requests cannot be read ({e})") from None
    n = len(ids)
    for name, a in (("prompt_offsets", off), ("prompt_tokens", flat), ("arrival", arr), ("max_tokens", mt),
                    ("temperature", temp), ("top_p", top_p), ("seed", seed)):
        want = n + 1 if name == "prompt_offsets" else None
        if getattr(a, "ndim", 0) != 1 or a.dtype.kind not in ("f" if name in ("temperature", "top_p") else "iu"):
            raise validate.damaged(path, f"/requests/{name} is not a 1-D numeric array")
        if want is not None and len(a) != want or want is None and name != "prompt_tokens" and len(a) != n:
            raise validate.damaged(path, f"/requests/{name} holds {len(a)} entries for {n} requests")
    if n and (off[0] < 0 or (np.diff(off) < 0).any() or off[-1] > len(flat)):
        raise validate.damaged(path, "/requests/prompt_offsets do not index /requests/prompt_tokens")
    validate_header.requests(path, raw_ids, off, flat, arr, mt, temp, top_p)
    return [TraceRequest(rid, tuple(int(t) for t in flat[off[i]: off[i + 1]]), int(arr[i]), int(mt[i]),
                            Sampling(float(temp[i]), float(top_p[i]), int(seed[i]))) for i, rid in enumerate(ids)]


def read_vocab(f, path) -> list[str] | None:
    """The tokenizer's pieces (/vocab), None where the trace holds none."""
    if S.VOCAB not in f:
        return None
    try:
        g = f[S.VOCAB]
        data, off, digest = g["bytes"][()], g["offsets"][()], g.attrs.get(validate_header.DIGEST)
    except Exception as e:  # noqa: BLE001
        raise validate.damaged(path, f"/vocab cannot be read ({e})") from None
    validate_header.vocab(path, data, off, digest)
    raw = data.tobytes()
    return [raw[off[i]: off[i + 1]].decode("utf-8", "replace") for i in range(len(off) - 1)]
