#!/bin/bash
# Runs on the lent H200 (the `device` tool), from the repo root. Idempotent:
# results go to /root/res (kept while the machine stays warm) and are copied
# to $OUT at the end, so a second call picks up where the first stopped.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/root/whl; R=/root/res; T=/root/traces; mkdir -p $W $R $T
LOG=$R/log.txt
exec > >(tee -a $LOG) 2>&1
cp -f .whl/* .whl2/* $W/ 2>/dev/null
if [ ! -f /tmp/site/.done ]; then
  cat $W/mlxcuda.part.* > $W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl && touch /tmp/site/.done || exit 4
fi
[ -e divergence/fixtures ] || ln -sfn ../fixtures divergence/fixtures  # setup.py maps divergence.fixtures to fixtures/ (device copy only)
export PYTHONPATH=$PWD:/tmp/site
LIMIT=${LIMIT:-570}
left() { echo $((LIMIT - SECONDS)); }
step() {  # step NAME MIN_SECONDS_LEFT CMD... : runs once, stdout to $R/NAME
  local name=$1 need=$2; shift 2
  [ -f $R/$name.done ] && { echo "== $name: done earlier"; return; }
  [ $(left) -lt $need ] && { echo "== $name: skipped, $(left)s left"; return; }
  echo "== $name ($(date +%T), $(left)s left): $*"
  local t0=$SECONDS
  timeout $(( $(left) - 10 )) "$@" > $R/$name.tmp; local rc=$?
  mv $R/$name.tmp $R/$name; echo "== $name rc=$rc in $((SECONDS - t0))s"
  [ $rc -le 1 ] && [ -s $R/$name ] && touch $R/$name.done
}
step env.txt 30 python3 -c "
import mlx.core as mx, mlx_lm, platform, subprocess
print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, 'python', platform.python_version())
print('default_device', mx.default_device(), 'cuda', mx.cuda.is_available())
import shutil; print(subprocess.run(['nvidia-smi','--query-gpu=name,driver_version,memory.total','--format=csv,noheader'],capture_output=True,text=True).stdout.strip() if shutil.which('nvidia-smi') else 'no nvidia-smi')
a = mx.random.normal((8, 256)).astype(mx.bfloat16); w = mx.random.normal((256, 256)).astype(mx.bfloat16)
print('row0 M=1 vs M=8 equal:', mx.array_equal((a[:1] @ w.T)[0], (a @ w.T)[0]).item())
"
P=bench/results/cuda/prompts.jsonl
step op_rows_fixture.txt 60 python3 bench/op_rows.py --model fixtures/target --rows 8 --json $R/op_rows_fixture.json
step fixture_run.json 120 python3 -m divergence run --model fixtures/target --policy native --prompts $P --max-tokens 64 --ignore-eos --out $T/fixture --json
step fixture_bisect.json 60 python3 -m divergence bisect $T/fixture/serial.h5 $T/fixture/concurrent.h5 --confirm --json
step fixture_bisect.txt 30 python3 -m divergence bisect $T/fixture/serial.h5 $T/fixture/concurrent.h5 --confirm
step make_qwen.txt 60 python3 -c "
from divergence.testing.models import make_random_model
print(make_random_model('/root/qwen05b', model_type='qwen2', hidden_size=896, num_layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936, tie=True, dtype='bfloat16', tokenizer_from='fixtures/target'))"
step op_rows_qwen05b.txt 60 python3 bench/op_rows.py --model /root/qwen05b --rows 8 --json $R/op_rows_qwen05b.json
step qwen05b_run.json 150 python3 -m divergence run --model /root/qwen05b --policy native --prompts $P --max-tokens 64 --ignore-eos --out $T/qwen05b --json
step qwen05b_bisect.json 60 python3 -m divergence bisect $T/qwen05b/serial.h5 $T/qwen05b/concurrent.h5 --confirm --json
step qwen05b_bisect.txt 30 python3 -m divergence bisect $T/qwen05b/serial.h5 $T/qwen05b/concurrent.h5 --confirm
step bg_fixture.txt 60 python3 bench/batch_generator_trace.py --model fixtures/target --prompts $P --max-tokens 64 --out $T/bg_fixture --json $R/bg_fixture.json
step bg_qwen05b.txt 90 python3 bench/batch_generator_trace.py --model /root/qwen05b --prompts $P --max-tokens 64 --out $T/bg_qwen05b --json $R/bg_qwen05b.json
step probe_fixture.json 60 python3 -m divergence probe --model fixtures/target --rows 1..64 --json
step probe_fixture.txt 20 python3 -m divergence probe --model fixtures/target --rows 1..64
step probe_qwen05b.json 60 python3 -m divergence probe --model /root/qwen05b --rows 1..32 --json
step probe_qwen05b.txt 20 python3 -m divergence probe --model /root/qwen05b --rows 1..32
step pytest_cuda.txt 120 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
ls -la $R; du -sh $T
# at most 8 files come back: one archive of everything
tar czf $OUT/results.tgz -C $R . && ls -la $OUT
