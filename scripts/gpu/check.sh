#!/usr/bin/env bash
# The GPU checks, one part per call of at most ~8 minutes (see docs/gpu.md):
#
#   source .gpu-kit/setup.sh
#   QEFFECT_GIT_REVISION=<rev> bash scripts/gpu/check.sh PART OUTDIR
#
# Parts (about how long on one H200; multi and megatron's PP=2 need more GPUs):
#   tests-kernels    pytest -m gpu, the kernel and optimizer test files                     (~2-4 min)
#   tests-pipelines-1, tests-pipelines-2
#                    pytest -m gpu, every other test file: names up to test_l*, then the rest     (~4-5 min each)
#   verify           bitwise matrix at h2048: reference, te x Interleaved, ZB-V x captured-copy,
#                    captured-direct; the torchao head; captured resume in a fresh process   (~5-6 min)
#   offload          qeffect offload-check; offload_bench.py off / release / release-per-microbatch / resident at
#                    h2048 (both schedules) and h4096 Interleaved, bitwise and timed            (~5-6 min)
#   profile-h2048-te, profile-h2048-reference, profile-h4096-te, profile-h4096-reference
#                    one qeffect profile matrix each (benchmarks/profile_matrix.py): every configuration
#                    in 3 interleaved rounds, judged by examples/targets/h200.toml                (~6-9 min)
#   offload-long     the capped h4096-long pair (scripts/offload_cap_check.py: no offload refused under the cap,
#                    release trains 20 steps bitwise equal to an uncapped run without offload), then
#                    offload_bench.py off / release at h4096-long, one after the other in one process    (~6-8 min)
#   resources-h4096  the --microbatches 2,4,8,16 analysis of h4096 te (graphs, arena against M), then
#                    scripts/step_gaps.py on the h4096 te step                                  (~5 min)
#   rank-streams     benchmarks/rank_streams_ab.py: runtime.rank_streams on/off at h2048 and h4096, then
#                    benchmarks/host_profile.py: where the h2048 host's queue time goes, then
#                    benchmarks/graph_launch.py: a graph launch's host time against its kernels, and 48 graphs
#                    made one outer graph (child-graph nodes) against launched one by one       (~4-5 min)
#   step-graph       benchmarks/step_graph_probe.py: one h2048 step's actions recorded as one graph of child-graph
#                    nodes, bitwise against ordinary steps; then pytest -m gpu tests/test_step_graph_gpu.py   (~4 min)
#   step-graph-ab    rank_streams_ab.py --field runtime.step_graph at h2048 and h4096: host and step time (~1 min)
#   graph-pools      pytest -m gpu tests/test_graph_pools_gpu.py; rank_streams_ab.py --field runtime.graph_pools at
#                    h2048 and h4096 (step time, peak allocated and reserved, shared against private pools), then
#                    at h4096 with release offload; the capped h4096-long pair with shared pools (H200)   (~7 min)
#   offload-chains   release offload's chains bounded by liveness against one per microbatch (offload_bench.py at
#                    h4096-long, fused accumulation and shared pools), then the capped h4096-long pair so  (~6-8 min)
#   offload-cap      h4096-long's release (fused accumulation, shared pools, slots mapped at each forward and released
#                    while copies are pending and after each backward, every group offloaded): offload_bench.py off /
#                    release at the library's offload defaults / release as the config sets it (driver memory, bits) (~3 min)
#   offload-cap-pair the capped h4096-long pair at the config's cap: four trains and a checkpoint diff      (~5-6 min)
#   wgrad-fused      pipeline.wgrad_accumulation = fused: pytest -m gpu tests/test_wgrad_accumulation.py; verify-state
#                    at h2048 te (captured-direct Interleaved and ZB-V, captured-copy; captured-direct at M = 16);
#                    rank_streams_ab.py --field pipeline.wgrad_accumulation at h2048 and h4096 (captured-direct step
#                    time and memory)                                                                   (~3-4 min)
#   profile-fused    benchmarks/profile_matrix.py at h2048 and h4096 te with fused accumulation: native eager and
#                    captured-direct, 3 interleaved rounds, memory split and ratio to native          (~1-2 min)
#   llama            pytest -m gpu on the llama tests; bitwise matrix at llama-h2048, both backends (~6 min)
#   long-seq         verify-state at h2048 with 2,048 tokens per sequence: captured-direct te at microbatch size 2
#                    and 1, eager te, captured-direct reference; attention backends' bits at that shape    (~4 min)
#   profile-llama-h2048-te
#                    qeffect profile of llama-h2048 (te): native eager, captured-direct (both schedules) and
#                    te-graphed from TransformerLayers with the Llama settings, 3 interleaved rounds    (~4 min)
#   handoffs         benchmarks/staging_ab.py --unlinked at h2048 and h4096 te: hand-off buffers between stages
#                    against a copy per replay, 3 interleaved rounds (step and host queue time)         (~3-4 min)
#   staging-ab       benchmarks/staging_ab.py at h4096 te: staging depth by liveness / fixed 8 / unstaged,
#                    3 interleaved rounds (step time, peak memory, arena, graphs per rank); then lazy
#                    gradient regions against regions made at build (--made-regions)                   (~5 min)
#   multi            2+ GPUs under torchrun/NCCL: verify-state PP=2 (PP=2 x DP=2 and PP=4 ZB-V with 4 GPUs),
#                    a PP=2 checkpoint resumed into another layout and verified                 (~7 min)
#   multi-timing     fixed-work h4096 timing PP=2 (against PP=4 with 4 GPUs), Interleaved and ZB-V, with
#                    per-rank breakdowns and the one-GPU step of the same config                (~8 min)
#   megatron         qeffect audit-megatron (PP=1; PP=2 x VPP=2 with 2 GPUs)                (~3-5 min)
#
# Logs go to OUTDIR/check-PART.log, reports (JSON) beside it: at most 7 files per part. A failed step
# does not stop the part; the exit status is 1 if any step failed. CHECK_DRY_RUN=1 prints the commands.
# Reports record the revision from QEFFECT_GIT_REVISION (the device copy of the tree has no .git) or git.

if [ $# -ne 2 ]; then
    echo "usage: bash scripts/gpu/check.sh PART OUTDIR (parts: tests-kernels tests-pipelines-1 tests-pipelines-2 verify offload offload-long profile-h2048-te profile-h2048-reference profile-h4096-te profile-h4096-reference resources-h4096 rank-streams step-graph step-graph-ab graph-pools offload-chains offload-cap offload-cap-pair wgrad-fused profile-fused llama long-seq profile-llama-h2048-te staging-ab handoffs multi multi-timing megatron)" >&2
    exit 2
fi
part=$1
case $part in
tests-kernels|tests-pipelines-1|tests-pipelines-2|verify|offload|offload-long|profile-h2048-te|profile-h2048-reference|profile-h4096-te|profile-h4096-reference|resources-h4096|rank-streams|step-graph|step-graph-ab|graph-pools|offload-chains|offload-cap|offload-cap-pair|wgrad-fused|profile-fused|llama|long-seq|profile-llama-h2048-te|staging-ab|handoffs|multi|multi-timing|megatron) ;;
*) echo "unknown part '$part'; parts: tests-kernels tests-pipelines-1 tests-pipelines-2 verify offload offload-long profile-h2048-te profile-h2048-reference profile-h4096-te profile-h4096-reference resources-h4096 rank-streams step-graph step-graph-ab graph-pools offload-chains offload-cap offload-cap-pair wgrad-fused profile-fused llama long-seq profile-llama-h2048-te staging-ab handoffs multi multi-timing megatron" >&2
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
# the kernel and optimizer tests; tests-pipelines-1 and -2 run every other file (a new test file lands there)
KERNEL_TESTS=(tests/test_fused_quantize_gpu.py tests/test_fused_update_gpu.py tests/test_fp8_reference.py
              tests/test_layernorm.py tests/test_cross_entropy.py tests/test_embedding_grad.py
              tests/test_adamw.py tests/test_lazy_rows.py tests/test_accumulate_gpu.py)

if [ "$part" = multi ] || [ "$part" = multi-timing ]; then
    if [ "$NGPU" -lt 2 ]; then
        echo "$part needs 2 or more GPUs; $NGPU here" >&2
        exit 2
    fi
    # the NCCL pytest cases (tests/test_distributed.py, test_verify_distributed.py) run in tests-pipelines-2
    port=29611  # each torchrun on a fresh port (a finished one's may still be in TIME_WAIT)
    torchrun_cmd() { port=$((port + 1)); RUN=(python3 -m torch.distributed.run --nproc-per-node "$1" --master-port $port); }
fi

keep() {  # keep SRC DEST: copy one report out of the scratch folder (only a few files come back)
    [ -n "${CHECK_DRY_RUN:-}" ] && return 0
    if [ -f "$1" ]; then cp "$1" "$2"; else echo "== no report: $1"; fi
}

case $part in
tests-kernels)
    step pytest-kernels 480 "${PYTEST[@]}" "${KERNEL_TESTS[@]}"
    ;;
tests-pipelines-1|tests-pipelines-2)
    # every test file that is not a kernel file, split by name so that each half fits one call
    files=()
    for f in tests/test_*.py; do
        [[ " ${KERNEL_TESTS[*]} " == *" $f "* ]] && continue
        first=$(basename "$f"); first=${first#test_}
        if [ "$part" = tests-pipelines-1 ]; then [[ $first < m ]] && files+=("$f"); else [[ $first < m ]] || files+=("$f"); fi
    done
    step "pytest-${part#tests-}" 540 "${PYTEST[@]}" "${files[@]}"
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
            --modes off,release,release-per-microbatch,resident --steps 40 --interleave 2 \
            --out "$OUT/offload-bench-h2048-$sched.json"
    done
    step offload-h4096-interleaved 200 python3 benchmarks/offload_bench.py --config $H4096 --schedule interleaved \
        --modes off,release,release-per-microbatch,resident --steps 30 --interleave 2 \
        --out "$OUT/offload-bench-h4096-interleaved.json"
    ;;
offload-long)
    LONG=examples/configs/h4096-long.toml
    step offload-cap-h4096-long 420 python3 scripts/offload_cap_check.py --config $LONG --steps 20 --dir "$tmp/cap" \
        --json "$OUT/offload-cap-h4096-long.json"
    rm -rf "$tmp/cap"  # two checkpoints of the 1B-parameter model
    # sequential: each mode built after the last one's memory is gone (both at once may not fit one GPU)
    step offload-h4096-long 300 python3 benchmarks/offload_bench.py --config $LONG --modes off,release --steps 10 \
        --warmup 3 --out "$OUT/offload-bench-h4096-long.json"
    ;;
profile-h2048-te|profile-h2048-reference|profile-h4096-te|profile-h4096-reference)
    # writes profile-<shape>-<backend>-<gpu>.json; figures afterwards: qeffect profile --report FILE --plot DIR
    shape_backend=${part#profile-}
    step "$part" 570 python3 benchmarks/profile_matrix.py --out "$OUT" --only "${shape_backend/-/:}" \
        --rounds 3 --steps 10 --warmup 3 --trace 2 --microbatches "" --targets examples/targets/h200.toml
    ;;
resources-h4096)
    step resources-h4096-te 420 python3 benchmarks/profile_matrix.py --out "$tmp" --only h4096:te --rounds 1 \
        --steps 4 --warmup 3 --trace 0 --configs native-eager,captured-direct --microbatches 2,4,8,16 --targets ""
    keep "$(ls "$tmp"/profile-h4096-te-*.json 2>/dev/null | head -1)" "$OUT/resources-h4096-te.json"
    step step-gaps-h4096-te 100 python3 scripts/step_gaps.py --config $H4096 --json "$OUT/step-gaps-h4096-te.json"
    ;;
rank-streams)
    step rank-streams-ab 400 python3 benchmarks/rank_streams_ab.py --out "$OUT" --rounds 3 --trace 2 --steps 10 --warmup 3
    step host-profile-h2048 150 python3 benchmarks/host_profile.py --out "$OUT" --steps 20
    step graph-launch-h2048 120 python3 benchmarks/graph_launch.py --out "$OUT"
    ;;
llama)
    LLAMA=examples/configs/llama-h2048.toml
    step pytest-llama 200 "${PYTEST[@]}" tests/test_llama.py tests/test_llama_pipeline.py tests/test_llama_te_anchor.py
    step verify-matrix-llama 330 python3 scripts/gpu_check.py --config $LLAMA --steps 12 --backends reference,te \
        --schedules interleaved,zbv --paths captured-copy,captured-direct --out "$tmp/llama"
    keep "$tmp/llama/gpu-check.json" "$OUT/verify-matrix-llama-h2048.json"
    ;;
step-graph)
    step step-graph-probe-h2048 150 python3 benchmarks/step_graph_probe.py --out "$OUT"
    step pytest-step-graph 300 "${PYTEST[@]}" tests/test_step_graph_gpu.py
    ;;
step-graph-ab)
    step step-graph-ab 500 python3 benchmarks/rank_streams_ab.py --field runtime.step_graph --out "$OUT" --rounds 3 \
        --trace 0 --steps 10 --warmup 5
    ;;
graph-pools)
    step pytest-graph-pools 200 "${PYTEST[@]}" tests/test_graph_pools_gpu.py
    step graph-pools-ab 150 python3 benchmarks/rank_streams_ab.py --field runtime.graph_pools --out "$OUT" --rounds 3 \
        --trace 0 --steps 10 --warmup 3
    step graph-pools-ab-release 120 python3 benchmarks/rank_streams_ab.py --field runtime.graph_pools --out "$OUT" \
        --tomls $H4096 --set offload.mode=release --tag release --rounds 3 --trace 0 --steps 10 --warmup 3
    step offload-cap-h4096-long-shared 240 python3 scripts/offload_cap_check.py --config examples/configs/h4096-long.toml \
        --steps 20 --dir "$tmp/cap" --set runtime.graph_pools=shared --json "$OUT/offload-cap-h4096-long-shared.json"
    rm -rf "$tmp/cap"
    ;;
offload-chains)
    # release offload with chains bounded by liveness (the default) against a chain per microbatch, at h4096-long
    # with fused accumulation and shared pools (so that no offload fits an H100), then the capped pair so
    LONG=examples/configs/h4096-long.toml
    LEAN=(--set pipeline.wgrad_accumulation=fused --set runtime.graph_pools=shared)
    step offload-chains-h4096-long 300 python3 benchmarks/offload_bench.py --config $LONG \
        --modes off,release,release-per-microbatch --steps 6 --warmup 2 "${LEAN[@]}" \
        --out "$OUT/offload-chains-h4096-long.json"
    step offload-cap-h4096-long-chains 280 python3 scripts/offload_cap_check.py --config $LONG --steps 20 \
        --dir "$tmp/cap" "${LEAN[@]}" --json "$OUT/offload-cap-h4096-long-chains.json"
    rm -rf "$tmp/cap"
    ;;
offload-cap|offload-cap-pair)
    # release that gives memory back, as h4096-long.toml sets it up (fused accumulation, shared pools, every
    # group offloaded, no slot mapped at build, slots released while copies are pending and after each
    # backward): one process against no offload and release at the library's offload defaults; then the
    # capped pair at the config's own cap
    LONG=examples/configs/h4096-long.toml
    if [ "$part" = offload-cap ]; then
        step offload-cap-bench-h4096-long 300 python3 benchmarks/offload_bench.py --config $LONG \
            --modes "off,release-defaults,release" --steps 5 --warmup 2 --out "$OUT/offload-cap-bench-h4096-long.json"
    else
        step offload-cap-h4096-long 560 python3 scripts/offload_cap_check.py --config $LONG --steps 20 \
            --dir "$tmp/cap" --json "$OUT/offload-cap-h4096-long.json"
    fi
    rm -rf "$tmp/cap"
    ;;
wgrad-fused)
    FUSED=(--set pipeline.wgrad_accumulation=fused)
    step pytest-wgrad-fused 200 "${PYTEST[@]}" tests/test_wgrad_accumulation.py
    for combo in "captured-direct interleaved" "captured-direct zbv" "captured-copy interleaved"; do
        read -r path schedule <<< "$combo"
        step "verify-fused-$path-$schedule" 120 python3 -m qeffect verify-state -c $H2048 "${FUSED[@]}" \
            --set pipeline.schedule="$schedule" --steps 6 --path "$path" --backend te \
            --json "$OUT/verify-fused-h2048-$path-$schedule-te.json"
    done
    for schedule in interleaved zbv; do  # graphs bounded by liveness at M = 16
        step "verify-fused-m16-$schedule" 120 python3 -m qeffect verify-state -c $H2048 "${FUSED[@]}" \
            --set pipeline.schedule="$schedule" --set pipeline.microbatches=16 --steps 5 --path captured-direct \
            --backend te --json "$OUT/verify-fused-h2048-m16-captured-direct-$schedule-te.json"
    done
    step wgrad-accumulation-ab 150 python3 benchmarks/rank_streams_ab.py --field pipeline.wgrad_accumulation \
        --out "$OUT" --rounds 3 --trace 0 --steps 10 --warmup 3
    ;;
profile-fused)
    step profile-fused 570 python3 benchmarks/profile_matrix.py --out "$OUT" --tomls $H2048,$H4096 --backends te \
        --set pipeline.wgrad_accumulation=fused --tag fused --configs native-eager,captured-direct --rounds 3 \
        --steps 10 --warmup 3 --trace 0 --microbatches "" --targets ""
    ;;
long-seq)
    # where captured-direct leaves native eager's bits at 2,048 tokens per sequence: the failing case, then the
    # same with 2,048 tokens per microbatch (no +0.0 pass), without graphs (split backward only) and without
    # Transformer Engine; then the attention backends' repeatability at that shape
    LONG=(--set model.seq_len=2048)
    for combo in "2 captured-direct te" "1 captured-direct te" "2 eager te" "2 captured-direct reference"; do
        read -r mb path backend <<< "$combo"
        step "verify-seq2048-mb$mb-$path-$backend" 120 python3 -m qeffect verify-state -c $H2048 "${LONG[@]}" \
            --set model.microbatch_size="$mb" --steps 2 --path "$path" --backend "$backend" \
            --json "$OUT/verify-seq2048-mb$mb-$path-$backend.json"
    done
    step attention-seq2048 120 python3 benchmarks/attention_backends.py --seq-len 2048 --microbatch-size 2 \
        --repeats 20 --json "$OUT/attention-backends-seq2048.json"
    ;;
profile-llama-h2048-te)
    step "$part" 420 python3 benchmarks/profile_matrix.py --out "$OUT" --tomls examples/configs/llama-h2048.toml \
        --backends te --rounds 3 --steps 10 --warmup 3 --trace 2 --microbatches "" \
        --configs native-eager,captured-direct,captured-zbv-direct,te-graphed --targets ""
    ;;
handoffs)
    for shape in h2048 h4096; do
        step "handoffs-ab-$shape-te" 280 python3 benchmarks/staging_ab.py --config "examples/configs/$shape.toml" \
            --backend te --rounds 3 --steps 20 --warmup 3 --unlinked copied \
            --variants "linked=pipeline.wgrad_staging=8;copied=pipeline.wgrad_staging=8" \
            --out "$OUT/handoffs-ab-$shape-te.json"
    done
    ;;
staging-ab)
    step staging-ab-h4096-te 420 python3 benchmarks/staging_ab.py --config $H4096 --backend te --rounds 3 \
        --out "$OUT/staging-ab-h4096-te.json"
    step lazy-regions-ab-h4096-te 180 python3 benchmarks/staging_ab.py --config $H4096 --backend te --rounds 3 \
        --steps 10 --warmup 3 --variants "lazy=pipeline.wgrad_staging=8;made=pipeline.wgrad_staging=8" \
        --made-regions made --out "$OUT/lazy-regions-ab-h4096-te.json"
    ;;
multi)
    if [ "$NGPU" -ge 4 ]; then
        n=4 cfg=examples/configs/h2048-pp2-dp2.toml name=verify-pp2-dp2-nccl-h2048 what="PP=2 x DP=2"
    else
        n=2 cfg=$H2048 name=verify-pp2-nccl-h2048 what="PP=2"
    fi
    mkdir -p "$tmp/verify" "$tmp/pp4"
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
    if [ "$NGPU" -ge 4 ]; then  # PP=4 ZB-V: 4 ranks x 2 chunks
        for backend in reference te; do
            torchrun_cmd 4
            step "verify-pp4-zbv-$backend" 120 "${RUN[@]}" -m qeffect verify-state --config $H2048 --pp 4 --schedule zbv \
                --backend $backend --path captured-direct --steps 20 --json "$tmp/pp4/$backend.json"
        done
        merge_json "verify-state under torchrun, PP=4 ZB-V, NCCL, captured-direct" "$OUT/verify-pp4-zbv-nccl-h2048.json" \
            "$tmp/pp4/reference.json" "$tmp/pp4/te.json"
    fi
    # a PP=2 checkpoint resumed into the widest layout this machine has, verified against native eager
    torchrun_cmd 2
    step layout-save 120 "${RUN[@]}" -m qeffect train --config $H2048 --path captured-direct --steps 3 \
        --checkpoint-every 3 --set train.eval_every=0 --out "$tmp/layout"
    if [ "$NGPU" -ge 4 ]; then wide=(--set pipeline.pp=4 --set pipeline.chunks_per_rank=1); np=4; else wide=(); np=2; fi
    torchrun_cmd $np
    step layout-verify 120 "${RUN[@]}" -m qeffect verify-state --config $H2048 --path captured-direct \
        --resume "$tmp/layout/checkpoints" "${wide[@]}" --steps 5 --json "$OUT/verify-resume-layout-h2048.json"
    ;;
multi-timing)
    # fixed work: the h4096 model as PP=2 with two chunks per rank, and as PP=4 with one (Interleaved); ZB-V
    # needs two chunks per rank, so its pair is an 8-layer model (PP=2 x 2 chunks of 2 layers, PP=4 x 2 of 1).
    # --breakdown: where each rank's step goes, in extra synchronised steps; --one-gpu: the same config in one
    # process on one GPU in the same run (the two-GPU step against it).
    for p in native captured-direct; do
        if [ $p = native ]; then flags=(--path eager --native); else flags=(--path $p --breakdown 5); fi
        torchrun_cmd 2
        step "timing-pp2-$p" 300 "${RUN[@]}" benchmarks/pipeline_timing.py --config $H4096 "${flags[@]}" \
            $([ $p = captured-direct ] && echo --one-gpu) --out "$OUT/timing-h4096-pp2-$p.json"
        if [ "$NGPU" -ge 4 ]; then
            torchrun_cmd 4
            step "timing-pp4-$p" 150 "${RUN[@]}" benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
                "${flags[@]}" --out "$OUT/timing-h4096-pp4-$p.json"
            step "timing-compare-$p" 30 python3 benchmarks/pipeline_timing.py \
                --compare "$OUT/timing-h4096-pp2-$p.json" "$OUT/timing-h4096-pp4-$p.json"
        fi
    done
    torchrun_cmd 2
    step timing-pp2-zbv 150 "${RUN[@]}" benchmarks/pipeline_timing.py --config $H4096 --path captured-direct \
        --breakdown 5 --set pipeline.schedule=zbv --set model.layers_per_chunk=2 \
        --out "$OUT/timing-h4096-pp2-captured-direct-zbv.json"
    if [ "$NGPU" -ge 4 ]; then
        torchrun_cmd 4
        step timing-pp4-zbv 150 "${RUN[@]}" benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
            --path captured-direct --breakdown 5 --set pipeline.schedule=zbv --set pipeline.chunks_per_rank=2 \
            --out "$OUT/timing-h4096-pp4-captured-direct-zbv.json"
        step timing-compare-zbv 30 python3 benchmarks/pipeline_timing.py \
            --compare "$OUT/timing-h4096-pp2-captured-direct-zbv.json" "$OUT/timing-h4096-pp4-captured-direct-zbv.json"
    fi
    ;;
megatron)
    # each Megatron-Core CUDA-graph mode in its own subprocess; PP=2 x VPP=2 is skipped with one GPU
    step audit-megatron 540 python3 -m qeffect audit-megatron --json "$OUT/audit-megatron.json" \
        --log "$OUT/audit-megatron-children.log"
    tag_revision "$OUT/audit-megatron.json"
    ;;
esac
check_end
