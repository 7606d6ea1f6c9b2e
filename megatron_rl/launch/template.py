"""The sbatch template of a run (bash with ``{{name}}`` placeholders, filled by render.py).

One job, two Slurm steps started side by side and watched by the batch script:

- ``trainer``: one task per trainer GPU; each task gets the torchrun-style environment
  (RANK / WORLD_SIZE / LOCAL_RANK from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID,
  MASTER_ADDR = the first host of the allocation) and runs ``megatron-rl train``;
- ``generator``: one task per vLLM engine, ``python -m megatron_rl.launch.generator``, which
  connects to the trainer's generator pool over TCP (``rollout.placement: remote``).

With ``preflight: true`` in the recipe (the default) the same two steps first run with
``megatron-rl preflight`` as the trainer's command; a failed check ends the job with its
report (``RUN_DIR/preflight.json``, the table in the preflight log) before any training.

Pre-timeout signal: Slurm sends SIGUSR1 to the batch shell only (``--signal=B:USR1@...``).
Signalling the steps directly (no ``B:``) would reach every process of every step (Slurm
signals whole steps): the trainer's reward workers and the generators would die of it before
the trainer had checkpointed. So the batch shell relays the request as SIGWINCH (ignored by
default by every process) to the trainer step, whose task wrapper turns it into SIGUSR1 for
the trainer process alone; the trainer checkpoints at its next step boundary and exits 0;
the batch shell then requeues the job (``scontrol requeue``), which resumes from the run
directory.
"""

from __future__ import annotations

JOB_TEMPLATE = r"""#!/bin/bash
# {{title}}
#
# Rendered from megatron_rl/launch/template.py by `megatron-rl launch`; edit the recipe or the
# template, not this file (slurm/*.sbatch: `python -m megatron_rl.launch.render --write`).
# Roles: {{summary}}
{{sbatch_directives}}

set -uo pipefail

# -- the run ------------------------------------------------------------------------------------
RUN_DIR={{run_dir}}
PYTHON=${PYTHON:-{{python}}}
{{start_weights}}TRAIN_ARGS=({{train_args}})
MAX_STEPS={{max_steps}}
REQUEUE={{requeue}}  # 1: requeue the job after a checkpoint on the pre-timeout signal
PREFLIGHT={{preflight}}  # 1: `megatron-rl preflight` first; a failed check ends the job (recipe: preflight)
GRACE_SECONDS=120  # how long one role may outlive the other before its step is cancelled
JOB_START=$(date +%s)  # hang dumps ($RUN_DIR/hang) newer than this are this job's
CPUS_PER_TASK=${CPUS_PER_TASK:-{{cpus_per_task}}}  # empty: each node's CPUs split evenly among its tasks
CONTAINER_ARGS=({{container_args}})

# -- the layout (megatron_rl/launch/layout.py) ---------------------------------------------------
TRAINER_TASKS={{trainer_tasks}}; TRAINER_NODES={{trainer_nodes}}; TRAINER_TASKS_PER_NODE={{trainer_tasks_per_node}}
TRAINER_SHARING={{trainer_sharing}}; TRAINER_GPU_ARGS=({{trainer_gpu_args}})
GENERATOR_TASKS={{generator_tasks}}; GENERATOR_NODES={{generator_nodes}}; GENERATOR_TASKS_PER_NODE={{generator_tasks_per_node}}
GENERATOR_SHARING={{generator_sharing}}; GENERATOR_GPU_ARGS=({{generator_gpu_args}})
GENERATOR_FIRST_NODE={{generator_first_node}}
export ENGINE_GPUS={{engine_gpus}}          # GPUs of one vLLM engine (rollout.tensor_parallel)
{{device_env}}
export PYTHONUNBUFFERED=1

# -- rendezvous: trainer rank 0 (which holds the generator pool) runs on the first host ----------
mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
export MASTER_ADDR=${HOSTS[0]}
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 10000))
export MEGATRON_RL_GENERATOR_ADDR=$MASTER_ADDR:$((30000 + SLURM_JOB_ID % 10000))
MEGATRON_RL_GENERATOR_KEY=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
export MEGATRON_RL_GENERATOR_KEY     # authenticates the generators to the trainer (this job only)
TRAINER_HOSTS=$(IFS=,; echo "${HOSTS[*]:0:TRAINER_NODES}")
GENERATOR_HOSTS=$(IFS=,; echo "${HOSTS[*]:GENERATOR_FIRST_NODE:GENERATOR_NODES}")

LOG_DIR=$RUN_DIR/logs
mkdir -p "$LOG_DIR"
TRAINER_LOG=$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID-trainer.log
GENERATOR_LOG=$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID-generator.log
PREFLIGHT_LOG=$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID-preflight.log
PREFLIGHT_GENERATOR_LOG=$LOG_DIR/$SLURM_JOB_NAME-$SLURM_JOB_ID-preflight-generator.log
# After its engines end (one that cannot start, say), the preflight's other checks still run.
PREFLIGHT_GRACE_SECONDS=600

log() { printf '[megatron-rl %s] %s\n' "$(date '+%F %T')" "$*"; }
step_of() {  # role -> JOBID.STEPID of its running step
    squeue --steps --noheader --jobs="$SLURM_JOB_ID" --format="%i %j" | awk -v n="$1" '$2 == n {print $1; exit}'
}
cpus_for() {  # tasks sharing a node -> CPUs per task
    if [ -n "$CPUS_PER_TASK" ]; then echo "$CPUS_PER_TASK"; return; fi
    local n=$(( ${SLURM_CPUS_ON_NODE:-1} / $1 ))
    echo $(( n > 0 ? n : 1 ))
}

log "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}), run dir $RUN_DIR"
log "trainer: $TRAINER_TASKS task(s) on $TRAINER_HOSTS, log $TRAINER_LOG"
log "generator: $GENERATOR_TASKS engine task(s) on $GENERATOR_HOSTS, log $GENERATOR_LOG"

# -- the pre-timeout signal and job termination ---------------------------------------------------
STOP_REQUESTED=0
request_stop() {
    STOP_REQUESTED=1
    local step; step=$(step_of trainer)
    log "SIGUSR1 (time limit near): asking the trainer (step ${step:-?}) to checkpoint and exit"
    if [ -z "$step" ] || ! scancel --signal="$(kill -l WINCH)" "$step"; then  # by number
        log "WARNING: could not signal the trainer step"
    fi
}
trap request_stop USR1
trap 'log "SIGTERM (preemption, scancel or time limit): the trainer checkpoints on its own SIGTERM"' TERM

# -- task wrappers (run by srun on every task) -----------------------------------------------------
# The trainer wrapper stays the parent of the trainer: it relays SIGWINCH from the batch shell as
# one SIGUSR1 to the trainer process alone, once the trainer handles it, and reports its end.
TRAINER_TASK='
export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=$SLURM_LOCALID
echo "megatron-rl task: role=trainer rank=$RANK world_size=$WORLD_SIZE local_rank=$LOCAL_RANK procid=$SLURM_PROCID step=$SLURM_STEP_ID host=$(hostname) pid=$$ master=$MASTER_ADDR:$MASTER_PORT"
handles_usr1() {  # the trainer has installed its SIGUSR1 handler (Linux: SigCgt bit 9)
    local mask; mask=$(awk "/^SigCgt:/ {print \$2}" "/proc/$1/status" 2>/dev/null)
    [ -n "$mask" ] && (( (16#$mask >> 9) & 1 ))
}
trap "" USR1  # the trainer starts with SIGUSR1 ignored, until it installs its own handler
"$@" &
child=$!
stop=0; sent=0
trap "stop=1" WINCH
trap "echo megatron-rl task: trainer rank $RANK got SIGTERM" TERM
while kill -0 "$child" 2>/dev/null; do
    if [ "$stop" = 1 ] && [ "$sent" = 0 ]; then
        if handles_usr1 "$child"; then
            kill -USR1 "$child" && sent=1
            echo "megatron-rl task: trainer rank $RANK: SIGUSR1 sent (checkpoint and exit)"
        else  # still starting up: SIGUSR1 would be ignored (or kill it at exit), so wait
            sleep 1 & wait $!
        fi
    else
        wait "$child"  # returns early on SIGWINCH
    fi
done
wait "$child"; rc=$?
echo "megatron-rl task: role=trainer rank=$RANK exited with status $rc"
exit "$rc"'
# The generator wrapper picks this engine's GPUs out of the step's and becomes the engine server.
GENERATOR_TASK='
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    IFS=, read -ra gpus <<< "$CUDA_VISIBLE_DEVICES"
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${gpus[*]:$((SLURM_LOCALID * ENGINE_GPUS)):ENGINE_GPUS}")
    export CUDA_VISIBLE_DEVICES
fi
echo "megatron-rl task: role=generator engine=$SLURM_PROCID procid=$SLURM_PROCID step=$SLURM_STEP_ID host=$(hostname) pid=$$ gpus=${CUDA_VISIBLE_DEVICES:-none}"
exec "$@" --engine "$SLURM_PROCID"'

# --kill-on-bad-exit: a task that fails ends its whole step; --wait: once one task of a step has
# ended, the others get GRACE_SECONDS, so a hung rank cannot keep the job alive.
SRUN_COMMON=(--kill-on-bad-exit=1 --wait="$GRACE_SECONDS" --exact --label --open-mode=append "${CONTAINER_ARGS[@]}")

reap() {  # pid -> its exit status (waits; a trapped signal only interrupts the wait)
    while kill -0 "$1" 2>/dev/null; do wait "$1"; done
    wait "$1"
}
finish_role() {  # pid role: give the role $GRACE (default GRACE_SECONDS) to end on its own, then cancel its step
    local pid=$1 role=$2 waited=0 step grace=${GRACE:-$GRACE_SECONDS}
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$grace" ]; do
        sleep 1; waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        step=$(step_of "$role")
        log "the $role step (${step:-?}) still runs ${grace}s later: cancelling it"
        [ -n "$step" ] && scancel "$step"
        sleep 30
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    reap "$pid"
}
run_roles() {  # command trainer_log generator_log trainer_grace: both steps, until both end
    local command=$1 trainer_log=$2 generator_log=$3 trainer_grace=$4
    srun --job-name=trainer --nodes="$TRAINER_NODES" --ntasks="$TRAINER_TASKS" \
        --ntasks-per-node="$TRAINER_TASKS_PER_NODE" --nodelist="$TRAINER_HOSTS" \
        --cpus-per-task="$(cpus_for "$TRAINER_SHARING")" "${TRAINER_GPU_ARGS[@]}" "${SRUN_COMMON[@]}" \
        --output="$trainer_log" \
        bash -c "$TRAINER_TASK" trainer "$PYTHON" -m megatron_rl.cli "$command" "${TRAIN_ARGS[@]}" &
    TRAINER_PID=$!
    srun --job-name=generator --nodes="$GENERATOR_NODES" --ntasks="$GENERATOR_TASKS" \
        --ntasks-per-node="$GENERATOR_TASKS_PER_NODE" --nodelist="$GENERATOR_HOSTS" \
        --cpus-per-task="$(cpus_for "$GENERATOR_SHARING")" "${GENERATOR_GPU_ARGS[@]}" "${SRUN_COMMON[@]}" \
        --output="$generator_log" \
        bash -c "$GENERATOR_TASK" generator "$PYTHON" -m megatron_rl.launch.generator &
    GENERATOR_PID=$!

    while kill -0 "$TRAINER_PID" 2>/dev/null && kill -0 "$GENERATOR_PID" 2>/dev/null; do
        sleep 2 & wait $!
    done
    if kill -0 "$TRAINER_PID" 2>/dev/null; then  # the generators ended first
        reap "$GENERATOR_PID"; GENERATOR_RC=$?
        if [ "$GENERATOR_RC" != 0 ]; then
            log "ERROR: the generator step failed (status $GENERATOR_RC) while the trainer runs; see $generator_log"
        else
            log "generator step exited with status 0"
        fi
        GRACE=$trainer_grace finish_role "$TRAINER_PID" trainer; TRAINER_RC=$?
        log "trainer step exited with status $TRAINER_RC"
    else
        reap "$TRAINER_PID"; TRAINER_RC=$?
        log "trainer step exited with status $TRAINER_RC"
        finish_role "$GENERATOR_PID" generator; GENERATOR_RC=$?
        log "generator step exited with status $GENERATOR_RC"
    fi
}

# -- preflight: the allocation checks itself (recipe key `preflight`; megatron_rl/preflight/) -----
# The same steps as training, with `megatron-rl preflight` as the trainer's command: minutes on
# the real GPUs and network; a failed check stops the job here, before any training.
if [ "$PREFLIGHT" = 1 ]; then
    log "preflight: checking the allocation (megatron-rl preflight), log $PREFLIGHT_LOG"
    run_roles preflight "$PREFLIGHT_LOG" "$PREFLIGHT_GENERATOR_LOG" "$PREFLIGHT_GRACE_SECONDS"
    if [ "$TRAINER_RC" != 0 ]; then
        log "ERROR: preflight failed (status $TRAINER_RC): no training in this job. The table is in $PREFLIGHT_LOG, the report in $RUN_DIR/preflight.json (docs/cluster.md: First hour on a cluster)"
        grep -E '^(\S+: )?(FAIL|SKIP) ' "$PREFLIGHT_LOG" 2>/dev/null | sed 's/^/    /'
        exit "$TRAINER_RC"
    fi
    if [ "$STOP_REQUESTED" = 1 ]; then
        log "the time limit is near after the preflight: no training in this job"
        exit 0
    fi
    log "preflight passed: training"
fi

run_roles train "$TRAINER_LOG" "$GENERATOR_LOG" "$GRACE_SECONDS"

# A hung trainer rank (no progress within training.hang_timeout_minutes) wrote its threads'
# stacks to $RUN_DIR/hang/rank_N.txt and exited with status 75 (megatron_rl/platform/watchdog.py);
# the step's status may be another rank's, the dumps are not. Requeue: the job resumes from the
# last checkpoint; but not twice without a new checkpoint in between (a hang that recurs before
# any progress needs a person).
HANG_DUMPS=$(find "$RUN_DIR/hang" -maxdepth 1 -name 'rank_*.txt' -newermt "@$JOB_START" 2>/dev/null | sort | tr '\n' ' ')
if [ "$TRAINER_RC" != 0 ] && [ -n "$HANG_DUMPS" ]; then
    LATEST=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || echo step_0)
    log "ERROR: trainer rank(s) hung (status $TRAINER_RC); their stacks: $HANG_DUMPS"
    if [ "$REQUEUE" = 1 ] && [ "$(cat "$RUN_DIR/hang/requeued_at" 2>/dev/null)" != "$LATEST" ]; then
        echo "$LATEST" > "$RUN_DIR/hang/requeued_at"
        log "requeueing job $SLURM_JOB_ID after the hang: it resumes from $LATEST in $RUN_DIR"
        scontrol requeue "$SLURM_JOB_ID" || { log "ERROR: scontrol requeue failed: resubmit to resume"; exit 1; }
        exit 0
    fi
    log "not requeued (cluster.requeue false, or hung again before a checkpoint after $LATEST)"
fi
if [ "$TRAINER_RC" != 0 ]; then
    log "ERROR: the trainer failed (status $TRAINER_RC); see $TRAINER_LOG and $GENERATOR_LOG"
    exit "$TRAINER_RC"
fi
LATEST=$(cat "$RUN_DIR/checkpoints/latest" 2>/dev/null || echo step_0)
if [ "$STOP_REQUESTED" = 1 ] && [ "$((10#${LATEST#step_}))" -lt "$MAX_STEPS" ]; then
    if [ "$REQUEUE" = 1 ]; then
        log "checkpoint $LATEST saved before the time limit: requeueing job $SLURM_JOB_ID (it resumes from $RUN_DIR)"
        scontrol requeue "$SLURM_JOB_ID" || { log "ERROR: scontrol requeue failed: resubmit to resume"; exit 1; }
    else
        log "checkpoint $LATEST saved before the time limit (cluster.requeue: false): resubmit to resume"
    fi
    exit 0
fi
log "training finished (latest checkpoint $LATEST)"
exit 0
"""

GPU_ENV = r"""
# -- GPUs and NCCL on GB200 NVL72 -----------------------------------------------------------------
# An NVL72 rack is one NVLink domain of 72 GPUs (18 compute trays x 4 GPUs). Multi-node NVLink
# (MNNVL) lets NCCL reach the GPUs of other trays of the rack over NVLink; it needs the IMEX
# service on the nodes and an IMEX channel the job can open. Collectives of the trainer stay
# inside one domain when its nodes are in one rack (--segment above, cluster.segment).
# MNNVL and NVLS (NVLink SHARP) are NCCL's to decide unless the recipe's cluster section says
# (nccl_mnnvl, nccl_nvls, engine_nccl_nvls): forcing MNNVL on turns NCCL's auto-detect into an
# init failure on nodes without an IMEX channel. Both steps get these same NCCL_* settings: the
# trainer's weight sender and the engines share NCCL communicators, and ranks of one
# communicator with different NCCL settings can hang. The engines' own TP communicators run
# without NVLS unless cluster.engine_nccl_nvls (its buffers take engine GPU memory): their step
# gets MEGATRON_RL_ENGINE_NCCL_NVLS, which vLLM pins for those communicators alone
# (megatron_rl/rollout/engine/nccl_env.py).
export NCCL_CUMEM_ENABLE=${NCCL_CUMEM_ENABLE:-1}   # cuMem buffers: MNNVL and NVLS need them
{{nccl_settings}}
# SITE-SPECIFIC: the IMEX channel. With Slurm's switch/nvidia_imex plugin (Slurm >= 24.05) each
# job gets its own channel; otherwise /dev/nvidia-caps-imex-channels/channel0 must exist on every
# node and be writable by the job, and a container must be given it (NVIDIA_IMEX_CHANNELS).
export NVIDIA_IMEX_CHANNELS=${NVIDIA_IMEX_CHANNELS:-0}
# SITE-SPECIFIC: the network between racks (InfiniBand / RoCE), e.g.
#   export NCCL_IB_HCA=mlx5_0,mlx5_1,mlx5_2,mlx5_3  NCCL_SOCKET_IFNAME=...  GLOO_SOCKET_IFNAME=...
# Fail instead of hanging: an NCCL error or a collective timeout (parallel.timeout_minutes)
# aborts the rank, --kill-on-bad-exit ends its step, and this script ends the job.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
# CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron's TP/SP overlap) is the trainer step's alone.
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
"""

CPU_ENV = r"""
# -- CPU run: no GPUs are requested; "GPUs" of the cluster section are task slots ----------------
"""

GPU_DIRECTIVES_NOTE = (
    "# SITE-SPECIFIC (GB200 NVL72): {total} GPUs {fit} one {domain}-GPU NVLink domain. The\n"
    "# trainer's nodes (the first ones of the allocation) belong in one rack:\n{how}"
)
SEGMENT_NOTE = (
    "# --segment={segment} keeps them there (Slurm >= 24.11 with topology/block: the job is\n"
    "# allocated in segments of {segment} nodes, each inside one block; cluster.segment)."
)
NO_SEGMENT_NOTE = (
    "# request one with a --constraint or --nodelist naming a rack, or set cluster.segment\n"
    "# (Slurm >= 24.11 with topology/block)."
)

# A production preset without model.hf_path (the checked-in scripts): the checkpoint comes from
# $HF_PATH at submission; without it the job ends here instead of the trainer writing a random
# fp32 model of the preset (hundreds of GB) and training it with the character tokenizer.
HF_PATH_LINES = (
    'HF_PATH=${{HF_PATH:?"set HF_PATH to the HF checkpoint of {preset} to start from '
    '(model.hf_path): export HF_PATH=/path/to/checkpoint, then sbatch this script"}}\n'
)
