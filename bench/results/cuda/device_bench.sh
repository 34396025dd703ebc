#!/bin/bash
# Issue 13 on the lent H200 (the `device` tool), from the repo root, in two calls:
#   1. carry .whl-c1 (mlx + mlx-lm wheels, the first part of mlx-cuda-13): STAGE=1 saves them
#   2. carry .whl-c2 (the rest): installs, then runs the checks and benchmarks below.
# Results go to /root/res and come back as one archive in $OUT.
mkdir -p /root/res
[ "$STAGE" = 1 ] || exec > >(tee -a /root/res/log.txt) 2>&1
. bench/results/cuda/install_mlx_cuda.sh
. bench/results/cuda/device_steps.sh
step env.txt 20 python3 -c "import mlx.core as mx, mlx_lm; print(mx.__version__, mlx_lm.__version__, mx.default_device(), mx.device_info().get('device_name'))"
step engine.txt 200 python3 bench/bench_engine.py --models qwen0.5b,qwen0.5b-4bit --dtypes stored --batches 1,8 --reps 5 --model-cache /root/mc --out $R/engine.json
step profile.txt 60 python3 bench/profile_engine.py --models qwen0.5b --dtypes bfloat16 --batches 1,8 --model-cache /root/mc --no-pyinstrument --out $R/profile.json
P=bench/results/cuda/prompts.jsonl
step make_qwen.txt 60 python3 -c "
from divergence.testing.models import make_random_model
print(make_random_model('/root/qwen05b', model_type='qwen2', hidden_size=896, num_layers=24, heads=14, kv_heads=2, intermediate_size=4864, vocab_size=151936, tie=True, dtype='bfloat16', tokenizer_from='fixtures/target'))"
for m in fixture:fixtures/target qwen05b:/root/qwen05b; do
  name=${m%%:*}; path=${m#*:}
  step bg_$name.txt 60 python3 bench/batch_generator_trace.py --model $path --prompts $P --max-tokens 32 --out /root/bg_$name
  for s in serial concurrent; do
    step replay_bg_${name}_$s.json 60 python3 -m divergence replay /root/bg_$name/$s.h5 --json
  done
  step bisect_bg_$name.txt 90 python3 -m divergence bisect /root/bg_$name/serial.h5 /root/bg_$name/concurrent.h5 --confirm
done
step pytest_cuda.txt 150 python3 -m pytest -q -p no:cacheprovider -rA tests/test_cuda.py
ls -la $R
tar czf $OUT/results.tgz -C $R . && ls -la $OUT
