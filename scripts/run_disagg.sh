#!/usr/bin/env bash
# Runs examples/disagg_prefill_decode: rank 0 (prefill) on GPU 0 and rank 1
# (decode) on GPU 1 as two processes that meet through an NCCL id file.
# Refuses (exit 2) with fewer than two GPUs.
#
# Usage: scripts/run_disagg.sh [BIN_DIR] [flags for the example...]
#   BIN_DIR  folder with disagg_prefill_decode (default build; .carry/bin
#            after scripts/package_for_gpu.sh, whose .carry/lib is then used)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN_DIR=${1:-build}
shift || true
if [ -d ./.carry/lib ]; then
  export LD_LIBRARY_PATH="$(cd ./.carry/lib && pwd)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
source scripts/nccl_env.sh
exe="$BIN_DIR/disagg_prefill_decode"
if [ ! -x "$exe" ]; then
  echo "run_disagg: no $exe (it is built only when CMake found nccl.h)" >&2
  exit 2
fi
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ "${gpus:-0}" -lt 2 ]; then
  echo "run_disagg: needs 2 GPUs (one per process), found ${gpus:-0}" >&2
  exit 2
fi
id_file=$(mktemp -u /tmp/fp4kv-nccl-id.XXXXXX)
trap 'rm -f "$id_file" "$id_file.tmp"' EXIT
"$exe" --rank=1 --id-file="$id_file" "$@" &
decode=$!
rc=0
"$exe" --rank=0 --id-file="$id_file" "$@" || rc=$?
if ! wait "$decode"; then
  r=$?
  [ "$rc" -eq 0 ] && rc=$r
fi
exit "$rc"
