"""StepRotation stands in for mx.fast.rope's CPU fallback: the same bits, or not used at all."""
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import rope_utils

from divergence.engine.model.rotary import StepRotation, fallback_in_use, shared_rope

pytestmark = pytest.mark.skipif(not fallback_in_use(), reason="StepRotation is only used on the CPU stream")

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def _ropes():
    yield "plain", nn.RoPE(64, base=10000.0), 64
    yield "scaled", nn.RoPE(64, base=1e6, scale=0.25), 64
    yield "partial", nn.RoPE(32, base=10000.0), 80  # rotary dims < head dim (phi-style)
    yield "llama3", rope_utils.Llama3RoPE(64, base=500000.0, scaling_config=LLAMA3), 64


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name,rope,hd", list(_ropes()), ids=[r[0] for r in _ropes()])
@pytest.mark.parametrize("positions", [[0], [7], [0, 1, 2, 3], [5, 900, 31000, 17, 2047, 3, 64, 129]],
                         ids=["p0", "p7", "prefill4", "decode8"])
def test_rotation_is_the_fallback_bit_for_bit(name, rope, hd, dtype, positions):
    rng = np.random.default_rng(len(positions) + hd)
    pos = mx.array(positions, dtype=mx.int32)
    rot = StepRotation(rope, pos, dtype, hd)
    for heads in (4, 2):  # q and k of one layer share the rotation
        x = mx.array(rng.standard_normal((len(positions), heads, 1, hd)).astype(np.float32)).astype(dtype)
        want = rope(x, offset=pos) if len(positions) > 1 else rope(x, offset=positions[0])
        got = rot.rotate(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(np.array(got.astype(mx.float32)).view(np.uint32),
                              np.array(want.astype(mx.float32)).view(np.uint32)), name


def test_a_wrong_rotation_would_be_seen():
    """The control: positions off by one give other bits, so the comparison above can fail."""
    rope = nn.RoPE(64)
    x = mx.array(np.random.default_rng(0).standard_normal((3, 2, 1, 64)).astype(np.float32))
    got = StepRotation(rope, mx.array([4, 5, 6], dtype=mx.int32), mx.float32, 64).rotate(x)
    assert not np.array_equal(np.array(got), np.array(rope(x, offset=mx.array([3, 4, 5], dtype=mx.int32))))


def test_shared_only_when_every_layer_is_a_plain_rope_alike():
    assert shared_rope([nn.RoPE(64), nn.RoPE(64)]) is not None
    assert shared_rope([nn.RoPE(64), nn.RoPE(64, base=1e6)]) is None  # layers differ
    assert shared_rope([nn.RoPE(64, traditional=True)] * 2) is None  # interleaved pairs: not rebuilt here
    yarn = rope_utils.YarnRoPE(64)  # scales x by mscale around the rope call
    assert shared_rope([yarn, yarn]) is None
    ntk = rope_utils.DynamicNTKScalingRoPE(64, 2048, False, 10000.0, 2.0)  # base depends on the offset
    assert shared_rope([ntk, ntk]) is None


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["fp32", "bf16"])
def test_signed_zeros_come_out_as_the_fallbacks(dtype):
    """The full-width form negates sin: with zeros in x and sin(0) = +0 at position 0, every
    zero must keep the fallback's sign (compared as bits)."""
    rope = nn.RoPE(8)
    x = np.random.default_rng(2).standard_normal((3, 2, 1, 8)).astype(np.float32)
    x[:, :, :, ::3] = 0.0
    x[:, 1, :, 1::3] = -0.0
    x = mx.array(x).astype(dtype)
    pos = mx.array([0, 1, 5], dtype=mx.int32)
    got, want = StepRotation(rope, pos, dtype, 8).rotate(x), rope(x, offset=pos)
    assert np.array_equal(np.array(got.astype(mx.float32)).view(np.uint32),
                          np.array(want.astype(mx.float32)).view(np.uint32))
