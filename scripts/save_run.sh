#!/usr/bin/env bash
# Saves a GPU run into the repository: unpacks the archive of a
# scripts/gpu_check.sh output folder (run.json, test logs and gtest JSON,
# bench JSON and logs, summary.txt) into bench/runs/<id>/, <id> being the
# run id of its run.json (<date>-<gpu>-<commit>). A second part of the same
# run (another gpu_check.sh on the same machine and commit: tests in one,
# benches in the other) is merged into the folder; its header is kept in
# run.json under "parts", its summary appended to summary.txt, its tests.json
# merged, and any other file the folder already has kept as NAME.partN.EXT.
#
# Usage: scripts/save_run.sh RUN.tgz [ID]   (ID overrides the id of run.json)
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/save_run.sh RUN.tgz [ID]" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar xzf "$1" -C "$tmp"
[ -f "$tmp/run.json" ] || { echo "save_run: $1 has no run.json" >&2; exit 1; }
id=${2:-$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['id'])" "$tmp/run.json")}
dest=bench/runs/$id
mkdir -p "$dest"
python3 - "$tmp" "$dest" "$id" <<'PY'
import json, os, shutil, sys
src, dest, run_id = sys.argv[1:]
new = json.load(open(os.path.join(src, "run.json")))
new["id"] = run_id
head_path = os.path.join(dest, "run.json")
part = 1
if os.path.exists(head_path):
    head = json.load(open(head_path))
    head.setdefault("parts", []).append(new)
    part = len(head["parts"]) + 1
else:
    head = new
for name in sorted(os.listdir(src)):
    p = os.path.join(src, name)
    if not os.path.isfile(p) or name == "run.json":
        continue
    q = os.path.join(dest, name)
    if name == "summary.txt" and os.path.exists(q):
        with open(q, "a") as f:
            f.write("\n" + open(p).read())
    elif name == "tests.json" and os.path.exists(q):
        merged = json.load(open(q))
        merged.update(json.load(open(p)))
        json.dump(merged, open(q, "w"), indent=1, sort_keys=True)
    elif os.path.exists(q):
        # A file the earlier part has too (its gpu_check.log, nvidia-smi.txt):
        # kept beside it as NAME.partN.EXT.
        stem, ext = os.path.splitext(name)
        shutil.copyfile(p, os.path.join(dest, f"{stem}.part{part}{ext}"))
    else:
        shutil.copyfile(p, q)
json.dump(head, open(head_path, "w"), indent=2)
print(dest)
PY
du -sh "$dest"
