#!/usr/bin/env bash
# Captured fresh-process resume on the H200 (issue 6), for each "config schedule" pair given:
#   source .gpu-kit/setup.sh && bash scripts/gpu_resume_all.sh OUTDIR "tiny.toml interleaved" ...
set -u
OUT=$1; shift
D=$(mktemp -d)
for pair in "$@"; do
  set -- $pair
  tag=$(basename "$1" .toml)-$2
  C="--config $1 --schedule $2"
  echo "== $tag"
  python3 scripts/gpu_resume_check.py run $C --steps 8 --dir "$D/$tag/full" 2>&1 | tail -2
  python3 scripts/gpu_resume_check.py run $C --steps 3 --dir "$D/$tag/part" 2>&1 | tail -2
  python3 scripts/gpu_resume_check.py run $C --steps 8 --dir "$D/$tag/resumed" --resume "$D/$tag/part/step-3" 2>&1 | tail -2
  python3 scripts/gpu_resume_check.py diff "$D/$tag/full/step-8" "$D/$tag/resumed/step-8" --json "$OUT/resume-$tag.json" 2>&1 | tail -2
done
