#!/bin/bash
# Two calls on the lent GPU machine: STAGE=1 with .whl-c1 carried, then with .whl-c2;
# the second installs MLX CUDA and runs $EXP (its results go to $OUT).
. bench/results/cuda/install_mlx_cuda.sh
eval "$EXP"
