#!/bin/bash
# Issue 18: TP=2 on two GPUs of one host over MLX's NCCL backend. Runs from the repo
# root on a machine with two NVIDIA GPUs (the lent `nvidia-h200-x2`), MLX's CUDA wheel
# installed as in ../cuda/device.sh (from .whl/ parts, into /tmp/site) or already
# importable. Idempotent: results go to /root/res-tp2 and are copied to $OUT at the end,
# so a second call picks up where the first stopped. Every TP=2 command runs under
# mlx.launch (one process per GPU, --backend nccl), as the issue asks; one extra step
# checks that divergence's own launcher (DIVERGENCE_TP_BACKEND=nccl) gives the same
# trace bit for bit.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/root/whl; R=/root/res-tp2; T=/root/traces-tp2; mkdir -p $W $R $T /tmp/bin
LOG=$R/log.txt
exec > >(tee -a $LOG) 2>&1
if ! python3 -c "import mlx.core as mx; assert mx.cuda.is_available()" 2>/dev/null; then
  cp -f .whl/* .whl2/* $W/ 2>/dev/null
  if [ ! -f /tmp/site/.done ]; then
    cat $W/mlxcuda.part.* > $W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $W/*.whl && touch /tmp/site/.done || exit 4
  fi
fi
[ -e divergence/fixtures ] || ln -sfn ../fixtures divergence/fixtures  # setup.py maps divergence.fixtures to fixtures/ (device copy only)
export PYTHONPATH=$PWD:/tmp/site
# mlx.launch as a command (the wheel's console script may not be on PATH with --target installs)
cat > /tmp/bin/mlxlaunch <<'PY'
#!/usr/bin/env python3
import sys
from mlx._distributed_utils.launch import main
sys.argv[0] = "mlx.launch"
main()
PY
chmod +x /tmp/bin/mlxlaunch
export PATH=/tmp/bin:$PATH
ML="mlxlaunch --backend nccl -n 2 --"
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
import mlx.core as mx, mlx_lm, platform, subprocess, shutil
print('mlx', mx.__version__, 'mlx_lm', mlx_lm.__version__, 'python', platform.python_version())
print('default_device', mx.default_device(), 'cuda', mx.cuda.is_available())
print(subprocess.run(['nvidia-smi','--query-gpu=index,name,driver_version,memory.total','--format=csv,noheader'],capture_output=True,text=True).stdout.strip() if shutil.which('nvidia-smi') else 'no nvidia-smi')
"
step nccl_smoke.txt 60 $ML python3 -c "
import mlx.core as mx
g = mx.distributed.init(strict=True, backend='nccl')
x = mx.ones((4, 8)) * (g.rank() + 1)
print('rank', g.rank(), 'of', g.size(), 'all_sum', mx.distributed.all_sum(x, group=g)[0, 0].item(),
      'all_gather', mx.distributed.all_gather(x, group=g).shape)
"
P=bench/results/cuda-tp2/prompts.jsonl
RUN="--policy native --dtype bfloat16 --prompts $P --max-tokens 64 --ignore-eos"
step make_qwen.txt 60 python3 -c "
from divergence.testing.models import make_random_model
print(make_random_model('/root/qwen05b', model_type='qwen2', hidden_size=896, num_layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936, tie=True, dtype='bfloat16', tokenizer_from='fixtures/target'))"
for m in fixture qwen05b; do
  M=fixtures/target; [ $m = qwen05b ] && M=/root/qwen05b
  step ${m}_tp1_run.json 120 python3 -m divergence run --model $M $RUN --out $T/$m/tp1 --json
  step ${m}_tp2_run.json 150 $ML python3 -m divergence run --tp 2 --model $M $RUN --out $T/$m/tp2 --json
  step ${m}_tp1_vs_tp2_bisect.json 90 $ML python3 -m divergence bisect $T/$m/tp1/serial.h5 $T/$m/tp2/serial.h5 --confirm --bitwise --json
  step ${m}_tp1_vs_tp2_bisect.txt 30 python3 -m divergence bisect $T/$m/tp1/serial.h5 $T/$m/tp2/serial.h5 --bitwise
  step ${m}_tp2_serial_vs_concurrent_bisect.json 90 $ML python3 -m divergence bisect $T/$m/tp2/serial.h5 $T/$m/tp2/concurrent.h5 --confirm --bitwise --json
  step ${m}_tp2_serial_vs_concurrent_bisect.txt 30 python3 -m divergence bisect $T/$m/tp2/serial.h5 $T/$m/tp2/concurrent.h5 --bitwise
  step probe_tp2_${m}.json 60 $ML python3 -m divergence probe --tp 2 --model $M --rows 1..128 --json
done
# divergence's own launcher over NCCL must give mlx.launch's trace, bit for bit
step self_launch_run.json 90 env DIVERGENCE_TP_BACKEND=nccl python3 -m divergence run --tp 2 --model fixtures/target $RUN --schedules serial --out $T/fixture/tp2self --json
step self_launch_diff.json 20 python3 -m divergence diff $T/fixture/tp2/serial.h5 $T/fixture/tp2self/serial.h5 --bitwise --json
step pytest_cuda_tp.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda_tp.py
ls -la $R; du -sh $T
# at most 8 files come back: one archive of everything
tar czf $OUT/results.tgz -C $R . && ls -la $OUT
