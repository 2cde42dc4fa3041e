#!/usr/bin/env bash
# Installs the Debian packages fp4kv builds against, if any is missing.
# The CUDA toolkit itself (nvcc) must already be installed.
#   bash scripts/install_deps.sh            # the C++ build
#   bash scripts/install_deps.sh --python   # also what the Python package and its tests
#                                           # need: Python headers (Debian), then nanobind,
#                                           # scikit-build-core, numpy and pytest from PyPI
#                                           # into the environment of ${PYTHON:-python3}
set -euo pipefail
pkgs=(cmake g++ make libabsl-dev libgtest-dev libbenchmark-dev libdlpack-dev libxxhash-dev)
python=${PYTHON:-python3}
if [ "${1:-}" = "--python" ]; then
  # Debian's own python3 needs its headers, venv and pip packages; another
  # interpreter (pyenv, conda) brings its own.
  if ! command -v "$python" >/dev/null 2>&1 || [ "$(command -v "$python")" = /usr/bin/python3 ]; then
    pkgs+=(python3 python3-dev python3-venv python3-pip)
  fi
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
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
if [ "${1:-}" = "--python" ]; then
  # Debian has no nanobind or scikit-build-core for every interpreter: PyPI wheels.
  if ! "$python" -c "import nanobind, scikit_build_core, numpy, pytest" >/dev/null 2>&1; then
    echo "installing into $("$python" -c 'import sys; print(sys.prefix)'): nanobind scikit-build-core numpy pytest"
    "$python" -m pip install -q --disable-pip-version-check "nanobind>=2.2" "scikit-build-core>=0.10" numpy pytest
  fi
fi
