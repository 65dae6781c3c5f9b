#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, and the tiny DAG run through it and without it.
#
#   bash scripts/slurm_local.sh [WORKDIR]
#
# Needs root and Debian's `slurm-wlm` and `munge` packages (apt-get install slurm-wlm munge) plus
# snakemake-executor-plugin-slurm (pip install -e '.[cluster]'). It starts munged, slurmctld and
# slurmd on localhost with a config of its own, /etc/slurm/slurm.conf (SLURM's default place, which
# every srun inside a job reads; the script stops if another config is there, and removes its own at
# exit), with state and logs in WORKDIR/slurm, runs the tiny config's DAG once with `--executor slurm` (workflow/profiles/slurm) and once
# locally, and compares the outputs: the exit status is 0 only when every compared file is identical.
# The daemons it started are stopped at exit.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(realpath -m "${1:-$(mktemp -d /tmp/nanoeuler-slurm.XXXXXX)}")
CONF_DIR=$WORK/slurm
SLURM_CONF=/etc/slurm/slurm.conf
MARK="# one-node test cluster of scripts/slurm_local.sh"
NODE=$(hostname -s)
PIDS=()

log() { echo "slurm_local: $*" >&2; }

stop_cluster() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
    if head -1 "$SLURM_CONF" 2>/dev/null | grep -qF "$MARK"; then rm -f "$SLURM_CONF"; fi
}

write_conf() {
    local cpus mem
    cpus=$(nproc)
    mem=$(( $(awk '/MemAvailable/ {print $2}' /proc/meminfo) / 1024 / 2 ))  # half of what is free now, MB
    if [ -e "$SLURM_CONF" ] && ! head -1 "$SLURM_CONF" | grep -qF "$MARK"; then
        log "$SLURM_CONF exists: this machine has a SLURM of its own; not touching it"; exit 1
    fi
    mkdir -p "$CONF_DIR"/{state,spool,log} "$(dirname "$SLURM_CONF")"
    cat > "$SLURM_CONF" <<CONF
$MARK
ClusterName=nanoeuler-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$CONF_DIR/state
SlurmdSpoolDir=$CONF_DIR/spool
SlurmctldPidFile=$CONF_DIR/slurmctld.pid
SlurmdPidFile=$CONF_DIR/slurmd.pid
SlurmctldLogFile=$CONF_DIR/log/slurmctld.log
SlurmdLogFile=$CONF_DIR/log/slurmd.log
SlurmctldPort=$((6817 + RANDOM % 500 * 2))
SlurmdPort=$((7817 + RANDOM % 500 * 2))
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
ReturnToService=2
MinJobAge=3600
MpiDefault=none
NodeName=$NODE CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=local Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
CONF
}

start_cluster() {
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        runuser -u munge -- /usr/sbin/munged
        PIDS+=("$(cat /run/munge/munged.pid)")  # it forks into the background; stopped at exit like the rest
    fi
    munge -n | unmunge >/dev/null || { log "munge does not work"; exit 1; }
    slurmctld -D -f "$SLURM_CONF" > "$CONF_DIR/log/slurmctld.out" 2>&1 & PIDS+=($!)
    sleep 2
    slurmd -D -f "$SLURM_CONF" > "$CONF_DIR/log/slurmd.out" 2>&1 & PIDS+=($!)
    for _ in $(seq 60); do
        if sinfo -h -o %T 2>/dev/null | grep -q idle; then log "cluster up: $(sinfo -h -o '%P %D %c %m %T')"; return; fi
        sleep 1
    done
    log "the node did not come up; logs in $CONF_DIR/log"; exit 1
}

# the tiny config with job sizes that fit this machine (threads and memory come from the config), and
# shorter training: the point is the scheduler, not the model
write_run_config() {
    cat > "$WORK/fit.yaml" <<CONF
resources:
  cpu_threads: 1
  cpu_mem_mb: 2000
  cpu_runtime_min: 30
pretrain:
  steps: 60
  warmup_steps: 10
  eval_every: 30
  checkpoint_every: 30
sft:
  epochs: 1
eval:
  max_new_tokens: 8
  hellaswag_items: 4
CONF
}

run_dag() {  # run_dag DIR extra-snakemake-args...
    local dir=$1; shift
    mkdir -p "$dir"
    (cd "$dir" && snakemake -s "$REPO/Snakefile" -d "$dir" --cores 2 "$@" \
        --configfile "$REPO/config/tiny.yaml" "$WORK/fit.yaml" > "$dir/snakemake.log" 2>&1) \
        || { log "snakemake failed in $dir:"; tail -30 "$dir/snakemake.log" >&2; exit 1; }
}

# Every output file of the two runs must be identical, except the training speed (tokens_per_s) that
# the models' metadata and metrics.json record: model files are compared tensor by tensor.
compare_outputs() {
    python - "$WORK/local" "$WORK/slurm-run" <<'PY'
import json, sys
from pathlib import Path
import numpy as np
from nanoeuler import checkpoint

def without_speed(x):
    if isinstance(x, dict):
        return {k: without_speed(v) for k, v in x.items() if k != "tokens_per_s"}
    return [without_speed(v) for v in x] if isinstance(x, list) else x

def same(a: Path, b: Path) -> bool:
    if a.suffix == ".bin":
        (pa, ca, ma), (pb, cb, mb) = checkpoint.load_model(a), checkpoint.load_model(b)
        return (ca == cb and pa.keys() == pb.keys() and all(np.array_equal(pa[k], pb[k]) for k in pa)
                and without_speed(ma) == without_speed(mb))
    if a.name == "metrics.json":
        return without_speed(json.loads(a.read_text())) == without_speed(json.loads(b.read_text()))
    return a.read_bytes() == b.read_bytes()

local, slurm = Path(sys.argv[1]), Path(sys.argv[2])
files = sorted(p.relative_to(local) for top in ("data/corpus", "data/hellaswag", "results") for p in (local / top).rglob("*")
               if p.is_file() and p.suffix in (".parquet", ".jsonl", ".npy", ".bin", ".json", ".md", ".html")
               and not {"pretrain", "sft", "raw"} & set(p.relative_to(local).parts))
differ = [str(f) for f in files if not (slurm / f).exists() or not same(local / f, slurm / f)]
print(f"slurm_local: compared {len(files)} output files of the local and the SLURM run", file=sys.stderr)
for f in differ:
    print(f"slurm_local: differs: {f}", file=sys.stderr)
sys.exit(1 if differ or not files else 0)
PY
}

trap stop_cluster EXIT
write_conf
write_run_config
start_cluster
t0=$(date +%s)
run_dag "$WORK/slurm-run" --workflow-profile "$REPO/workflow/profiles/slurm" --jobs 4 \
    --slurm-status-command squeue --slurm-init-seconds-before-status-checks 1 --seconds-between-status-checks 2
t1=$(date +%s)
jobs=$(grep -c "submitted with SLURM jobid" "$WORK/slurm-run/snakemake.log" || true)
log "SLURM run: $((t1 - t0)) s, $jobs sbatch jobs"
run_dag "$WORK/local"
log "local run: $(( $(date +%s) - t1 )) s"
compare_outputs && log "OK: the SLURM run's outputs equal the local run's ($WORK)"
