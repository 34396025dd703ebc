# Sourced by the device scripts (from the repo root): gathers the carried wheel parts in
# /root/whl; with STAGE=1 stops there (the first call), else installs MLX CUDA into
# /root/site once per machine and sets PYTHONPATH.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
W=/root/whl; mkdir -p $W
cp -f .whl-c1/* .whl-c2/* $W/ 2>/dev/null
[ "$STAGE" = 1 ] && { ls -la $W; exit 0; }
if [ ! -f /root/site/.done ]; then
  cat $W/cudapart.* > $W/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl || exit 3
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /root/site \
    $W/mlx-*.whl $W/mlx_lm-*.whl $W/mlx_cuda_13-*.whl && touch /root/site/.done || exit 4
fi
[ -e divergence/fixtures ] || ln -sfn ../fixtures divergence/fixtures
export PYTHONPATH=$PWD:/root/site
