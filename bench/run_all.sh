#!/bin/sh
# Issue 17's benches, each at 100,000 and 1,000,000 files, with ratios to baselines measured in the
# same run (as run on the 16-core GPU host and on 2 cores). Trees are hard links to the H200
# fixture (bench/synth.py): the 1,000,000-file tree is built once and shared by scan and daemon.
#
#   bench/run_all.sh [WORK DIR] [OUT DIR] [SIZES]      e.g. bench/run_all.sh /tmp/cmb out "100000 1000000"
#
# Each bench's output goes to OUT DIR/<bench>-<files>.txt (and .json where it writes one).
set -u
W=${1:-/tmp/cachemgr-bench}
O=${2:-.}
SIZES=${3:-"100000 1000000"}
PY=${PYTHON:-python3}
mkdir -p "$W" "$O"
export PYTHONUNBUFFERED=1
df -h "$W" | tail -1
for n in $SIZES; do
    reps=3; [ "$n" -ge 1000000 ] && reps=1
    echo "== scan $n"; $PY bench/scan.py --files "$n" --keep "$W/tree-$n" --repeat "$reps" --json "$O/scan-$n.json" 2>&1 | tee "$O/scan-$n.txt"
    echo "== daemon $n"; $PY bench/daemon.py --files "$n" --keep "$W/tree-$n" --idle 5 --burst 1000 2>&1 | tee "$O/daemon-$n.txt"
    echo "== evict $n"; $PY bench/evict.py --files "$n" --dir "$W" --json "$O/evict-$n.json" 2>&1 | tee "$O/evict-$n.txt"
done
echo "== record"; $PY bench/record.py --out "$O/record.json" 2>&1 | tee "$O/record.txt"
