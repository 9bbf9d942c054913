#!/usr/bin/env bash
# The H200 acceptance runs of issues 5, 7 and 8, in two device calls of under ten minutes each:
#
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_session.sh verify  $OUT
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_session.sh profile $OUT
#
# verify:  pytest -m gpu; the verify matrix (reference, te x interleaved, zbv x captured-copy, -direct,
#          20 steps of h2048); the torchao output head; the offload benchmark (off / release / resident,
#          bitwise and timings) for Interleaved and ZB-V.
# profile: `qeffect profile` matrices with trace summaries, h2048 and h4096, reference and te.
# Each step has its own time limit so that one hang cannot cost the others; logs and JSON go to OUT.
set -u
part=$1
out=$2
mkdir -p "$out"
export PYTHONUNBUFFERED=1
step() {  # step <seconds> <log name> <command...>
    local t=$1 name=$2
    shift 2
    echo "== $name: $*"
    timeout "$t" "$@" > "$out/$name.log" 2>&1
    echo "== $name: rc=$?"
    grep -E "passed|failed|ERROR|mismatch|median|x[0-9.]+ vs|bitwise|trace:|floor|returned|Error" "$out/$name.log" | tail -40
}
case $part in
verify)
    step 140 pytest python3 -m pytest -m gpu -q -p no:cacheprovider
    step 180 verify python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference,te --paths captured-copy,captured-direct --out "$out/verify"
    step 70 torchao python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference,te --schedules interleaved --paths captured-direct --head torchao --out "$out/torchao"
    step 80 offload-interleaved python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --steps 20 --out "$out/offload-bench-h2048-interleaved-h200.json"
    step 80 offload-zbv python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --schedule zbv --steps 20 --out "$out/offload-bench-h2048-zbv-h200.json"
    # only 8 files come back: merge the verify reports into one file each
    for d in verify torchao; do
        [ -f "$out/$d/gpu-check.json" ] && mv "$out/$d/gpu-check.json" "$out/$d-gpu-check.json"
        rm -rf "$out/$d"
    done
    ;;
profile)
    step 270 profile-h2048 python3 benchmarks/profile_matrix.py --out "$out" --only h2048:reference,h2048:te \
        --steps 20 --warmup 3 --trace 3
    step 300 profile-h4096 python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference,h4096:te \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
*)
    echo "usage: gpu_session.sh verify|profile OUT" >&2
    exit 2
    ;;
esac
