"""Which kernel MLX CUDA's one-row SDPA runs, and why its numbers follow the K/V's buffer.

Read in MLX's source (scaled_dot_product_attention.cpp, use_cudnn_for_decoding; the 0.32.4
wheel has the same tests in its binary): a query of one row over >= 256 keys, with no array
mask, runs cuDNN over the *whole* K/V buffer (T = strides(1) / strides(2) rows, a padding
mask at the real length) when K and V were computed in this eval, T is a multiple of 256
and the allocator's size of the buffer is exactly T rows; otherwise MLX's own vector kernel
(1 pass to 1024 keys, 2 passes of 32 blocks above), whose numbers do not depend on layout.
The allocator hands out cached buffers up to a page larger than asked, so which kernel
runs can follow the process's allocation history, on the engine's side and on mlx-lm's.
That is the lead for the 1-ulp differences past 256 positions that tests/test_cuda.py's
long-context test still xfails on.

Each line prints whether two ways of presenting the same K/V give the same numbers, and
what this reading predicts. Run it on the GPU, then with MLX_CUDA_USE_CUDNN_SDPA=0 (every
line should then be True and the offset line's difference 0):

    python bench/sdpa_kernel_choice.py
    MLX_CUDA_USE_CUDNN_SDPA=0 python bench/sdpa_kernel_choice.py
"""
import mlx.core as mx

sdpa = mx.fast.scaled_dot_product_attention
L, CAP, PAGE_ELEMS = 300, 512, 8192  # keys, mlx-lm's buffer rows at L, one 16 KiB page of bf16
mx.random.seed(0)


def rand(*shape):
    return mx.random.normal(shape).astype(mx.bfloat16)


def in_buffer(x, rows, start=0):
    """x as rows start..start+L of a `rows`-row buffer (as mlx-lm's KVCache returns it), built in this eval."""
    return mx.pad(x, [(0, 0), (0, 0), (start, rows - L - start), (0, 0)])[:, :, start : start + L]


def run(q, k, v, **kw):
    out = sdpa(q, k, v, scale=0.125, **kw)
    mx.eval(out)
    return out


def same(a, b) -> bool:
    return mx.array_equal(a, b).item()


k, v, q = rand(1, 2, L, 64), rand(1, 2, L, 64), rand(1, 14, 1, 64)
mx.eval(k, v, q)
vector = run(q, k, v)  # contiguous, T = L (not a multiple of 256): the vector kernel
cudnn = run(q, in_buffer(k, CAP), in_buffer(v, CAP))  # an exact 512-row buffer: cuDNN
print("vector kernel == cuDNN (predicted False with cuDNN on):", same(vector, cudnn))

mx.clear_cache()  # leave two 9-page buffers in the cache: the next 8-page ask may get one
spare = [mx.zeros((9 * PAGE_ELEMS,), mx.bfloat16) for _ in "kv"]
mx.eval(spare)
del spare
a = run(q, in_buffer(k, CAP), in_buffer(v, CAP))
print("buffer a page larger -> vector kernel (predicted True):", same(a, vector), "| cuDNN:", same(a, cudnn))

mx.clear_cache()
kb, vb = in_buffer(k, CAP), in_buffer(v, CAP)
mx.eval(kb, vb)  # evaluated earlier: 'available', not 'evaluated' in this eval
print("K/V evaluated before -> vector kernel (predicted True):", same(run(q, kb, vb), vector))

q_mlxlm = q.reshape(1, 1, 14, 64).transpose(0, 2, 1, 3)  # mlx-lm's q strides (H*hd, hd, H*hd, 1)
print("q with mlx-lm's strides == cuDNN (False: q's strides change its numbers):",
      same(run(q_mlxlm, in_buffer(k, CAP), in_buffer(v, CAP)), cudnn))
print("768-row buffer == 512-row buffer (predicted False: cuDNN's numbers follow T):",
      same(run(q, in_buffer(k, 768), in_buffer(v, 768)), cudnn))
print("mask='causal' == no mask:", same(run(q, in_buffer(k, CAP), in_buffer(v, CAP), mask="causal"), cudnn))
d = run(q, in_buffer(k, CAP, 100), in_buffer(v, CAP, 100))
print("slice from row 100 == vector kernel:", same(d, vector), "max |diff|", mx.abs(d - vector).max().item(),
      "(MLX's unslice_kv takes a byte offset for elements: a large diff or a fault is its bug)")
