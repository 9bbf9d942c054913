#!/usr/bin/env bash
# The GPU checks, one part per call of at most ~8 minutes (see docs/gpu.md):
#
#   source .gpu-kit/setup.sh
#   QEFFECT_GIT_REVISION=<rev> bash scripts/gpu/check.sh PART OUTDIR
#
# Parts (about how long on one H200; multi and megatron's PP=2 need more GPUs):
#   tests-kernels    pytest -m gpu, the kernel and optimizer test files                     (~2-4 min)
#   tests-pipelines  pytest -m gpu, every other test file (captured pipelines, offload, TE)  (~2-4 min)
#   verify           bitwise matrix at h2048: reference, te x Interleaved, ZB-V x captured-copy,
#                    captured-direct; the torchao head; captured resume in a fresh process   (~5-6 min)
#   offload          qeffect offload-check; offload_bench.py off / release / resident at h2048
#                    (both schedules) and h4096 Interleaved, bitwise and timed                (~5 min)
#   profile-h2048    qeffect profile matrices (benchmarks/profile_matrix.py), te and reference (~4 min)
#   profile-h4096    the same at h4096, then scripts/step_gaps.py on the h4096 te step      (~5 min)
#   multi            2+ GPUs under torchrun/NCCL: verify-state PP=2 (PP=2 x DP=2 with 4 GPUs),
#                    fixed-work timing PP=2 (against PP=4 with 4 GPUs)                      (~6 min)
#   megatron         qeffect audit-megatron (PP=1; PP=2 x VPP=2 with 2 GPUs)                (~3-5 min)
#
# Logs go to OUTDIR/check-PART.log, reports (JSON) beside it: at most 7 files per part. A failed step
# does not stop the part; the exit status is 1 if any step failed. CHECK_DRY_RUN=1 prints the commands.
# Reports record the revision from QEFFECT_GIT_REVISION (the device copy of the tree has no .git) or git.

if [ $# -ne 2 ]; then
    echo "usage: bash scripts/gpu/check.sh tests-kernels|tests-pipelines|verify|offload|profile-h2048|profile-h4096|multi|megatron OUTDIR" >&2
    exit 2
fi
part=$1
case $part in
tests-kernels|tests-pipelines|verify|offload|profile-h2048|profile-h4096|multi|megatron) ;;
*) echo "unknown part '$part'; parts: tests-kernels tests-pipelines verify offload profile-h2048 profile-h4096 multi megatron" >&2
   exit 2 ;;
esac
# shellcheck source=scripts/gpu/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$(dirname "$0")/../.." || exit 2
check_begin "$part" "$2"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
H2048=examples/configs/h2048.toml
H4096=examples/configs/h4096.toml
PYTEST=(python3 -m pytest -m gpu -q -p no:cacheprovider --durations=15)
# the kernel and optimizer tests; tests-pipelines runs every other file (a new test file lands there)
KERNEL_TESTS=(tests/test_fused_quantize_gpu.py tests/test_fused_update_gpu.py tests/test_fp8_reference.py
              tests/test_layernorm.py tests/test_cross_entropy.py tests/test_embedding_grad.py
              tests/test_adamw.py tests/test_lazy_rows.py tests/test_accumulate_gpu.py)

keep() {  # keep SRC DEST: copy one report out of the scratch folder (only a few files come back)
    [ -n "${CHECK_DRY_RUN:-}" ] && return 0
    if [ -f "$1" ]; then cp "$1" "$2"; else echo "== no report: $1"; fi
}

case $part in
tests-kernels)
    step pytest-kernels 480 "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
    ;;
tests-pipelines)
    ignore=()
    for f in "${KERNEL_TESTS[@]}"; do ignore+=("--ignore=$f"); done
    step pytest-pipelines 480 "${PYTEST[@]}" "${ignore[@]}" tests
    ;;
verify)
    step verify-matrix 240 python3 scripts/gpu_check.py --config $H2048 --steps 20 --backends reference,te \
        --schedules interleaved,zbv --paths captured-copy,captured-direct --out "$tmp/matrix"
    keep "$tmp/matrix/gpu-check.json" "$OUT/verify-matrix-h2048.json"
    step verify-torchao-head 90 python3 scripts/gpu_check.py --config $H2048 --steps 20 --backends reference,te \
        --schedules interleaved --paths captured-direct --head torchao --out "$tmp/torchao"
    keep "$tmp/torchao/gpu-check.json" "$OUT/verify-torchao-head-h2048.json"
    # captured resume: an uninterrupted run to step 8 against one saved at 3 and resumed in a fresh process
    # (h2048 with te, Interleaved; the tiny config with reference, ZB-V)
    mkdir -p "$tmp/resume"
    resumed=()
    for combo in "h2048 interleaved te" "tiny zbv reference"; do
        read -r cfg sched backend <<< "$combo"
        tag=$cfg-$sched-$backend
        run=(python3 scripts/gpu_resume_check.py run --config "examples/configs/$cfg.toml" --schedule "$sched"
             --backend "$backend")
        step "resume-$tag-full" 90 "${run[@]}" --steps 8 --dir "$tmp/$tag/full"
        step "resume-$tag-part" 60 "${run[@]}" --steps 3 --dir "$tmp/$tag/part"
        step "resume-$tag-resumed" 90 "${run[@]}" --steps 8 --dir "$tmp/$tag/resumed" --resume "$tmp/$tag/part/step-3"
        step "resume-$tag-diff" 30 python3 scripts/gpu_resume_check.py diff "$tmp/$tag/full/step-8" \
            "$tmp/$tag/resumed/step-8" --json "$tmp/resume/$tag.json"
        resumed+=("$tmp/resume/$tag.json")
    done
    merge_json "captured resume: step 8 uninterrupted vs saved at 3 and resumed in a fresh process" \
        "$OUT/resume-captured.json" "${resumed[@]}"
    ;;
offload)
    step offload-check 90 python3 -m qeffect offload-check --json "$OUT/offload-check.json"
    # offload_bench.py's default modes: off, release, resident ([offload] mode); every mode alive, timed in
    # rotating rounds of 2 steps
    for sched in interleaved zbv; do
        step "offload-h2048-$sched" 130 python3 benchmarks/offload_bench.py --config $H2048 --schedule "$sched" \
            --steps 40 --interleave 2 --out "$OUT/offload-bench-h2048-$sched.json"
    done
    step offload-h4096-interleaved 200 python3 benchmarks/offload_bench.py --config $H4096 --schedule interleaved \
        --steps 30 --interleave 2 --out "$OUT/offload-bench-h4096-interleaved.json"
    ;;
profile-h2048)
    # writes profile-h2048-<backend>-<gpu>.json; figures afterwards: qeffect profile --report FILE --plot DIR
    step profile-h2048-te 240 python3 benchmarks/profile_matrix.py --out "$OUT" --only h2048:te \
        --steps 20 --warmup 3 --trace 2 --microbatches 2,4,8,16
    step profile-h2048-reference 200 python3 benchmarks/profile_matrix.py --out "$OUT" --only h2048:reference \
        --steps 20 --warmup 3 --trace 3 --microbatches 2,4,8,16
    ;;
profile-h4096)
    step profile-h4096-te 220 python3 benchmarks/profile_matrix.py --out "$OUT" --only h4096:te \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    step profile-h4096-reference 180 python3 benchmarks/profile_matrix.py --out "$OUT" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    step step-gaps-h4096-te 100 python3 scripts/step_gaps.py --config $H4096 --json "$OUT/step-gaps-h4096-te.json"
    ;;
multi)
    if [ "$NGPU" -lt 2 ]; then
        echo "multi needs 2 or more GPUs; $NGPU here" >&2
        exit 2
    fi
    # the NCCL pytest cases (tests/test_distributed.py, test_verify_distributed.py) run in tests-pipelines
    port=29611  # each torchrun on a fresh port (a finished one's may still be in TIME_WAIT)
    torchrun_cmd() { port=$((port + 1)); RUN=(python3 -m torch.distributed.run --nproc-per-node "$1" --master-port $port); }
    if [ "$NGPU" -ge 4 ]; then
        n=4 cfg=examples/configs/h2048-pp2-dp2.toml name=verify-pp2-dp2-nccl-h2048 what="PP=2 x DP=2"
    else
        n=2 cfg=$H2048 name=verify-pp2-nccl-h2048 what="PP=2"
    fi
    mkdir -p "$tmp/verify"
    reports=()
    for backend in reference te; do
        for sched in interleaved zbv; do
            torchrun_cmd $n
            step "verify-$backend-$sched" 120 "${RUN[@]}" -m qeffect verify-state --config $cfg --backend $backend \
                --schedule $sched --path captured-direct --steps 20 --json "$tmp/verify/$backend-$sched.json"
            reports+=("$tmp/verify/$backend-$sched.json")
        done
    done
    merge_json "verify-state under torchrun, $what, NCCL, captured-direct" "$OUT/$name.json" "${reports[@]}"
    # fixed work: the h4096 model as PP=2 with two chunks per rank, and as PP=4 with one
    for p in native captured-direct; do
        if [ $p = native ]; then flags=(--path eager --native); else flags=(--path $p); fi
        torchrun_cmd 2
        step "timing-pp2-$p" 120 "${RUN[@]}" benchmarks/pipeline_timing.py --config $H4096 "${flags[@]}" \
            --out "$OUT/timing-h4096-pp2-$p.json"
        if [ "$NGPU" -ge 4 ]; then
            torchrun_cmd 4
            step "timing-pp4-$p" 120 "${RUN[@]}" benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
                "${flags[@]}" --out "$OUT/timing-h4096-pp4-$p.json"
            step "timing-compare-$p" 30 python3 benchmarks/pipeline_timing.py \
                --compare "$OUT/timing-h4096-pp2-$p.json" "$OUT/timing-h4096-pp4-$p.json"
        fi
    done
    ;;
megatron)
    # each Megatron-Core CUDA-graph mode in its own subprocess; PP=2 x VPP=2 is skipped with one GPU
    step audit-megatron 540 python3 -m qeffect audit-megatron --json "$OUT/audit-megatron.json" \
        --log "$OUT/audit-megatron-children.log"
    tag_revision "$OUT/audit-megatron.json"
    ;;
esac
check_end
