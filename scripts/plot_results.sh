#!/usr/bin/env bash
# Draws the pictures of a saved run into docs/img (scripts/plot_results.py), after
# installing matplotlib into ${PYTHON:-python3}'s environment if it is missing (a
# docs-only dependency: nothing else of fp4kv needs it).
#   bash scripts/plot_results.sh [--run ID] [--runs DIR] [--out DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if ! "$python" -c "import matplotlib" >/dev/null 2>&1; then
  echo "installing matplotlib into $("$python" -c 'import sys; print(sys.prefix)')"
  "$python" -m pip install -q --disable-pip-version-check --root-user-action=ignore matplotlib
fi
exec "$python" scripts/plot_results.py "$@"
