#!/usr/bin/env bash
# Run corl_jax on a Cloud TPU VM slice: create (or reuse) it, ship this checkout, install `.[tpu]` on every worker,
# start the same `python -m corl_jax.train` on all workers and stream worker 0's log. See docs/tpu.md.
#
#   tpu_scripts/launch.sh [--dry-run] train  --name=N --accelerator-type=v5e-8 --config=configs/ring3.py
#                                            --workdir=gs://BUCKET/runs/ring3 [-- --config.key=value ...]
#   tpu_scripts/launch.sh [--dry-run] up     --name=N --accelerator-type=v5p-32     (create/reuse + ship + install)
#   tpu_scripts/launch.sh [--dry-run] ssh    --name=N [--worker=0] [-- COMMAND]
#   tpu_scripts/launch.sh [--dry-run] stop   --name=N
#   tpu_scripts/launch.sh [--dry-run] delete --name=N
#
# Options (or the environment variable in brackets):
#   --project [PROJECT]     GCP project (default: gcloud's configured project)
#   --zone [ZONE]           TPU zone (required)
#   --name [TPU_NAME]       TPU VM / queued resource name (required)
#   --accelerator-type [ACCELERATOR_TYPE]  v5e-N (= v5litepod-N), v5litepod-N, v6e-N, v5p-N, v4-N, v3-N, v2-N
#   --runtime-version [RUNTIME_VERSION]    default per generation (v2-alpha-tpuv5-lite, v2-alpha-tpuv6e,
#                           v2-alpha-tpuv5, tpu-ubuntu2204-base)
#   --spot | --reserved     capacity type (default on-demand)
#   --queued                request the slice as a queued resource and wait until it is ACTIVE
#   --ref=GIT_REF           ship `git archive GIT_REF` (default: the checkout's files, uncommitted edits included)
#   --config, --workdir     the run (train); on a multi-host slice the workdir must be on gs://
#   --dry-run               print every command instead of running it (gcloud is not called)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REMOTE_DIR="corl_jax"                  # on each worker, relative to the login user's home
REMOTE_LOG="corl_jax_train.log"

die() { echo "launch.sh: error: $*" >&2; exit 2; }

DRY_RUN=0 QUEUED=0 CAPACITY="" WORKER=0 REF="" CONFIG="" WORKDIR=""
PROJECT="${PROJECT:-}" ZONE="${ZONE:-}" NAME="${TPU_NAME:-}" TYPE="${ACCELERATOR_TYPE:-}"
RUNTIME="${RUNTIME_VERSION:-}" COMMAND="" EXTRA=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --queued) QUEUED=1 ;;
    --spot) CAPACITY="--spot" ;;
    --reserved) CAPACITY="--reserved" ;;
    --project=*) PROJECT="${1#*=}" ;;
    --zone=*) ZONE="${1#*=}" ;;
    --name=*) NAME="${1#*=}" ;;
    --accelerator-type=*) TYPE="${1#*=}" ;;
    --runtime-version=*) RUNTIME="${1#*=}" ;;
    --worker=*) WORKER="${1#*=}" ;;
    --ref=*) REF="${1#*=}" ;;
    --config=*) CONFIG="${1#*=}" ;;
    --workdir=*) WORKDIR="${1#*=}" ;;
    --) shift; EXTRA=("$@"); break ;;
    up|train|ssh|stop|delete) [[ -z "$COMMAND" ]] || die "two commands: $COMMAND and $1"; COMMAND="$1" ;;
    *) die "unknown argument '$1' (see the usage at the top of tpu_scripts/launch.sh)" ;;
  esac
  shift
done
[[ -n "$COMMAND" ]] || die "no command; use one of: up, train, ssh, stop, delete"
[[ -n "$NAME" ]] || die "--name (or TPU_NAME) is required: the TPU VM's name"
[[ -n "$ZONE" ]] || die "--zone (or ZONE) is required, e.g. --zone=us-west4-a"

quote() {  # one word as a POSIX shell reads it back (Python's shlex.quote)
  if [[ "$1" =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then printf '%s' "$1"; else printf "'%s'" "${1//\'/\'\"\'\"\'}"; fi
}
join() { local out="" w; for w in "$@"; do out+="${out:+ }$(quote "$w")"; done; printf '%s' "$out"; }
run() {  # print the command in dry-run mode, else run it
  if [[ $DRY_RUN -eq 1 ]]; then join "$@"; echo; else "$@"; fi
}

# gcloud must be installed and logged in (not needed to print commands)
if [[ $DRY_RUN -eq 0 ]]; then
  command -v gcloud >/dev/null || die "gcloud not found on PATH; install the Google Cloud CLI (https://cloud.google.com/sdk/docs/install)"
  [[ -n "$(gcloud auth list --filter=status:ACTIVE --format='value(account)' 2>/dev/null)" ]] \
    || die "gcloud has no active account; run 'gcloud auth login' (or activate a service account) first"
  [[ -n "$PROJECT" ]] || PROJECT="$(gcloud config get-value project 2>/dev/null || true)"
fi
[[ -n "$PROJECT" && "$PROJECT" != "(unset)" ]] || die "no project: pass --project=ID (or PROJECT=ID, or 'gcloud config set project ID')"
LOC=(--zone="$ZONE" --project="$PROJECT")

# accelerator type -> gcloud name, runtime, hosts. v5e/v6e count chips (4 per host on multi-host slices, up to 8 on
# one host); v4/v5p count TensorCores (2 per chip, 4 chips per host); v2/v3 count cores (8 per host).
# Every generation's slices above 8 are multi-host.
slice_info() {
  [[ -n "$TYPE" ]] || die "--accelerator-type (or ACCELERATOR_TYPE) is required, e.g. v5e-8 or v5p-32"
  [[ "$TYPE" =~ ^(v5e|v5litepod|v6e|v5p|v4|v3|v2)-([0-9]+)$ ]] \
    || die "unknown accelerator type '$TYPE'; use v5e-N, v5litepod-N, v6e-N, v5p-N, v4-N, v3-N or v2-N"
  local generation="${BASH_REMATCH[1]}" size="${BASH_REMATCH[2]}" runtime
  case "$generation" in
    v5e|v5litepod) GCLOUD_TYPE="v5litepod-$size"; runtime="v2-alpha-tpuv5-lite"; HOSTS=$(( size > 8 ? size / 4 : 1 )) ;;
    v6e) GCLOUD_TYPE="v6e-$size"; runtime="v2-alpha-tpuv6e"; HOSTS=$(( size > 8 ? size / 4 : 1 )) ;;
    v5p) GCLOUD_TYPE="v5p-$size"; runtime="v2-alpha-tpuv5"; HOSTS=$(( size > 8 ? size / 8 : 1 )) ;;
    *) GCLOUD_TYPE="$generation-$size"; runtime="tpu-ubuntu2204-base"; HOSTS=$(( size > 8 ? size / 8 : 1 )) ;;
  esac
  RUNTIME="${RUNTIME:-$runtime}"
}

create_or_reuse() {
  slice_info
  if [[ $QUEUED -eq 1 ]]; then
    if [[ $DRY_RUN -eq 1 ]] || ! gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" \
        --format='value(state.state)' >/dev/null 2>&1; then
      run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${LOC[@]}" \
        --accelerator-type="$GCLOUD_TYPE" --runtime-version="$RUNTIME" ${CAPACITY:+"$CAPACITY"}
    fi
    if [[ $DRY_RUN -eq 0 ]]; then
      local state
      while state="$(gcloud compute tpus queued-resources describe "$NAME" "${LOC[@]}" --format='value(state.state)')";
            [[ "$state" != "ACTIVE" ]]; do
        [[ "$state" == "FAILED" || "$state" == "SUSPENDED" ]] && die "queued resource $NAME is $state; delete it and retry"
        echo "launch.sh: queued resource $NAME is $state; waiting" >&2
        sleep "${POLL_SECONDS:-30}"
      done
    fi
  elif [[ $DRY_RUN -eq 1 ]] || ! gcloud compute tpus tpu-vm describe "$NAME" "${LOC[@]}" \
      --format='value(state)' >/dev/null 2>&1; then
    run gcloud compute tpus tpu-vm create "$NAME" "${LOC[@]}" --accelerator-type="$GCLOUD_TYPE" \
      --version="$RUNTIME" ${CAPACITY:+"$CAPACITY"}
  else
    echo "launch.sh: reusing TPU VM $NAME" >&2
  fi
}

ship_and_install() {
  local tarball="${TMPDIR:-/tmp}/corl_jax-$NAME.tgz"
  if [[ $DRY_RUN -eq 0 ]]; then
    if [[ -n "$REF" ]]; then
      git -C "$ROOT" archive --format=tar.gz -o "$tarball" "$REF"
    else  # the checkout as it is: tracked and untracked files, minus what git ignores
      (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | tar czf "$tarball" --null -T -)
    fi
  fi
  run gcloud compute tpus tpu-vm scp "$tarball" "$NAME:$REMOTE_DIR.tgz" --worker=all "${LOC[@]}"
  run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" --command="rm -rf $REMOTE_DIR && mkdir -p \
$REMOTE_DIR && tar xzf $REMOTE_DIR.tgz -C $REMOTE_DIR && python3 -m pip install -q -e \"./$REMOTE_DIR[tpu]\""
}

train() {
  [[ -n "$CONFIG" ]] || die "--config=configs/<name>.py[:variant] is required"
  [[ -n "$WORKDIR" ]] || die "--workdir is required (gs://BUCKET/PATH for checkpoints, metrics and TensorBoard)"
  slice_info
  local distributed=""
  if [[ $HOSTS -gt 1 ]]; then
    [[ "$WORKDIR" == gs://* ]] || die "$TYPE has $HOSTS hosts: --workdir must be on shared storage (gs://BUCKET/PATH), \
not '$WORKDIR' (each worker would write its own local copy)"
    distributed="--distributed"
  fi
  create_or_reuse
  ship_and_install
  local args; args="$(join python3 -m corl_jax.train --config="$CONFIG" --workdir="$WORKDIR" \
    ${distributed:+"$distributed"} ${EXTRA[@]+"${EXTRA[@]}"})"
  run gcloud compute tpus tpu-vm ssh "$NAME" --worker=all "${LOC[@]}" \
    --command="cd $REMOTE_DIR && nohup $args > ~/$REMOTE_LOG 2>&1 &"
  run gcloud compute tpus tpu-vm ssh "$NAME" --worker=0 "${LOC[@]}" --command="tail -n +1 -F ~/$REMOTE_LOG"
}

case "$COMMAND" in
  up) create_or_reuse; ship_and_install ;;
  train) train ;;
  ssh) run gcloud compute tpus tpu-vm ssh "$NAME" --worker="$WORKER" "${LOC[@]}" \
         ${EXTRA[@]+--command="${EXTRA[*]}"} ;;
  stop)
    [[ $QUEUED -eq 0 ]] || die "a queued resource cannot be stopped, only deleted: use 'delete --queued'"
    run gcloud compute tpus tpu-vm stop "$NAME" "${LOC[@]}" ;;
  delete)
    if [[ $QUEUED -eq 1 ]]; then
      run gcloud compute tpus queued-resources delete "$NAME" "${LOC[@]}" --force --quiet
    else
      run gcloud compute tpus tpu-vm delete "$NAME" "${LOC[@]}" --quiet
    fi ;;
esac
