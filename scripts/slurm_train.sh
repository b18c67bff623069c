#!/bin/bash
# jaxft-train over several nodes with SLURM: one process per node, each using every GPU of its node.
#
#   sbatch --nodes=2 --gpus-per-node=8 scripts/slurm_train.sh CONFIG.yaml [overrides ...]
#
# The config's `mesh` spans all nodes' GPUs (e.g. mesh: {data: 2, fsdp: 8} for 2 x 8 H200: fsdp within a
# node, data across nodes, or mesh: auto). Process 0 (the first node) is the coordinator and the only process
# that writes metrics.jsonl and the exports; output_dir must be on a file system every node sees (orbax writes
# each node's checkpoint shards there). jaxft reads JAXFT_COORDINATOR / JAXFT_NUM_PROCESSES / JAXFT_PROCESS_ID
# (jaxft/distributed.py); `distributed: auto` in the config would instead let JAX read SLURM's variables, with
# one process per GPU (srun --ntasks-per-node=8 --gpus-per-task=1).
#SBATCH --job-name=jaxft
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
set -euo pipefail
if [ $# -lt 1 ]; then
  echo "usage: sbatch --nodes=N --gpus-per-node=G $0 CONFIG.yaml [overrides ...]" >&2
  exit 2
fi
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export JAXFT_COORDINATOR="${head_node}:${JAXFT_PORT:-29500}"
export JAXFT_NUM_PROCESSES="$SLURM_NNODES"
# JAXFT_PROCESS_ID differs per task: srun runs the quoted command once per node, where SLURM_PROCID is set.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'JAXFT_PROCESS_ID=$SLURM_PROCID exec jaxft-train "$@"' jaxft-train "$@"
