#!/bin/bash
# Issue 13 on the lent H200 (the `device` tool), from the repo root, in two calls:
#   1. carry .whl-c1 (mlx + mlx-lm wheels, the first part of mlx-cuda-13): STAGE=1 saves them
#   2. carry .whl-c2 (the rest): installs, then runs the checks and benchmarks below.
# Results go to /root/res and come back as one archive in $OUT.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/root/whl; R=/root/res; mkdir -p $W $R
cp -f .whl-c1/* .whl-c2/* $W/ 2>/dev/null
[ "$STAGE" = 1 ] && { ls -la $W; exit 0; }
exec > >(tee -a $R/log.txt) 2>&1
if [ ! -f /root/site/.done ]; then
  cat $W/cudapart.* > $W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \
    $W/mlx-*.whl $W/mlx_lm-*.whl $W/mlx_cuda_13-*.whl && touch /root/site/.done || exit 4
fi
[ -e divergence/fixtures ] || ln -sfn ../fixtures divergence/fixtures
export PYTHONPATH=$PWD:/root/site
LIMIT=${LIMIT:-570}
step() {  # step NAME MIN_SECONDS_LEFT CMD...: once per warm machine, stdout to $R/NAME
  local name=$1 need=$2; shift 2
  [ -f $R/$name.done ] && { echo "== $name: done earlier"; return; }
  [ $((LIMIT - SECONDS)) -lt $need ] && { echo "== $name: skipped"; return; }
  echo "== $name ($(date +%T), $((LIMIT - SECONDS))s left): $*"
  timeout $((LIMIT - SECONDS - 10)) "$@" > $R/$name.tmp; local rc=$?
  mv $R/$name.tmp $R/$name; echo "== $name rc=$rc"
  [ $rc -le 1 ] && [ -s $R/$name ] && touch $R/$name.done
}
step env.txt 20 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info().get('device_name'))"
step engine.txt 200 python3 bench/bench_engine.py --models qwen0.5b,qwen0.5b-4bit --dtypes stored --batches 1,8 --reps 5 --model-cache /root/mc --out $R/engine.json
step profile.txt 60 python3 bench/profile_engine.py --models qwen0.5b --dtypes bfloat16 --batches 1,8 --model-cache /root/mc --no-pyinstrument --out $R/profile.json
step pytest_cuda.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
ls -la $R
tar czf $OUT/results.tgz -C $R . && ls -la $OUT
