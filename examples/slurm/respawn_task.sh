#!/bin/bash
# One task of an srun step that respawns its rank's process, as `python -m inprocess.launch --respawn`
# does on one machine (README, "Respawn and rejoin"); examples/slurm/train.sbatch runs every task through it:
#
#   srun --kill-on-bad-exit=0 --wait=0 examples/slurm/respawn_task.sh train.py [args...]
#
# The replacement runs in the same task of the same step: same node, same SLURM_* variables (the job's
# incarnation), the same RANK/WORLD_SIZE/LOCAL_RANK, plus INPROCESS_JOIN=1 and INPROCESS_RESPAWN_COUNT=k,
# which tell the wrapper that it joins a running job.
#
# Respawned: a process killed by a signal (bash reports 128 + the signal) or ended with 75 (its main
# thread could not be released) or 76 (lost CUDA context). Not respawned: 0 (the job completed; with
# DONE_FILE set, the task touches it) or any other status (the rank left with its own exception). At most
# RESPAWNS times (default 3), the k-th one RESPAWN_BACKOFF * 2^(k-1) seconds after the death (default 1 s,
# at most 30 s), and never once DONE_FILE exists (another rank finished: the job is ending).
set -uo pipefail

RESPAWNS=${RESPAWNS:-3}
RESPAWN_BACKOFF=${RESPAWN_BACKOFF:-1}
# A replacement node's step sets WORLD_SIZE (the job's, not its own SLURM_NTASKS), RANK_OFFSET (the first
# rank of the node it replaces) and INPROCESS_JOIN=1 (its first processes join too): docs/slurm.md.
export RANK=${RANK:-$((${RANK_OFFSET:-0} + SLURM_PROCID))} WORLD_SIZE=${WORLD_SIZE:-$SLURM_NTASKS}
export LOCAL_RANK=${LOCAL_RANK:-$SLURM_LOCALID}

count=0
while :; do
    # bash's own notice of a killed child ("line N: PID Killed ...") names the line of this loop's end, not
    # this one: it goes to /dev/null (the 2>/dev/null around the braces), python's stderr does not (3);
    # the lines below say what happened, naming the rank and the script.
    { python "$@" 2>&3; } 3>&2 2>/dev/null
    status=$?
    if [ "$status" -eq 0 ]; then
        [ -n "${DONE_FILE:-}" ] && touch "$DONE_FILE"
        exit 0
    fi
    if [ "$status" -gt 128 ]; then
        reason="killed by SIG$(kill -l $((status - 128)))"
    elif [ "$status" -eq 75 ] || [ "$status" -eq 76 ]; then
        reason="exited with status $status"
    else
        exit "$status"  # the rank's own failure: a new process would repeat it
    fi
    if [ "$RESPAWNS" -eq 0 ]; then
        echo "respawn_task: rank $RANK $reason; not respawned (RESPAWNS=0)" >&2
        exit "$status"
    fi
    if [ "$count" -ge "$RESPAWNS" ]; then
        echo "respawn_task: rank $RANK $reason; no respawn left: $RESPAWNS of $RESPAWNS used" >&2
        exit "$status"
    fi
    count=$((count + 1))
    delay=$(awk -v b="$RESPAWN_BACKOFF" -v k="$count" 'BEGIN { d = b * 2 ^ (k - 1); m = (b > 30 ? b : 30); print (d > m ? m : d) }')
    echo "respawn_task: respawning rank $RANK (attempt $count of $RESPAWNS) in ${delay}s: $reason" >&2
    sleep "$delay"
    if [ -n "${DONE_FILE:-}" ] && [ -e "$DONE_FILE" ]; then
        echo "respawn_task: rank $RANK not respawned: the job is ending ($DONE_FILE exists)" >&2
        exit "$status"
    fi
    export INPROCESS_JOIN=1 INPROCESS_RESPAWN_COUNT=$count
done
