"""Tiny random-weight mlx-lm model directories, for tests and benchmarks.

They are real model directories (config.json, model.safetensors, tokenizer
files) loaded with mlx-lm's own loader, so the engine is checked against
mlx-lm on families the fixtures don't cover (qwen2 biases, qwen3 q/k norms,
qwen3_moe / mixtral experts).
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
    "qwen3_moe": {"decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True},
    "mixtral": {},
}
MOE_TYPES = ("qwen3_moe", "mixtral")


# llama config keys that give other RoPE modules (engine/model/rotary.py stands in for the plain
# ones on the CPU): for make_random_model's extra_config
ROPE_VARIANTS = {
    "llama3-scaling": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 256}},
    "linear-scaling": {"rope_scaling": {"type": "linear", "factor": 2.0}},
    "traditional": {"rope_traditional": True},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}},
    "dynamic-ntk": {"rope_scaling": {"type": "dynamic", "factor": 2.0}},
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
    num_experts: int = 8,
    experts_per_token: int = 2,
    moe_intermediate_size: int | None = None,
    planted_tie: tuple | None = None,
    extra_config: dict | None = None,
) -> Path:
    """Write a random mlx-lm model directory; the tokenizer is copied from `tokenizer_from`
    (a model directory; default: the embedded fixture target). MoE families get
    `num_experts` experts, `experts_per_token` of them per token; `planted_tie`
    = (layer, eps) makes that layer's router rows equal up to eps * noise, so its gate
    values stay near-tied on every token (routing flips at the kernels' rounding).
    `extra_config`: more config.json keys (e.g. a `rope_scaling`), over the defaults."""
    import mlx.core as mx  # (lazy: loads MLX)
    import mlx.nn as nn  # (lazy: loads MLX)
    from mlx.utils import tree_flatten  # (lazy: loads MLX)
    from mlx_lm.utils import _get_classes, save_config, save_model  # (lazy: loads MLX)

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
        **BASE_CONFIGS.get(model_type, {}),
    }
    if model_type == "qwen3_moe":
        config.update(num_experts=num_experts, num_experts_per_tok=experts_per_token,
                      moe_intermediate_size=moe_intermediate_size or intermediate_size)
    elif model_type == "mixtral":
        config.update(num_local_experts=num_experts, num_experts_per_tok=experts_per_token)
    config.update(extra_config or {})
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
    if planted_tie is not None:
        new = _plant_tie(new, planted_tie, seed)
    model.load_weights(new)
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits and hasattr(model, "quant_predicate"):
        # as `mlx_lm.convert -q` does: the family's own predicate (qwen3_moe: the router at 8 bits)
        from mlx_lm.utils import quantize_model  # (lazy: loads MLX)

        model, config = quantize_model(model, config, group_size=32, bits=quantize_bits)
    elif quantize_bits:
        nn.quantize(model, group_size=32, bits=quantize_bits)
        config["quantization"] = {"group_size": 32, "bits": quantize_bits}
    mx.eval(model.parameters())
    save_model(path, model, donate_model=False)
    save_config(config, config_path=path / "config.json")
    return path


def _plant_tie(params: list, tie: tuple, seed: int) -> list:
    """Every router row of one layer = row 0 + eps * its own noise: all gate values of a
    token near-tied, so the top-k is decided at the level of the kernels' rounding."""
    import mlx.core as mx  # (lazy: loads MLX)

    layer, eps = tie
    out = []
    for k, v in params:
        if k.endswith(f"layers.{layer}.mlp.gate.weight") or k.endswith(f"layers.{layer}.block_sparse_moe.gate.weight"):
            noise = mx.random.normal(v.shape, key=mx.random.key(seed + 99))
            v = v[0:1] + eps * noise
        out.append((k, v))
    return out


def _fixture_target() -> Path:
    return fixture_dirs()[0]


def fixture_dirs() -> tuple[Path, Path]:
    """(target, draft): the embedded fixture models of the installed package, or the repo's
    fixtures/ folder in a source tree on PYTHONPATH (no install: no divergence.fixtures)."""
    try:
        from divergence.fixtures import DRAFT, TARGET  # (lazy: an installed package's; absent in a bare tree)
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / "fixtures"
        return root / "target", root / "draft"
    return Path(TARGET), Path(DRAFT)
