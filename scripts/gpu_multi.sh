#!/usr/bin/env bash
# Issue 10 on a machine with several GPUs, one device call per part (each under ten minutes):
#
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_multi.sh $OUT verify
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_multi.sh $OUT timing audit profile
#
# verify:  the 2-GPU NCCL tests (tests/test_verify_distributed.py -m gpu), then `qeffect verify-state` under torchrun
#          (PP=2, NCCL) for reference, te x interleaved, zbv, captured-direct, 20 steps of h2048.
# dp:      data-parallel replicas bitwise identical after every step under NCCL, captured-direct, h2048:
#          PP=1 x DP=2 on 2 GPUs, PP=2 x DP=2 on 4 (tests/test_distributed.py -m gpu); with 4 GPUs also
#          verify-state at PP=2 x DP=2 (h2048-pp2-dp2.toml) against native eager, replicas and reductions.
# timing:  benchmarks/pipeline_timing.py for h4096.toml at PP=2 (native eager and captured-direct) and,
#          with 4 GPUs, h4096-pp4.toml at PP=4; the --compare line when both ran.
# audit:   qeffect audit-megatron at PP=2 x VPP=2 (the PP=1 report is already committed).
# profile: qeffect profile under torchrun at PP=2 for h2048 and h4096 (te).
# Logs go to a tarball (only 8 files come back), JSON reports to OUT; a summary of each step to stdout.
set -u
out=$1
shift
mkdir -p "$out"
logs=$(mktemp -d)
export PYTHONUNBUFFERED=1
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $ngpu"
LOGS=$logs
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
merge_reports() {  # merge_reports <dir of JSON reports> <out file> <kind>: one file (only 8 come back)
    python3 - "$@" <<'PY'
import json, os, sys
from pathlib import Path
runs = {p.stem: json.loads(p.read_text()) for p in sorted(Path(sys.argv[1]).glob("*.json"))}
merged = {"kind": sys.argv[3], "git_revision": os.environ.get("QEFFECT_GIT_REVISION"), "runs": runs}
Path(sys.argv[2]).write_text(json.dumps(merged, indent=1))
print("reports passed:", {k: v.get("passed") for k, v in runs.items()})
PY
}
verify_matrix() {  # verify_matrix <processes> <config> <report dir>: reference, te x interleaved, zbv
    mkdir -p "$3"
    for backend in reference te; do
        for sched in interleaved zbv; do
            port=$((port + 1))
            step 120 "verify-$1-$backend-$sched" python3 -m torch.distributed.run --nproc-per-node "$1" \
                --master-port $port -m qeffect verify-state --config "$2" --backend $backend --schedule $sched \
                --path captured-direct --steps 20 --json "$3/$backend-$sched.json"
        done
    done
}
port=29611
for part in "$@"; do
case $part in
verify)
    step 120 pytest python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_verify_distributed.py
    verify_matrix 2 examples/configs/h2048.toml "$logs/verify"
    merge_reports "$logs/verify" "$out/verify-pp2-nccl-h2048-h200x2.json" "verify-state under torchrun, PP=2, NCCL"
    ;;
dp)
    step 200 pytest-dp python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_distributed.py
    if [ "$ngpu" -ge 4 ]; then  # run 2: PP=2 x DP=2 against native eager, replicas and reductions checked
        verify_matrix 4 examples/configs/h2048-pp2-dp2.toml "$logs/verify-dp"
        merge_reports "$logs/verify-dp" "$out/verify-pp2-dp2-nccl-h2048-h200x4.json" \
            "verify-state under torchrun, PP=2 x DP=2, NCCL"
    fi
    ;;
timing)
    for p in native captured-direct; do
        port=$((port + 1))
        flag=$([ $p = native ] && echo "--path eager --native" || echo "--path $p")
        step 150 "timing-pp2-$p" python3 -m torch.distributed.run --nproc-per-node 2 --master-port $port benchmarks/pipeline_timing.py --config examples/configs/h4096.toml \
            $flag --out "$out/timing-h4096-pp2-$p-h200.json"
        if [ "$ngpu" -ge 4 ]; then
            port=$((port + 1))
            step 150 "timing-pp4-$p" python3 -m torch.distributed.run --nproc-per-node 4 --master-port $port benchmarks/pipeline_timing.py \
                --config examples/configs/h4096-pp4.toml $flag --out "$out/timing-h4096-pp4-$p-h200.json"
            python3 benchmarks/pipeline_timing.py --compare "$out/timing-h4096-pp2-$p-h200.json" \
                "$out/timing-h4096-pp4-$p-h200.json"
        fi
    done
    ;;
audit)
    step 400 audit python3 -m qeffect audit-megatron --pipeline 2x2 --json "$out/audit-megatron-pp2-h200.json" \
        --log "$logs/audit-children.log"
    ;;
profile)
    for cfg in h2048 h4096; do
        port=$((port + 1))
        step 280 "profile-$cfg-pp2" python3 -m torch.distributed.run --nproc-per-node 2 --master-port $port -m qeffect profile --config examples/configs/$cfg.toml \
            --steps 12 --warmup 3 --trace 2 --json "$out/profile-$cfg-pp2-te-h200x2.json"
    done
    ;;
*)
    echo "usage: gpu_multi.sh OUT verify|dp|timing|audit|profile ..." >&2
    exit 2
    ;;
esac
done
tar czf "$out/logs-$(echo "$@" | tr ' ' '-').tar.gz" -C "$logs" .
