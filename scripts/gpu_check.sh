#!/usr/bin/env bash
# The whole GPU check in one device call (from the repository root on the H200):
#   source .gpu-kit/setup.sh && bash scripts/gpu_check.sh [quick]
# Runs the gpu-marked tests, then verify-state on CUDA for every captured path, schedule and backend,
# and merges every report into $OUT/gpu-check.json (the device tool brings back at most 8 files).
set -u
OUT=${OUT:-/tmp/qeffect-gpu}
mkdir -p "$OUT/reports"
MODE=${1:-full}
CONFIG=${CONFIG:-examples/configs/h2048.toml}
STEPS=${STEPS:-20}
BACKENDS=${BACKENDS:-reference te}
PATHS=${PATHS:-eager captured-copy captured-direct}
export PYTHONUNBUFFERED=1
if [ "$MODE" = "quick" ]; then CONFIG=src/qeffect/configs/tiny.toml; STEPS=3; fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$MODE" != "quick" ] && [ "${SKIP_PYTEST:-0}" != 1 ]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tail -25
fi
for backend in $BACKENDS; do
  for sched in interleaved zbv; do
    for path in $PATHS; do
      name="verify-$backend-$sched-$path"
      echo "== $name ($CONFIG, $STEPS steps)"
      python3 -m qeffect verify-state --device cuda --config "$CONFIG" --backend "$backend" --schedule "$sched" \
        --path "$path" --steps "$STEPS" --json "$OUT/reports/$name.json" 2>&1 | tail -16
    done
  done
done
python3 - "$OUT" <<'PY'
import json, pathlib, subprocess, sys
out = pathlib.Path(sys.argv[1])
reports = {p.stem: json.loads(p.read_text()) for p in sorted((out / "reports").glob("*.json"))}
rev = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
(out / "gpu-check.json").write_text(json.dumps({"git_revision": rev, "reports": reports}, indent=1))
for k, r in reports.items():
    g = r.get("graphs") or {}
    print(f"{k}: passed={r['passed']} mismatches={sum(c['mismatches'] for c in r['categories'])} "
          f"graphs/rank={g.get('graphs_per_rank')} growth/step={g.get('persistent_growth_bytes_per_step')} "
          f"{r['seconds']:.1f}s")
PY
