# The environment NCCL jobs on SLURM clusters usually set; sourced by the batch scripts here.
# Adjust the fabric lines to your cluster (ask its admins which interfaces and HCAs to use).
export CUDA_DEVICE_MAX_CONNECTIONS=1        # Megatron's TP/SP overlap relies on one hardware queue
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1    # a failed collective ends the job instead of hanging it
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
# export NCCL_SOCKET_IFNAME=ib0              # the interface for NCCL's bootstrap / socket transport
# export NCCL_IB_HCA=mlx5                    # the InfiniBand adapters NCCL may use
# export NCCL_IB_GID_INDEX=3                 # RoCE clusters
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# torchrun's rendezvous: the job's first node
# (read whole: `| head -n 1` would end scontrol with SIGPIPE, which `set -o pipefail` makes fatal)
mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
HEAD_NODE=${NODES[0]}
export MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}
export MASTER_PORT=${MASTER_PORT:-$((29500 + SLURM_JOB_ID % 10000))}
