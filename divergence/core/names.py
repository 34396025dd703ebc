"""The name tables, in one place: trace/schema.py stores them as code tables, the
engine, the scheduler, the policies and the analysis read them from here."""
from __future__ import annotations

# Phases of a sequence slice inside one packed step.
PREFILL = "prefill"
DECODE = "decode"
VERIFY = "verify"  # target scores k draft proposals + 1 (k+1 rows)
DRAFT = "draft"  # the draft model proposes (its own forward pass)
PHASES = (PREFILL, DECODE, VERIFY, DRAFT)

# Which model ran a forward pass.
TARGET = "target"
DRAFT_MODEL = "draft"
MODELS = (TARGET, DRAFT_MODEL)

# How a generated token came to be (TokenEvent.spec).
SPEC_NONE = 0  # plain decoding, no draft involved
SPEC_ACCEPTED = 1  # a draft proposal the target accepted
SPEC_CORRECTED = 2  # the target's own token after a rejection, or the bonus token

# Linear ops that go through kernel dispatch, in forward order.
LINEAR_OPS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
# Mixture-of-experts layers: the router `gate` (a linear op, dispatched like the others) and
# `experts`, the selected experts' SwiGLU matmuls (one kernel record per expert and step).
GATE = "gate"
EXPERTS = "experts"
MOE_OPS = (GATE, EXPERTS)
# Attention (SDPA over the paged cache) is a dispatched, recorded op too.
ATTENTION = "attention"
FORCIBLE_OPS = LINEAR_OPS + MOE_OPS + (ATTENTION,)  # ops replay can force one by one (STEP:OP=KERNEL)
OPS = LINEAR_OPS + MOE_OPS + (ATTENTION,)  # appended, never reordered: traces store their codes

# Kernels of the linear ops.
NATIVE = "native"
GEMV = "gemv"
GEMM = "gemm"
BATCH_INVARIANT = "batch-invariant"
# Kernels of attention: each sequence its own SDPA call, or every decode / verify slice
# of a step in one masked SDPA call over padded K/V (as batched engines do), or every
# slice of the step, prefill included, in one call right-padded to the longest and always
# masked (mlx-lm BatchGenerator's calls: a replay of its traces makes them).
PER_SEQ = "per-seq"
BATCHED = "batched"
PADDED = "padded"
ATTENTION_KERNELS = (PER_SEQ, BATCHED, PADDED)
KERNELS = (NATIVE, GEMV, GEMM, BATCH_INVARIANT) + ATTENTION_KERNELS  # append only, as OPS

# How tensor parallelism would shard a linear op (mlx-lm's shard_linear modes); None = replicated.
ALL_TO_SHARDED = "all-to-sharded"
SHARDED_TO_ALL = "sharded-to-all"
# The tensor-parallel mode of each linear op of a dense decoder layer, as mlx-lm shards them.
TP_SHARDING = {"q_proj": ALL_TO_SHARDED, "k_proj": ALL_TO_SHARDED, "v_proj": ALL_TO_SHARDED,
               "o_proj": SHARDED_TO_ALL, "gate_proj": ALL_TO_SHARDED, "up_proj": ALL_TO_SHARDED,
               "down_proj": SHARDED_TO_ALL}

# Points of the forward where an optional tap sees the rows an op produced, in forward
# order ([T, ...] in slice order; the last two see only the logit rows). Layer-level
# points carry their layer; "norm" and "lm_head" carry num_layers.
TAP_POINTS = (
    "input_layernorm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "q_rope", "k_rope", ATTENTION,
    "o_proj", "attn_residual", "post_attention_layernorm", "gate_proj", "up_proj", "swiglu", "down_proj",
    "mlp_residual", "norm", "lm_head",
)

# Schedules: serial (one request at a time), concurrent (continuous batching), and
# warm (serial on a prefix cache pre-filled by a batched warm-up of the same prompts).
SERIAL = "serial"
CONCURRENT = "concurrent"
WARM = "warm"
BASE_SCHEDULES = (SERIAL, CONCURRENT)  # what a Scheduler runs directly
SCHEDULES = (SERIAL, CONCURRENT, WARM)  # what a run may ask for

# Ids of the requests that pre-fill the prefix cache in the `warm` schedule.
WARMUP_PREFIX = "warmup/"

# Lifecycle events of a request ("cancelled": a live server's client went away mid-request).
REQUEST_EVENTS = ("arrived", "finished", "error", "cancelled")

# Record kinds of the recording contract another engine follows (divergence.record,
# `divergence import`, docs/recording.md), in the order a step's records come.
RECORD_KINDS = ("run", "request", "step", "kernel", "kv_write", "token", "finish")

# the collective backends an all-reduce ran on (tensor parallelism: divergence.parallel).
TP_BACKENDS = ("ring", "mpi", "nccl", "jaccl", "single")

# What a sampler's uniform draw was for (index = the engine's purpose number).
DRAW_PURPOSES = ("sample", "accept", "residual", "draft")

# What a trace's top-k values are (settings.topk_values): raw logits (divergence's engine)
# or log-probs, logits - logsumexp (mlx-lm's BatchGenerator; a replay of its traces too).
LOGITS = "logits"
LOGPROBS = "logprobs"
TOPK_VALUES = (LOGITS, LOGPROBS)

# Other engines whose traces the engine can re-execute: mlx-lm's BatchGenerator, traced
# through divergence.workloads.mlxlm_batch (replay runs its step plans with its prefill layout).
BATCH_GENERATOR = "mlx-lm BatchGenerator"
REPLAYABLE_ENGINES = (BATCH_GENERATOR,)
