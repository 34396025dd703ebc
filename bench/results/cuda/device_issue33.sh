#!/bin/bash
# Issue 33 on the lent H200 (the `device` tool), from the repo root. One script for every
# call; each step runs once per warm machine (a .done file) and only when the call has time
# left for it, so later calls pick up where the last one stopped:
#   1. carry .whl-c1 (mlx + mlx-lm wheels, the first part of mlx-cuda-13), STAGE=1: saves them
#   2. carry .whl-c2 (the rest): installs, then runs the steps below in order.
# Results go to /root/res and come back as one archive in $OUT.
mkdir -p /root/res
[ "$STAGE" = 1 ] || exec > >(tee -a /root/res/log.txt) 2>&1
. bench/results/cuda/install_mlx_cuda.sh
. bench/results/cuda/device_steps.sh
MC=/root/mc; Q=$MC/qwen0.5b-random-bf16
step env.txt 20 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info().get('device_name'))"
step compile.txt 150 python3 bench/compile_decode.py --models qwen0.5b,qwen0.5b-4bit --dtypes stored --model-cache $MC --out $R/compile.json
step pytest_cuda.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
step context_bf16.txt 150 python3 bench/bench_context.py --models qwen0.5b --dtypes stored --reps 5 --model-cache $MC --out $R/context_bf16.json
step context_4bit.txt 150 python3 bench/bench_context.py --models qwen0.5b-4bit --dtypes stored --reps 5 --model-cache $MC --out $R/context_4bit.json
step profile.txt 90 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8 --no-pyinstrument --model-cache $MC --out $R/profile.json
step sdpa_choice.txt 40 bash -c "python3 bench/sdpa_kernel_choice.py; echo '-- MLX_CUDA_USE_CUDNN_SDPA=0'; MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/sdpa_kernel_choice.py"
step pytest_cuda_nocudnn.txt 100 env MLX_CUDA_USE_CUDNN_SDPA=0 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py -k "long"
step sweep_bi.json 300 python3 -m divergence sweep --model $Q -n 1000 --policy batch-invariant --json
# after the proofs' order-revealing probe (PROOF_METHOD 2): ONLY="env.txt proof_check.txt sweep_bi_v2.json pytest_cuda_v2.txt"
step proof_check.txt 60 python3 bench/proof_check.py --model qwen0.5b --model-cache $MC --out $R/proof_check.json
step sweep_bi_v2.json 240 python3 -m divergence sweep --model $Q -n 1000 --policy batch-invariant --json
step pytest_cuda_v2.txt 220 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
# round 4, mlxlm_reads as one block gather per pool (none under 256 positions):
#   ONLY="env.txt reads_check.txt kv_read_cost.txt pytest_cuda_v3.txt profile_v3.txt context_bf16_v3.txt context_4bit_v3.txt"
step reads_check.txt 60 python3 bench/sdpa_reads_check.py --trials 3 --out $R/sdpa_reads_check.json
step kv_read_cost.txt 60 python3 bench/kv_read_cost.py --reps 20 --out $R/kv_read_cost.json
step pytest_cuda_v3.txt 220 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
step profile_v3.txt 40 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8 --no-pyinstrument --model-cache $MC --out $R/profile.json
step context_bf16_v3.txt 90 python3 bench/bench_context.py --models qwen0.5b --dtypes stored --reps 5 --model-cache $MC --out $R/context_bf16.json
step context_4bit_v3.txt 130 python3 bench/bench_context.py --models qwen0.5b-4bit --dtypes stored --reps 5 --model-cache $MC --out $R/context_4bit.json
# round 4b, the block gather moves 8-byte words (kv_reads.as_words):
#   ONLY="env.txt kv_read_cost_v4.txt pytest_cuda_v4.txt profile_v4.txt context_bf16_v4.txt context_4bit_v4.txt"
step kv_read_cost_v4.txt 40 python3 bench/kv_read_cost.py --reps 20 --out $R/kv_read_cost.json
step pytest_cuda_v4.txt 220 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
step profile_v4.txt 40 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8 --no-pyinstrument --model-cache $MC --out $R/profile.json
step context_bf16_v4.txt 90 python3 bench/bench_context.py --models qwen0.5b --dtypes stored --reps 5 --model-cache $MC --out $R/context_bf16.json
step context_4bit_v4.txt 130 python3 bench/bench_context.py --models qwen0.5b-4bit --dtypes stored --reps 5 --model-cache $MC --out $R/context_4bit.json
# round 5 ran here the kept decode batch (f10868c, bench/kept_batch.py at 0546a07; reverted:
# no gain measured, see cuda/README.md) and:
step pytest_cuda_v5.txt 220 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
step profile_v5.txt 40 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8 --no-pyinstrument --model-cache $MC --out $R/profile.json
step context_bf16_v5.txt 90 python3 bench/bench_context.py --models qwen0.5b --dtypes stored --reps 5 --model-cache $MC --out $R/context_bf16.json
# where two runs of the same batch part: ONLY="env.txt repeat.txt repeat_nocudnn.txt"
step repeat.txt 60 python3 bench/repeat_check.py --models qwen0.5b --dtypes stored --points 8:1024,32:512,64:512 --model-cache $MC --out $R/repeat_check.json
step repeat_nocudnn.txt 60 env MLX_CUDA_USE_CUDNN_SDPA=0 python3 bench/repeat_check.py --models qwen0.5b --dtypes stored --points 8:1024,32:512,64:512 --model-cache $MC --out $R/repeat_check_nocudnn.json
# batched reads never span a multiple of 256 rows (prepared.batched_blocks): the new CUDA test
# before the change (patch -R) and after, then the repeat check and the CUDA tests:
#   ONLY="env.txt repeat_before.txt repeat_after.txt pytest_cuda_v6.txt"
step repeat_before.txt 60 bash -c "patch -s -R -p1 < bench/results/cuda/batched_blocks.patch && python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py -k repeatable; patch -s -p1 < bench/results/cuda/batched_blocks.patch"
step repeat_after.txt 60 python3 bench/repeat_check.py --models qwen0.5b --dtypes stored --points 8:1024,8:4096,32:512,64:512 --model-cache $MC --out $R/repeat_check.json
step pytest_cuda_v6.txt 220 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
# round 6, the decode step's graph by primitive, engine vs mlx-lm (bench/graph_nodes.py):
#   ONLY="env.txt graph_nodes.txt profile_v7.txt"
step graph_nodes.txt 120 python3 bench/graph_nodes.py --models qwen0.5b,qwen0.5b-4bit --dtypes stored --batches 1,8,32 --model-cache $MC --out $R/graph_nodes.json
step profile_v7.txt 40 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8 --no-pyinstrument --model-cache $MC --out $R/profile.json
# the same at B=32 and 64 (graph_nodes.py now takes an all-decode step):
#   ONLY="env.txt profile_v8.txt graph_nodes_v2.txt"
step profile_v8.txt 60 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 8,32,64 --no-pyinstrument --model-cache $MC --out $R/profile.json
step graph_nodes_v2.txt 120 python3 bench/graph_nodes.py --models qwen0.5b --dtypes stored --batches 8,64 --model-cache $MC --out $R/graph_nodes.json
# batch-invariant's one-row reads in the batched layout (attention.stable_reads): the repeat
# check under batch-invariant before (patch -R) and after, the CUDA tests, then the final tree's
# speed: ONLY="env.txt bi_repeat_before.txt bi_repeat_after.txt pytest_cuda_v7.txt profile_v9.txt context_bf16_v7.txt context_4bit_v7.txt"
step bi_repeat_before.txt 80 bash -c "patch -s -R -p1 < bench/results/cuda/stable_reads.patch && python3 bench/repeat_check.py --models qwen0.5b --dtypes stored --policy batch-invariant --points 8:1024,2:2048 --runs 3 --tokens 8 --model-cache $MC --out $R/repeat_check_bi_before.json; patch -s -p1 < bench/results/cuda/stable_reads.patch"
step bi_repeat_after.txt 80 python3 bench/repeat_check.py --models qwen0.5b --dtypes stored --policy batch-invariant --points 8:1024,2:2048 --runs 3 --tokens 8 --model-cache $MC --out $R/repeat_check_bi.json
step pytest_cuda_v7.txt 240 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
step profile_v9.txt 70 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 1,8,32,64 --no-pyinstrument --model-cache $MC --out $R/profile.json
step context_bf16_v7.txt 120 python3 bench/bench_context.py --models qwen0.5b --dtypes stored --reps 5 --model-cache $MC --out $R/context_bf16.json
step context_4bit_v7.txt 140 python3 bench/bench_context.py --models qwen0.5b-4bit --dtypes stored --reps 5 --model-cache $MC --out $R/context_4bit.json
# round 7, does MLX CUDA's graph batching make the engine's queue grow with B? The same profile
# under MLX's CUDA graph settings (mlx/backend/cuda/device.cpp: a graph is committed past
# MLX_MAX_OPS_PER_BUFFER nodes or MLX_MAX_MB_PER_BUFFER MB of inputs; execs cached by topology):
#   ONLY="env.txt penv_default.txt penv_mb.txt penv_nographs.txt penv_ops.txt penv_cache.txt"
P="python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 8,64 --no-pyinstrument --model-cache $MC"
step penv_default.txt 60 $P --out $R/penv_default.json
step penv_mb.txt 60 env MLX_MAX_MB_PER_BUFFER=1000000 $P --out $R/penv_mb.json
step penv_nographs.txt 60 env MLX_USE_CUDA_GRAPHS=0 $P --out $R/penv_nographs.json
step penv_ops.txt 60 env MLX_MAX_OPS_PER_BUFFER=400 $P --out $R/penv_ops.json
step penv_cache.txt 60 env MLX_CUDA_GRAPH_CACHE_SIZE=4000 $P --out $R/penv_cache.json
# where the engine's host time at B=64 goes (--runs 2), native frames (py-spy --native; its wheel carried
# in .whl-c2): ONLY="env.txt hp_engine64.txt hp_mlxlm64.txt hp_engine8.txt hp_mlxlm8.txt hp_summary.txt"
HP="python3 bench/host_profile.py --model-cache $MC --runs 2"
SPY="timeout 150 py-spy record --native --format raw -r 40 -d 60"  # (at 400 Hz native unwinding fell minutes behind)
[[ " $ONLY " != *" hp_"* ]] || [ -x /root/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /root/spy $W/py_spy-*.whl
export PATH=$PATH:/root/spy/bin
step hp_engine64.txt 60 $SPY -o $R/hp_engine64.raw -- $HP --side engine --batch 64
step hp_mlxlm64.txt 60 $SPY -o $R/hp_mlxlm64.raw -- $HP --side mlxlm --batch 64
step hp_engine8.txt 60 $SPY -o $R/hp_engine8.raw -- $HP --side engine --batch 8
step hp_mlxlm8.txt 60 $SPY -o $R/hp_mlxlm8.raw -- $HP --side mlxlm --batch 8
step hp_summary.txt 10 $HP --summarize $R/hp_engine64.raw $R/hp_mlxlm64.raw $R/hp_engine8.raw $R/hp_mlxlm8.raw --top 30
# the first run in a fresh process (an empty MLX_PTX_CACHE_DIR each): the sampler's flat
# gathers (flat_gathers.patch) against take_along_axis before them, and mlx-lm's; then the
# sampling tests on the GPU: ONLY="env.txt first_before.txt first_after.txt first_mlxlm.txt pytest_sampling.txt"
FR="python3 bench/first_run.py --model-cache $MC"
step first_before.txt 120 bash -c "patch -s -R -p1 < bench/results/cuda/flat_gathers.patch && $FR --side engine --label before; patch -s -p1 < bench/results/cuda/flat_gathers.patch"
step first_after.txt 90 $FR --side engine --label after
step first_mlxlm.txt 60 $FR --side mlxlm
step pytest_sampling.txt 60 python3 -m pytest -q -p no:cacheprovider -rA tests/engine/test_sampling.py
# the final tree's B=1 bit-for-bit tests (the sampler's flat gathers): ONLY="env.txt pytest_cuda_b1_v8.txt"
step pytest_cuda_b1_v8.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py -k b1_native_is_generate_step_bit_for_bit
# round 8, is the engine's step at B=64 GPU-bound? The queue's thread CPU time next to its wall
# time (MLX's eval sleeps once more than 10 command buffers are in flight), both sides; and the
# sampler's cost alone: ONLY="env.txt queue_cpu.txt sampler_cost.txt"
step queue_cpu.txt 90 python3 bench/profile_engine.py --models qwen0.5b --dtypes stored --batches 8,64 --tokens 24 --no-pyinstrument --model-cache $MC --out $R/queue_cpu.json
step sampler_cost.txt 60 python3 bench/sampler_cost.py --out $R/sampler_cost.json
# the queue is CPU time (round 8 above): where it grows from B=8 to 64, engine only, longer runs
# (samples counted, to compare per step): ONLY="env.txt hp2_engine8.txt hp2_engine64.txt hp2_mlxlm64.txt hp2_summary.txt"
HP2="python3 bench/host_profile.py --model-cache $MC --runs 6 --tokens 128"
SPY2="timeout 150 py-spy record --native --format raw -r 50 -d 90"
[[ " $ONLY " != *" hp2_"* ]] || [ -x /root/spy/bin/py-spy ] || python3 -m pip install -q --no-index --no-deps --target /root/spy $W/py_spy-*.whl
step hp2_engine8.txt 100 $SPY2 -o $R/hp2_engine8.raw -- $HP2 --side engine --batch 8
step hp2_engine64.txt 100 $SPY2 -o $R/hp2_engine64.raw -- $HP2 --side engine --batch 64
step hp2_mlxlm64.txt 100 $SPY2 -o $R/hp2_mlxlm64.raw -- $HP2 --side mlxlm --batch 64
step hp2_summary.txt 10 python3 bench/host_profile.py --summarize $R/hp2_engine8.raw $R/hp2_engine64.raw $R/hp2_mlxlm64.raw --top 45
# round 9, the final tree (the commit path's stats_of): B=1 bit for bit, then the goal's own metric,
# aggregate decode vs BatchGenerator at B = 1, 8, 32, 64, bf16 and 4-bit:
#   ONLY="env.txt r9_pytest_b1.txt r9_engine_bf16.txt r9_engine_4bit.txt"
step r9_pytest_b1.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py -k b1_native_is_generate_step_bit_for_bit
step r9_engine_bf16.txt 150 python3 bench/bench_engine.py --models qwen0.5b --dtypes stored --batches 1,8,32,64 --reps 5 --model-cache $MC --out $R/engine_bf16.json
step r9_engine_4bit.txt 150 python3 bench/bench_engine.py --models qwen0.5b-4bit --dtypes stored --batches 1,8,32,64 --reps 5 --model-cache $MC --out $R/engine_4bit.json
ls -la $R
tar czf $OUT/results.tgz -C $R . && ls -la $OUT
