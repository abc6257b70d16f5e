#!/usr/bin/env bash
# Train a recipe on this machine alone, without Slurm: one torchrun for cluster.gpus_per_node ranks,
# after the same node checks the Slurm path runs. Usable inside the project's container as well:
#   bash launch/run_single_node.sh tiny_llama_cpu train.train_iters=50
#   bash launch/run_single_node.sh llama3_8b_pretrain --print-only      # show the torchrun line only
# Several nodes by hand: set MASTER_ADDR, MASTER_PORT and NODE_RANK on each and use the same command.
set -euo pipefail
PYTHON=${PYTHON:-python}
exec "$PYTHON" -m megatron_recipes._launch.entry "$@"
