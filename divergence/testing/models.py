"""Tiny random-weight mlx-lm model directories, for tests and benchmarks.

They are real model directories (config.json, model.safetensors, tokenizer
files) loaded with mlx-lm's own loader, so the engine is checked against
mlx-lm on families the fixtures don't cover (qwen2 biases, qwen3 q/k norms).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

BASE_CONFIGS = {
    "llama": {},
    "mistral": {},
    "qwen2": {},
    "qwen3": {},
}


def make_random_model(
    path,
    *,
    model_type: str = "llama",
    hidden_size: int = 64,
    num_layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int | None = None,
    tie: bool = True,
    dtype: str = "bfloat16",
    seed: int = 0,
    tokenizer_from=None,
    max_position_embeddings: int = 2048,
    quantize_bits: int | None = None,
) -> Path:
    """Write a random mlx-lm model directory; the tokenizer is copied from `tokenizer_from`
    (a model directory; default: the embedded fixture target)."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes, save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    src = Path(tokenizer_from) if tokenizer_from else _fixture_target()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / name).exists():
            shutil.copy(src / name, path / name)
    if vocab_size is None:
        vocab_size = json.loads((src / "config.json").read_text())["vocab_size"]
    config = {
        "model_type": model_type,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate_size,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden_size // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "torch_dtype": dtype,
    }
    mx.random.seed(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    # Larger-than-init scales so logits spread out and tokens vary.
    params = tree_flatten(model.parameters())
    new = []
    for i, (k, v) in enumerate(params):
        if k.endswith("norm.weight"):
            new.append((k, mx.ones_like(v) + 0.1 * mx.random.normal(v.shape, key=mx.random.key(seed * 1000 + i))))
        else:
            new.append((k, 0.08 * mx.random.normal(v.shape, key=mx.random.key(seed * 1000 + i))))
    model.load_weights(new)
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    mx.eval(model.parameters())
    save_model(path, model, donate_model=False)
    save_config(config, config_path=path / "config.json")
    return path


def _fixture_target() -> Path:
    from divergence.fixtures import TARGET

    return TARGET
