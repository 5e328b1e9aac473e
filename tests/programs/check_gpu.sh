#!/usr/bin/env bash
# `cachemgr check` on a GPU host, each prediction checked against what torch then does (a fresh
# process with TORCH_TRACE on). Run on the device machine from the repo root, through the `run`
# tool, with the wheels cachemgr needs carried in .whl/ (the device image lacks them):
#
#   run(command="bash tests/programs/check_gpu.sh", carry=[".whl"])
#
# Writes $OUT/check_gpu.jsonl: one row per case (predicted and seen, per graph), as tests/test_check.py.
#   gpu-same     the H200 fixture (torch 2.11, Triton 3.6) on this H200 with the same image: all hit
#   cpu-on-gpu   a CPU cache this torch wrote with no GPU visible, then checked and run with the GPU
#                visible: CPU graphs' keys hold the host's system info, so all miss (system_info named)
#   2.13-on-gpu  the torch 2.13 CPU fixture on this host: all miss (torch_version, system_info named)
set -uo pipefail
if [ -d .whl ] && [ -z "${SKIP_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests:$PWD/tests/programs PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/check-gpu-out}
mkdir -p "$OUT"
W=/tmp/check-gpu
rm -rf "$W" && mkdir -p "$W"
export CACHEMGR_DB=sqlite:///$W/index.db XDG_STATE_HOME=$W/state
python3 -c "from tests.test_check import WORKLOAD_MANIFEST as M; print(M % '{ epilogue_fusion = false }')" \
    > "$W/m.toml" || exit 1

case_run() {  # NAME CACHE_DIR CHECK_ARGS -- WORKLOAD...
    local name=$1 cache=$2 args=$3
    shift 4
    python3 -m cachemgr --host h200 --cache-dir "$cache" check $args --json > "$W/$name.check.json" \
        2> "$W/$name.check.err" || { tail -5 "$W/$name.check.err"; return; }
    TORCH_TRACE="$W/$name.trace" TORCHINDUCTOR_CACHE_DIR="$cache" python3 "$@" > "$W/$name.run.out" \
        2> "$W/$name.run.err" || { tail -5 "$W/$name.run.err"; return; }
    python3 - "$name" "$W" <<'EOF' >> "$OUT/check_gpu.jsonl"
import json, sys
from pathlib import Path
from tests.test_check import outcome
name, w = sys.argv[1], Path(sys.argv[2])
report = json.loads((w / f"{name}.check.json").read_text())
hits, misses = outcome(w / f"{name}.trace")
seen = {"hit": 0, "miss": 0}
wrong = []
for p in report["predictions"]:
    got = "hit" if p["graph_key"] in hits else "miss"
    seen[got] += 1
    if p["verdict"] != "unknown" and p["verdict"] != got:
        wrong.append([p["graph_key"], p["verdict"], got])
print(json.dumps({"case": name, "graphs": report["graphs"],
                  "predicted": {v: report[v] for v in ("hit", "miss", "unknown")}, "seen": seen,
                  "trace_hits": len(hits), "trace_misses": misses, "wrong": wrong,
                  "causes": [s["text"] for s in report["summary"]], "host": report["host"],
                  "named": sorted({d["name"] for p in report["predictions"] for ds in p["groups"].values()
                                   for d in ds if d["certain"]})}))
EOF
    tail -1 "$OUT/check_gpu.jsonl"
}

mkdir -p "$W/gpu-same" && tar -C "$W/gpu-same" -xzf tests/fixtures/gpu/torch-2.11-h200-triton.tar.gz
case_run gpu-same "$W/gpu-same" "" -- tests/fixtures/gpu/make_gpu_cache.py triton --run 3

CUDA_VISIBLE_DEVICES= TORCHINDUCTOR_CACHE_DIR="$W/cpu-on-gpu" python3 tests/programs/check_workload.py mlp \
    > "$W/cpu-made.out" 2>&1 || tail -5 "$W/cpu-made.out"
CUDA_VISIBLE_DEVICES= python3 -m cachemgr --host h200 --cache-dir "$W/cpu-on-gpu" check --manifest "$W/m.toml" \
    --json > "$W/cpu-same-no-gpu.json" 2>/dev/null && python3 -c "
import json; d = json.load(open('$W/cpu-same-no-gpu.json')); print('control, GPU hidden:', d['hit'], 'of', d['graphs'], 'hit')"
case_run cpu-on-gpu "$W/cpu-on-gpu" "--manifest $W/m.toml" -- tests/programs/check_workload.py mlp

mkdir -p "$W/213" && tar -C "$W/213" -xzf tests/fixtures/caches/torch-2.13.0-cpu.tar.gz
case_run 2.13-on-gpu "$W/213" "" -- tests/fixtures/make_cache.py
cp "$W"/*.check.json "$OUT/" 2>/dev/null
ls "$OUT"
