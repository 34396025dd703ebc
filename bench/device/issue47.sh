#!/bin/bash
# Issue 47 on the lent H200 (the `run` tool), from the repo root. One script for every call;
# each step runs once per warm machine (a .done file) and only while the call has time left
# for it, so a later call picks up where the last one stopped:
#   1. carry .whl-c1 (mlx + mlx-lm wheels, mlx-cuda-13's first part) with STAGE=1: saves them;
#   2. at once (the machine goes back after 30 s idle) carry .whl-c2 (the rest): installs MLX
#      CUDA into /root/site, then runs the steps below in order;
#   3. again, carrying nothing, for the steps left. ONLY="a b" runs just those steps.
# Results go to /root/res and come back as one archive, $OUT/res.tgz, at the end of every call.
# The wheels: pip download --no-deps --python-version 3.12 --platform manylinux_2_35_x86_64
#   --only-binary=:all: mlx-cuda-13==0.32.4 mlx==0.32.4 mlx-lm==0.32.2, the 90 MB mlx-cuda-13
#   wheel `split -b 45M -d` into cudapart.00 (in .whl-c1) and cudapart.01 (in .whl-c2).
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/root/whl R=/root/res MC=/root/mc
mkdir -p $W $R
cp -f .whl-c1/* .whl-c2/* $W/ 2>/dev/null
[ "$STAGE" = 1 ] && { ls -la $W; exit 0; }
exec > >(tee -a $R/log.txt) 2>&1
if [ ! -f /root/site/.done ]; then
  cat $W/cudapart.* > $W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \
    $W/*.whl && touch /root/site/.done || exit 4
fi
[ -e divergence/fixtures ] || ln -sfn ../fixtures divergence/fixtures
export PYTHONPATH=$PWD:/root/site
LIMIT=${LIMIT:-570}

# step NAME MIN_SECONDS_LEFT CMD...: CMD once per warm machine, stdout and stderr to $R/NAME
step() {
  local name=$1 need=$2; shift 2
  [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]] && return
  [ -f $R/$name.done ] && { echo "== $name: done earlier"; return; }
  [ $((LIMIT - SECONDS)) -lt $need ] && { echo "== $name: skipped ($((LIMIT - SECONDS))s left)"; return; }
  echo "== $name ($(date +%T), $((LIMIT - SECONDS))s left): $*"
  local t0=$SECONDS
  timeout $((LIMIT - SECONDS - 15)) "$@" > $R/$name.tmp 2>&1; local rc=$?
  mv $R/$name.tmp $R/$name; echo "== $name rc=$rc in $((SECONDS - t0))s"; tail -3 $R/$name
  [ $rc -le 1 ] && [ -s $R/$name ] && touch $R/$name.done
}
pack() { (cd /root && tar czf $OUT/res.tgz res); }
trap pack EXIT

PY=python3
CD="$PY bench/compile_decode.py --model-cache $MC --dtypes stored --batches 1,8,32,64 --tokens 64 --reps 5"
step env.txt 20 $PY -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info().get('device_name'))"
# (1) compiled vs eager bits, op by op: the fixtures (every test of the file, the compiled sampler's
#     too: sampling.compiled_sampler() may default to on for MLX CUDA once it passes there), then
#     the 0.5B shape
step pytest_compiled.txt 150 $PY -m pytest -q -p no:cacheprovider -rA tests/engine/test_compiled_step.py
step pytest_cuda_compiled.txt 150 $PY -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py -k "compiled or b1_native_is_generate"
# (2) decode by B: compiled vs eager vs mlx-lm, bf16 and 4-bit
step compile_bf16.txt 120 $CD --models qwen0.5b --out $R/compile_decode_bf16.json
step compile_4bit.txt 120 $CD --models qwen0.5b-4bit --out $R/compile_decode_4bit.json
# (3) serve's time to first token: does a new prompt length compile kernels?
step shapes_engine.txt 60 $PY bench/device/prefill_shapes.py --side engine --model-cache $MC
step shapes_mlxlm.txt 60 $PY bench/device/prefill_shapes.py --side mlxlm --model-cache $MC
step shapes_engine_packed.txt 60 $PY bench/device/prefill_shapes.py --side engine --packed 4 --model-cache $MC
step serve.txt 240 env DIVERGENCE_COMPILED_STEP=1 $PY bench/bench_serve.py --target qwen0.5b --modes plain --requests 32 --concurrency 8 --max-tokens 64 --reps 2 --warmup 16 --model-cache $MC --out $R/serve.json
echo "== end ($((LIMIT - SECONDS))s left)"
