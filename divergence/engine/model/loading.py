"""Loading mlx-lm model directories, with clear errors for what we can't run."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..kernels import blas  # noqa: F401  (loads the optimized BLAS before mlx, where present)

import mlx.core as mx
import xxhash

from ...errors import ModelLoadError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


@dataclass
class LoadedModel:
    """An mlx-lm model with what the trace needs to name it exactly."""

    path: Path
    model: object  # mlx_lm Model (we use its modules and weights, not its forward)
    tokenizer: object  # mlx_lm TokenizerWrapper
    config: dict
    dtype: str
    weights_hash: str
    tokenizer_hash: str
    info: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    @property
    def context_length(self) -> int | None:
        return self.config.get("max_position_embeddings")

    def encode(self, text: str) -> list[int]:
        # verbose=False: no 'Token indices sequence length is longer than ...' warning on stderr; a
        # prompt longer than the context is refused with its own one-line error
        try:
            return list(self.tokenizer.encode(text, verbose=False))
        except TypeError:  # a tokenizer whose encode takes no `verbose`
            return list(self.tokenizer.encode(text))

    def decode(self, tokens) -> str:
        return self.tokenizer.decode(list(tokens))

    def describe(self) -> dict:
        return {
            "path": str(self.path),
            "model_type": self.config.get("model_type"),
            "dtype": self.dtype,
            "quantization": self.config.get("quantization"),
            "num_layers": self.num_layers,
            "weights_hash": self.weights_hash,
            "tokenizer_hash": self.tokenizer_hash,
            "config": self.config,
        }


def read_config(path: Path) -> dict:
    if not path.exists():
        raise ModelLoadError(f"model directory not found: {path}")
    if not path.is_dir():
        raise ModelLoadError(f"not a model directory: {path}")
    cfg = path / "config.json"
    if not cfg.exists():
        raise ModelLoadError(f"{path} has no config.json: not an mlx-lm model directory")
    try:
        config = json.loads(cfg.read_text())
    except (OSError, ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, UnicodeDecodeError
        raise ModelLoadError(f"cannot read {cfg}: {' '.join(str(e).split())[:200] or 'nested too deeply'}") from None
    if not isinstance(config, dict):
        raise ModelLoadError(f"{cfg} holds a JSON {type(config).__name__}, not an object: not an mlx-lm config")
    mt = config.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"unsupported model_type {mt!r} in {cfg} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    return config


def _hash_files(files) -> str:
    h = xxhash.xxh3_128()
    for f in sorted(files):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def load_model(path, *, dtype: str | None = None) -> LoadedModel:
    """Load a llama/mistral/qwen2/qwen3/qwen3_moe/mixtral mlx-lm directory (any dtype, or quantized)."""
    path = Path(path).expanduser()
    config = read_config(path)
    weights = sorted(path.glob("*.safetensors"))
    if not weights:
        raise ModelLoadError(f"{path} has no *.safetensors weights")
    if dtype is not None and dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local directories only; never the network
    from mlx_lm.utils import load as mlx_lm_load

    try:
        model, tokenizer = mlx_lm_load(str(path))
    except Exception as e:  # mlx-lm raises many types; name the directory and the cause
        raise ModelLoadError(f"cannot load model from {path}: {type(e).__name__}: {e}") from None
    if dtype is not None:
        model.set_dtype(DTYPES[dtype])
    actual = _model_dtype(model)
    tok_files = [p for p in path.glob("tokenizer*.json")]
    return LoadedModel(
        path=path.resolve(),
        model=model,
        tokenizer=tokenizer,
        config=config,
        dtype=actual,
        weights_hash=_hash_files(weights),
        tokenizer_hash=_hash_files(tok_files) if tok_files else "",
    )


def _model_dtype(model) -> str:
    norm = model.model.norm.weight
    return str(norm.dtype).replace("mlx.core.", "")


_CACHE: dict[tuple[str, str | None], LoadedModel] = {}


def load_cached(path, *, dtype: str | None = None) -> LoadedModel:
    """load_model, once per (directory, dtype) in this process: the one model cache that
    the runner, replay and Engine.from_settings share. A model loaded as stored is reused
    for a request of its own dtype."""
    resolved = str(Path(path).expanduser().resolve())
    m = _CACHE.get((resolved, dtype))
    if m is None and dtype is not None:
        m = _CACHE.get((resolved, None))
        if m is not None and m.dtype != dtype:
            m = None
    if m is None:
        m = load_model(path, dtype=dtype)
        _CACHE[(resolved, dtype)] = m
        _CACHE.setdefault((resolved, m.dtype), m)
    return m
