#!/usr/bin/env bash
# Installs the Debian packages fp4kv builds against, if any is missing.
# The CUDA toolkit itself (nvcc) must already be installed.
set -euo pipefail
pkgs=(cmake g++ make libabsl-dev libgtest-dev libbenchmark-dev libdlpack-dev libxxhash-dev)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v nvcc >/dev/null 2>&1; then
  if [ -x /usr/local/cuda/bin/nvcc ]; then
    echo "note: nvcc is not on PATH; scripts use /usr/local/cuda/bin" >&2
  else
    echo "error: the CUDA toolkit (nvcc) is required" >&2
    exit 1
  fi
fi
