"""The one rule of which TP degrees a model can be split into (stdlib only): the CLI
applies it to config.json before starting ranks, each rank to the weights it loaded."""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import TensorParallelError


@dataclass(frozen=True)
class ShardShape:
    """What sharding divides: heads (q, k/v), the MLP's features, and the
    quantization group the o/down inputs' slices must stay multiples of."""

    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    experts: bool = False
    quant_group: int = 0  # 0: not quantized

    @classmethod
    def of_config(cls, cfg: dict) -> "ShardShape | None":
        """From a model's config.json (None when it lacks the numbers: the ranks say why)."""
        heads = cfg.get("num_attention_heads")
        hidden = cfg.get("hidden_size")
        inter = cfg.get("intermediate_size")
        if not all(isinstance(v, int) and v > 0 for v in (heads, hidden, inter)):
            return None
        kv = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or hidden // heads
        experts = bool(cfg.get("num_experts") or cfg.get("num_local_experts"))
        q = cfg.get("quantization") or {}
        return cls(heads, kv, head_dim, inter, experts, int(q.get("group_size") or 0) if isinstance(q, dict) else 0)


def check_degree(shape: ShardShape, size: int, where: str = "the model") -> None:
    """Raise TensorParallelError with the one reason `shape` can't be split `size` ways."""
    if size < 1:
        raise TensorParallelError(f"--tp must be >= 1, got {size}")
    if size == 1:
        return
    if shape.experts:
        raise TensorParallelError(f"--tp {size}: mixture-of-experts layers are not sharded (dense models only)")
    for what, n in (("attention heads", shape.heads), ("KV heads", shape.kv_heads),
                    ("MLP features", shape.intermediate)):
        if n % size:
            raise TensorParallelError(f"--tp {size} does not divide the {n} {what} of {where}")
    g = shape.quant_group
    for name, k in (("o_proj", shape.heads * shape.head_dim), ("down_proj", shape.intermediate)):
        if g and (k // size) % g:
            raise TensorParallelError(f"--tp {size}: {name}'s {k} inputs split {size} ways are not a "
                                      f"multiple of the quantization group ({g})")
