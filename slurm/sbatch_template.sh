#!/bin/bash
# Plain sbatch template for megapkl, for users who do not use submitit (`megapkl submit` does all of
# this from a cluster profile). Copy it, edit the #SBATCH lines for your partition, then:
#
#   sbatch --export=ALL,CONFIG=configs/experiments/pkl_periodic/qwen3_8b_pkl.yaml slurm/sbatch_template.sh
#   sbatch --export=ALL,CONFIG=my.yaml slurm/sbatch_template.sh objective.beta=0.3 seed=2
#
# Arguments after the script are run-config overrides. #SBATCH values can also be overridden on
# the sbatch command line (e.g. --nodes=4 --time=1-00:00:00).
#
# Layout: one Slurm task per GPU started by srun; each task runs `python -m megapkl.launch.task`,
# which sets torch threads from SLURM_CPUS_PER_TASK, initializes torch.distributed from the Slurm
# environment (NCCL on GPUs, gloo on CPU), writes <run_dir>/config.yaml, launch.json,
# metrics.jsonl, events.jsonl and result.json, and calls the entry point (ENTRY, default the
# trainer, megapkl.train:run).
#
# Preemption and time limits: Slurm sends SIGUSR2 to every task 300 s before the kill
# (--signal=USR2@300). The trainer checkpoints at its next step boundary; rank 0 leaves a request
# in REQUEUE_DIR and, once every task has exited, this script runs `scontrol requeue` (needs
# --requeue) on the batch host, so the tasks need no Slurm client (container images have none).
# REQUEUE_DIR must be a directory rank 0 and this script both see (default: .megapkl-requeue in the
# submit directory). The requeued job resumes from the checkpoint with checkpoint.resume=true. Keep
# PREEMPT_GRACE_S (forced requeue if no step boundary came) below 300.
#
# torchrun instead of one task per GPU: set LAUNCHER=torchrun (one srun task per node, torchrun
# starts the GPU workers and they meet at the first node). Slurm's signal reaches the workers
# directly (torchrun is started with it ignored), so preemption works as above.

#SBATCH --job-name=megapkl
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --mem=0
#SBATCH --exclusive
#SBATCH --time=1-00:00:00
#SBATCH --signal=USR2@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out

set -euo pipefail

CONFIG="${CONFIG:?set CONFIG to a run config: sbatch --export=ALL,CONFIG=path.yaml $0}"
ENTRY="${ENTRY:-megapkl.train:run}"
LAUNCHER="${LAUNCHER:-srun}"
PREEMPT_GRACE_S="${PREEMPT_GRACE_S:-240}"
MAX_REQUEUES="${MAX_REQUEUES:-10}"
PYTHON="${PYTHON:-python3}"

# ---- environment (edit for your site: modules, virtualenv or container)
# module load cuda/12.8
# source "$HOME/venvs/megapkl/bin/activate"
export CUDA_DEVICE_MAX_CONNECTIONS=1          # megatron-core TP/SP communication overlap
# CleanUpOnly: NCCL's watchdog aborts a failed or timed-out collective without ending the process,
# which then raises the collective's error (the failure notice aborts alike: docs/reliability.md)
export TORCH_NCCL_ASYNC_ERROR_HANDLING=2
export PYTHONUNBUFFERED=1
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
# --export=ALL hands the job the submitting shell's environment: its rendezvous variables (a
# torchrun, an interactive job) are not this job's. Each task picks its own port from the job id
# and restart count.
unset MASTER_ADDR MASTER_PORT TORCHELASTIC_RUN_ID

echo "[megapkl] job ${SLURM_JOB_ID} restart ${SLURM_RESTART_COUNT:-0} on ${SLURM_JOB_NODELIST}:" \
     "${SLURM_NNODES} nodes x ${SLURM_NTASKS_PER_NODE:-?} tasks; config ${CONFIG} $*"

TASK_ARGS=(--entry "$ENTRY" --preempt-grace-s "$PREEMPT_GRACE_S" --max-requeues "$MAX_REQUEUES")
export MEGAPKL_REQUEUE_DIR="${REQUEUE_DIR:-$PWD/.megapkl-requeue}"
mkdir -p "$MEGAPKL_REQUEUE_DIR"
REQUEST="$MEGAPKL_REQUEUE_DIR/requeue.$SLURM_JOB_ID"
rm -f "$REQUEST"
status=0

if [ "$LAUNCHER" = "torchrun" ]; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
  # megapkl.launch.runtime.rendezvous_port: below the ephemeral ports and the servers'
  # base_port, a new one after each requeue
  MASTER_PORT=$(( 20000 + (SLURM_JOB_ID + 7919 * ${SLURM_RESTART_COUNT:-0}) % 10000 ))
  GPUS_PER_NODE="${SLURM_GPUS_ON_NODE:-${SLURM_NTASKS_PER_NODE:-1}}"
  echo "[megapkl] torchrun: ${GPUS_PER_NODE} workers per node, rendezvous at ${MASTER_ADDR}:${MASTER_PORT}"
  # One task per node; torchrun starts GPUS_PER_NODE workers in it. Slurm signals every process
  # of the step: the workers take USR2, checkpoint and ask for the requeue; torchrun ignores it
  # (its default action would end the task, and with it, under proctrack/cgroup, the workers).
  srun --ntasks-per-node=1 --cpus-per-task="$(( ${SLURM_CPUS_PER_TASK:-1} * GPUS_PER_NODE ))" \
       --kill-on-bad-exit=1 \
    bash -c 'trap "" USR2; exec "$@"' torchrun \
      "$PYTHON" -m torch.distributed.run --nnodes="$SLURM_NNODES" --nproc-per-node="$GPUS_PER_NODE" \
      --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
      -m megapkl.launch.task "$CONFIG" "${TASK_ARGS[@]}" "$@" || status=$?
else
  srun --kill-on-bad-exit=1 "$PYTHON" -u -m megapkl.launch.task "$CONFIG" "${TASK_ARGS[@]}" "$@" \
    || status=$?
fi

if [ -e "$REQUEST" ]; then  # rank 0 asked for a requeue (preemption or time limit)
  rm -f "$REQUEST"
  echo "[megapkl] requeueing job ${SLURM_JOB_ID} from the batch script"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$status"
