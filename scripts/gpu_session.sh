#!/usr/bin/env bash
# The H200 acceptance runs of issues 5, 7 and 8, in two device calls of under ten minutes each:
#
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_session.sh $OUT verify
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_session.sh $OUT offload profile-h2048
#   source .gpu-kit/setup.sh; QEFFECT_GIT_REVISION=<rev> bash scripts/gpu_session.sh $OUT profile-h4096
#
# verify:  pytest -m gpu; the verify matrix (reference, te x interleaved, zbv x captured-copy, -direct,
#          20 steps of h2048); the torchao output head; the offload benchmark.
# offload, offload-final (shorter: the offload and captured-training GPU tests only): the offload GPU tests and the offload benchmark (off / release / resident, bitwise and
#          timings) for Interleaved and ZB-V (te backend as in h2048.toml; reference if te fails).
# profile-h2048, profile-h4096: `qeffect profile` matrices with trace summaries, reference and te.
# replay-protocol: the graph and token-table GPU tests, then benchmarks/replay_protocol.py (two-way vs
#          stream-ordered replay) for both backends at h2048.
# staged: the staged weight-gradient accumulation's GPU tests, bitwise matrix and A/B benchmark.
# offload-next: the offload GPU tests (teardown leak included), scripts/offload_leak.py, and the offload
#          benchmark over off, release, release-keep, resident and resident@6 for both schedules.
# release-window: release mode leaves the last stage's groups on the device (train.offload_min_window, branch
#          next/release-min-window): the offload GPU tests, then the benchmark over off, release, release-all
#          (every group offloaded: the A/B) and resident for both schedules.
# release-keep: release mode keeping consumed slots mapped (the default since d459de8): the offload GPU tests,
#          then the offload benchmark over off, release, release-reap (the A/B) and resident for both schedules.
# resident-skip: no D2H for groups the plan keeps in their bank (merged from next/resident-skip-d2h): the
#          offload GPU tests, then the offload benchmark over off, resident, resident@6 and the same
#          two copying every group (resident-copyall, resident-copyall@6: the A/B) for both schedules.
# adamw: the Triton AdamW's GPU tests, A/B benchmark and arithmetic check, then the whole GPU suite.
# layernorm: the model's Triton LayerNorm's GPU tests; if they pass, the GPU suite and the h4096 profiles.
# offload-futile: resident look-ahead without the restores a forward evicts: offload GPU tests, A/B benchmark.
# offload-chunks: host cost of stream operations, offload GPU tests, stalls, and the A/B of chunked copies and
#          driver stream operations (both on by default) against one copy per group and torch's operations.
# offload-store-batch: the forward graphs copy small saved tensors into the slots together (one multi-tensor
#          copy, the default) or each with its own copy node (QEFFECT_OFFLOAD_STORE_BATCH_MIB=0): offload and
#          training GPU tests, then the resident and release A/B per schedule (about 4 minutes).
# offload-bank-search: resident with the banks scripts/offload_sim.py --search found (QEFFECT_OFFLOAD_BANKS, 4
#          banks) against the default plan (2 banks asked) and assign_banks' 4: h2048 both schedules, h4096
#          Interleaved (about 6 minutes).
# bank-plan: resident with the searched bank plan (the default, train.offload_bank_plan = "search") against
#          the colouring (resident-colour, the previous default), three times each in alternation: h2048
#          Interleaved (bank-plan-interleaved), then h2048 ZB-V and h4096 Interleaved (bank-plan-zbv-h4096)
#          (two parts: about 2 and 5 minutes).
# bank-tries: the search's 400 tries (default) against 200, and a budget of 6 banks (h4096 Interleaved,
#          h2048 ZB-V; about 5 minutes).
# resident-window: resident leaving the last stage's groups on the device (the default,
#          train.offload_min_window = 2: no slot copies and no bank for them) against resident-all (every group
#          offloaded), twice each in alternation: h2048 both schedules, h4096 Interleaved (about 5 minutes).
# offload-acceptance: issue 7's benchmark, offload_bench.py --interleave 2 (every mode alive, timed in
#          rotating rounds): off, release, release/la0, resident, resident-memory at h2048 (both
#          schedules), off, release, resident at h4096 (about 4 minutes).
# ref-wgrad: the reference wgrad GEMM in bf16: GPU suite, reference bitwise matrix, reference profiles.
# ref-wgrad-ab: its A/B against the fp32 GEMM (QEFFECT_REF_WGRAD_DTYPE=weight), h4096 reference.
# ref-bias: the reference bias in the GEMM epilogue: reference bitwise matrix, A/B at h4096, GPU suite.
# ref-dbias: the reference bias gradient from the quantize pass (with the bias epilogue): tests, matrix, A/Bs,
#          GPU suite, h4096 reference profile.
# ref-branches: the three stacked reference branches (bias epilogue, fused bias gradient, weight cast in the
#          optimizer): tests, matrix, A/Bs, GPU suite, h4096 reference profile.
# ref-final: the whole GPU suite, the reference bitwise matrix, the h4096 and h2048 reference profiles.
# ref-te-h4096: the h4096 reference profile, then the h4096 te profile (a second lease's sample of both).
# ref-transition: the quantize pass completing its own scale transition: its GPU tests, the A/B against two launches
#   (QEFFECT_FUSED_TRANSITION=0) and torch's bias-gradient sum (QEFFECT_FUSED_DBIAS=0) at h4096 in one process,
#   the h4096 reference step's kernels (step_gaps.py), the reference bitwise matrix.
# suite-ref-h4096: the whole GPU suite, then the h4096 reference profile.
# capture-guard: the whole GPU suite with the quantize pass's old settings (4 warps, acquire-release), then with
#          2 warps and relaxed (scripts/suite_with_quantize_settings.py, both ways explicit).
# rank-streams: one stream per rank in the one-process captured pipeline: its GPU tests, the h4096 reference A/B
#          against one stream (QEFFECT_RANK_STREAMS=0), the reference bitwise matrix at h2048.
# rank-streams-te: the same for the te backend (a cuBLAS workspace per rank): tests, h4096 te A/B, te matrix at h2048.
# final-h4096 / final-h2048: a closing check in two calls: the whole GPU suite and both h4096 matrices / both h2048
#          matrices and the h4096 reference step gaps.
# final-ref / final-te: a session's closing check: the whole GPU suite, both reference matrices and the h4096
#          reference step gaps / both te matrices.
# quantize-final: the quantize pass's defaults (2-warp tiles and relaxed amax atomics since 6d49f37): the
#          fused-quantize, reference and fused-update GPU tests, quantize_ab.py, the h4096 reference step's kernels, the
#          reference bitwise matrix.
# quantize-ab: the fused-quantize GPU tests, then benchmarks/quantize_ab.py on h4096's shapes (the pass's atomics,
#          store order, tiles and column strips under CUDA graphs; about 3 minutes).
# h4096-te: the h4096 te profile alone. h2048-te: the h2048 te profile alone.
# token-ab: offload_bench.py --interleave 2 with modes off and off+QEFFECT_TOKEN_COPY=1: the effect token
#          incremented in place on one buffer per chunk against one copied into every replay, bitwise
#          compared: h2048 Interleaved, h4096 ZB-V (about 3 minutes).
# weight-cast: the optimizer's FP8 weight cast: its GPU tests, then offload_bench.py's A/B with
#          QEFFECT_WEIGHT_CAST=0 (TE's own cast) at h4096 ZB-V and h2048 Interleaved (about 4 minutes).
# weight-cast-kernels: benchmarks/weight_cast_ab.py on h4096 with the transpose sweep.
# optim-graph: the graphed optimizer step's GPU tests, its A/B (switch_ab) and issue 7's h2048 modes with it.
# release-depth: release offload's waits and its look-ahead depth A/B at h2048.
# vmm-gpu-cost: scripts/vmm_gpu_cost.py, queued kernels' device time with VMM calls made meanwhile (20 and 2 MiB).
# offload-h4096: issue 7's off / release / resident at h4096 (Interleaved).
# release-gaps: step_gaps.py at h2048 Interleaved with offload off, release and resident.
# launch-first: the whole GPU suite (QEFFECT_OFFLOAD_LAUNCH_FIRST=1's offload tests in it), its h2048 A/B and release's gaps with it.
# launch-first-depth: the whole GPU suite, then launch-first at look-ahead 1 and 2 (release) and resident, h2048.
# launch-first-default: the GPU suite, h4096 off / release / release without launch-first / resident, host-python.
# raw-stream: the GPU suite, scripts/offload_host_ops.py, h2048 off / release / release/la2 / resident.
# offload-acceptance-final: the GPU suite, then h2048 off / release / resident in both schedules (about 5 minutes).
# offload-chained: h2048 off / release / resident with each round's steps queued back to back, then synchronized.
# share-slots: the whole GPU suite, then release with and without nested groups sharing a slot, h2048 both schedules.
# share-slots-more: slot sharing as the default: the A/B chained (steps queued back to back), at h4096, then h2048 off / release / resident.
# offload-repeat: issue 7's h2048 off / release / resident, both schedules (about 2 minutes).
# resident-chunks: issue 7's h2048 modes with resident's copies in one piece per group against 2 MiB chunks.
# suite-chunks: the whole GPU suite, then resident-chunks.
# repeat-host: issue 7's h2048 modes, then host-python.
# min-window: h2048 release and resident with train.offload_min_window 6 / 12 against 2, off#2.
# share-gap: the whole GPU suite, h2048 off / release / release any run / resident, h4096 off / release / resident.
# release-in-place: the whole GPU suite, then h2048 release reading late groups in place / waiting / share gap 4, resident chunks.
# share-runs: the whole GPU suite, then h2048 off / release with a slot per group / nested groups sharing / any run of two (the default) / of three / resident.
# default-window: the whole GPU suite, then h2048 off / release / resident with train.offload_min_window 12 against 2 (/mw2), off#2.
# default-window-h4096: h4096 off / release / resident / resident/mw2 (Interleaved).
# suite-profile-h2048: the whole GPU suite, then the h2048 te profile matrix.
# suite-profile-h4096: the whole GPU suite, then the h4096 te profile matrix (setups by build phase).
# model-anchor: the TE anchors' and the row-lazy table's GPU tests, then the h4096 and h2048 te matrices with te-graphed-model.
# suite-profiles: the whole GPU suite, then the h4096 and h2048 te profile matrices.
# mcore-anchor: te-graphed-mcore's GPU tests (all three TE references), then the h4096 and h2048 te matrices.
# host-python: scripts/host_python_profile.py, h2048 Interleaved host time by Python function per offload mode.
# offload-waits: scripts/offload_waits.py, the compute stream's stall at each offload wait.
# copy-bandwidth: scripts/copy_bandwidth.py, then scripts/offload_host_profile.py's device copies per mode.
# gil: scripts/gil_check.py, its pure-Python control first, then the real driver calls.
# combined: the teardown test alone, the whole GPU suite and the 8-cell matrix.
# fused-quantize, fused-quantize-profile (two calls): the fused reference quantization's GPU tests and
#          the reference bitwise matrix; then the reference profiles at h2048 and h4096.
# Each step has its own time limit so that one hang cannot cost the others; logs and JSON go to OUT.
set -u
out=$1
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
LOGS=$out
# shellcheck source=scripts/gpu_lib.sh
source "$(dirname "$0")/gpu_lib.sh"
offload_bench() {  # offload_bench <schedule>
    step 120 "offload-$1" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --schedule "$1" --steps 20 --out "$out/offload-bench-h2048-$1-h200.json" ||
    step 120 "offload-$1-reference" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --schedule "$1" --backend reference --steps 20 --out "$out/offload-bench-h2048-$1-reference-h200.json"
}
offload_ab() {  # offload_ab <seconds> <step> <h2048|h4096> <schedule> <tag> <modes>: one offload_bench A/B, 20 steps
    step "$1" "$2" python3 benchmarks/offload_bench.py --config "examples/configs/$3.toml" --schedule "$4" \
        --steps 20 --out "$out/offload-bench-$3-$4-$5-h200.json" --modes "$6"
}
bitwise_matrix() {  # the verify matrix (reference, te x interleaved, zbv x captured-copy, -direct, 20 steps)
    step 180 verify python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference,te --paths captured-copy,captured-direct --out "$out/verify"
}
gaps_ab() {  # gaps_ab VAR=VALUE off-name on-name: h4096 te step gaps with a switch set (off), then without
    step 120 "gaps-$2" env "$1" python3 scripts/step_gaps.py --config examples/configs/h4096.toml \
        --json "$out/step-gaps-h4096-te-$2-h200.json"
    step 120 "gaps-$3" python3 scripts/step_gaps.py --config examples/configs/h4096.toml \
        --json "$out/step-gaps-h4096-te-$3-h200.json"
}
switch_ab() {  # switch_ab VAR=VALUE name: offload_bench.py's A/B of a switch against the default, 2 interleaved
    # rounds, bitwise compared: h2048 Interleaved (40 steps), then h4096 ZB-V (30)
    step 200 "$2-h2048" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --schedule interleaved --steps 40 --interleave 2 --modes "off,off+$1" --out "$out/$2-h2048-interleaved-h200.json"
    step 300 "$2-h4096" python3 benchmarks/offload_bench.py --config examples/configs/h4096.toml \
        --schedule zbv --steps 30 --interleave 2 --modes "off,off+$1" --out "$out/$2-h4096-zbv-h200.json"
}
h2048_modes() {  # h2048_modes <step-prefix> <modes>: offload_bench.py at h2048, both schedules, 40 steps in rounds
    # of 2 (--interleave 2), each to offload-bench-h2048-<schedule>-h200.json
    for sched in interleaved zbv; do
        step 150 "$1-$sched" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
            --schedule "$sched" --steps 40 --interleave 2 --out "$out/offload-bench-h2048-$sched-h200.json" \
            --modes "$2"
    done
}
h2048_chained() {  # h2048_chained <step-prefix> <modes>: h2048_modes with each round's 4 steps queued back to back
    # (--chained), each to offload-bench-h2048-<schedule>-chained-h200.json
    for sched in interleaved zbv; do
        step 150 "$1-$sched" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
            --schedule "$sched" --steps 40 --interleave 4 --chained \
            --out "$out/offload-bench-h2048-$sched-chained-h200.json" --modes "$2"
    done
}
gpu_suite() {  # gpu_suite <step-name>: the whole GPU suite (pytest -m gpu); 561 tests took over 300 s on a slow
    # host at 02b4c11 (190 s on a fast one at 682d48f)
    step 400 "$1" python3 -m pytest -m gpu -q -p no:cacheprovider
}
h4096_modes() {  # h4096_modes <modes>: offload_bench.py at h4096 Interleaved, 30 steps in rounds of 2
    step 200 offload-h4096 python3 benchmarks/offload_bench.py --config examples/configs/h4096.toml \
        --schedule interleaved --steps 30 --interleave 2 --out "$out/offload-bench-h4096-interleaved-h200.json" \
        --modes "$1"
}
host_python() {  # scripts/host_python_profile.py: h2048 Interleaved host time by Python function, off / release / resident
    step "$1" host-python python3 scripts/host_python_profile.py --modes off,release,resident --steps 10 \
        --json "$out/host-python-h2048-interleaved-h200.json"
}
verify_backend() {  # <backend>: its bitwise matrix at h2048 (both schedules, copy and direct), merged report only
    step 150 "verify-$1" python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends "$1" --paths captured-copy,captured-direct --out "$out/verify"
    keep_merged verify
}
verify_reference() {  # the reference bitwise matrix at h2048
    verify_backend reference
}
profile_h4096_reference() {  # the h4096 reference matrix with traces and the M analysis
    step 150 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
}
profile_h2048_reference() {  # the h2048 reference matrix with traces
    step 150 profile-h2048-reference python3 benchmarks/profile_matrix.py --out "$out" --only h2048:reference \
        --steps 20 --warmup 3 --trace 3
}
ab_h4096() {  # <seconds> <name> <backend> <modes>: offload_bench's A/B of modes in one process, h4096 Interleaved
    step "$1" "$2-ab" python3 benchmarks/offload_bench.py --config examples/configs/h4096.toml \
        --backend "$3" --schedule interleaved --steps 20 --interleave 2 \
        --modes "$4" --out "$out/$2-ab-h4096-interleaved-h200.json"
}
ref_ab_h4096() {  # <seconds> <name> <modes>: ab_h4096 with the reference backend
    ab_h4096 "$1" "$2" reference "$3"
}
ref_gaps_h4096() {  # scripts/step_gaps.py on the h4096 reference step: every kernel, the GPU's idle gaps
    step 120 gaps-h4096-reference python3 scripts/step_gaps.py --config examples/configs/h4096.toml \
        --backend reference --json "$out/step-gaps-h4096-reference-h200.json"
}
ref_gpu_tests() {  # <seconds> <name>: the fused-quantize and reference-backend GPU tests
    step "$1" "$2" python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_quantize_gpu.py \
        tests/test_fp8_reference.py
}
profile_h4096_te() {  # the h4096 te matrix with traces and the M analysis
    step 220 profile-h4096-te python3 benchmarks/profile_matrix.py --out "$out" --only h4096:te \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
}
profile_h2048_te() {  # the h2048 te matrix with traces and the M analysis
    step 200 profile-h2048-te python3 benchmarks/profile_matrix.py --out "$out" --only h2048:te \
        --steps 20 --warmup 3 --trace 2 --microbatches 2,4,8,16
}
resident_chunks() {  # issue 7's h2048 modes with resident's one copy per group (CHUNK_MIB=0) against 2 MiB chunks
    h2048_modes resident-chunks off,release,resident,resident+QEFFECT_OFFLOAD_CHUNK_MIB=0
}
keep_merged() {  # only 8 files come back: keep each matrix's merged report, drop the per-cell ones
    for d in "$@"; do
        [ -f "$out/$d/gpu-check.json" ] && mv "$out/$d/gpu-check.json" "$out/$d-gpu-check.json"
        rm -rf "${out:?}/$d"
    done
}
for part in "$@"; do
case $part in
verify)
    step 240 pytest python3 -m pytest -m gpu -q -p no:cacheprovider
    bitwise_matrix
    step 70 torchao python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference,te --schedules interleaved --paths captured-direct --head torchao --out "$out/torchao"
    keep_merged verify torchao
    ;;
staged)
    # staged weight-gradient accumulation: fused fold and TE GEMM-into-slot tests, the bitwise matrix,
    # then the A/B of wgrad_staging in one process (h4096 te, h2048 reference)
    step 120 pytest-staged python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_accumulate_gpu.py \
        tests/test_te_backend.py tests/test_graphs_gpu.py
    bitwise_matrix
    keep_merged verify
    step 150 staging-h4096-te python3 benchmarks/staging_ab.py --config examples/configs/h4096.toml \
        --staging 0,4,8 --out "$out/staging-ab-h4096-te-h200.json"
    step 90 staging-h2048-reference python3 benchmarks/staging_ab.py --config examples/configs/h2048.toml \
        --backend reference --staging 0,4 --out "$out/staging-ab-h2048-reference-h200.json"
    ;;
offload)
    step 90 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        -k "captured_pipeline"
    offload_bench interleaved
    offload_bench zbv
    ;;
offload-final)
    step 60 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        tests/test_train.py
    offload_bench interleaved
    offload_bench zbv
    ;;
offload-next)
    # the branch next/offload-pack-detach: teardown leak test, offload tests, then every offload mode
    step 120 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py tests/test_train.py
    step 90 offload-leak python3 scripts/offload_leak.py --config examples/configs/h2048.toml --modes off,release,resident
    for s in interleaved zbv; do
        step 100 "offload-$s" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml --schedule "$s" \
            --steps 20 --modes off,release,release-keep,resident,resident@6 --out "$out/offload-bench-h2048-$s-h200.json"
    done
    ;;
release-window)
    step 120 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py
    for s in interleaved zbv; do
        step 100 "offload-$s" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml --schedule "$s" \
            --steps 20 --modes off,release,release-all,resident \
            --out "$out/offload-bench-h2048-$s-release-window-h200.json"
    done
    ;;
resident-skip)
    step 120 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py
    for s in interleaved zbv; do
        step 100 "offload-$s" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml --schedule "$s" \
            --steps 20 --modes off,resident,resident@6,resident-copyall,resident-copyall@6 \
            --out "$out/offload-bench-h2048-$s-h200.json"
    done
    ;;
combined)
    # next/combined (offload-pack-detach + ref-fused-quantize): the teardown test alone first (Transformer
    # Engine imported after the offload driver only), then the whole GPU suite and both backends' matrix
    step 90 pytest-teardown python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py -k torn_down
    step 320 pytest python3 -m pytest -m gpu -q -p no:cacheprovider
    bitwise_matrix
    keep_merged verify
    ;;
combined2)
    # next/combined after the transposed-store fix: the fused tests pick the transpose mode (the
    # kernel's, else torch's), then the offload file alone (Transformer Engine first imported after the
    # offload tests), the whole GPU suite, the 8-cell matrix (non-finite losses now fail) and the
    # h2048 reference profile
    if ! step 150 pytest-fq python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_quantize_gpu.py; then
        export QEFFECT_FUSED_TRANSPOSE=torch
        step 100 pytest-fq-torch python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_quantize_gpu.py
    fi
    step 60 pytest-offload-file python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        -k "not captured_pipeline"
    step 200 pytest python3 -m pytest -m gpu -q -p no:cacheprovider
    bitwise_matrix
    keep_merged verify
    profile_h2048_reference
    ;;
combined3)
    # the landed default (torch transposes; the kernel's for 16-bit inputs when asked) and h4096 reference
    step 100 pytest-fq python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_quantize_gpu.py
    step 300 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
kernel-transpose)
    # the in-kernel transpose for 16-bit inputs (QEFFECT_FUSED_TRANSPOSE=kernel): the reference matrix,
    # then the h4096 reference profile (torch's fp8 transposes were 8 ms of its 62.5 ms captured step)
    export QEFFECT_FUSED_TRANSPOSE=kernel
    step 100 verify-reference python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference --paths captured-copy,captured-direct --out "$out/verify"
    keep_merged verify
    step 220 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
fused-update)
    # the fused scaling update (merged from next/fused-scale-update): its GPU tests, the reference matrix,
    # the reference profiles
    step 150 pytest-fu python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_update_gpu.py \
        tests/test_fused_quantize_gpu.py tests/test_fp8_reference.py tests/test_accumulate_gpu.py
    step 100 verify-reference python3 scripts/gpu_check.py --config examples/configs/h2048.toml --steps 20 \
        --backends reference --paths captured-copy,captured-direct --out "$out/verify"
    keep_merged verify
    profile_h2048_reference
    step 200 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
fused-quantize)
    # the branch next/ref-fused-quantize: the fused reference quantization's GPU tests (cold Triton cache:
    # about 30 compiles) and the reference backend's bitwise matrix; fused-quantize-profile: its profiles
    step 240 pytest-fq python3 -m pytest -m gpu -q -s -p no:cacheprovider tests/test_fused_quantize_gpu.py \
        tests/test_fp8_reference.py
    verify_reference
    ;;
fused-quantize-profile)
    step 200 profile-h2048-reference python3 benchmarks/profile_matrix.py --out "$out" --only h2048:reference \
        --steps 20 --warmup 3 --trace 3
    step 250 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
replay-protocol)
    # two-way handshake vs stream-ordered replay, A/B in one process per backend (h2048)
    step 120 pytest-graphs python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_graphs_gpu.py tests/test_embedding_grad.py
    for b in reference te; do
        step 100 "replay-protocol-$b" python3 benchmarks/replay_protocol.py --config examples/configs/h2048.toml \
            --backend "$b" --out "$out/replay-protocol-h2048-$b-h200.json"
    done
    ;;
release-keep)
    step 90 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py
    for s in zbv interleaved; do
        step 150 "offload-keep-$s" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
            --schedule "$s" --steps 20 --modes off,release,release-reap,resident \
            --out "$out/offload-bench-h2048-$s-release-keep-h200.json"
    done
    ;;
accumulate)
    # the captured dI's non-matrix gradients accumulated several tensors per launch: the whole GPU suite,
    # step gaps without and with the batching (h4096 te), then the h4096 and h2048 te profiles
    if step 240 pytest-gpu python3 -m pytest -m gpu -q; then
        gaps_ab QEFFECT_FUSED_ACCUMULATE=0 one-by-one batched
        profile_h4096_te
        profile_h2048_te
    fi
    ;;
refresh)
    # the profiles not yet run at this revision (h4096 te ran in split-heads), and the h4096 te step with a
    # 256-token vocabulary against the TE anchor: the anchor is layers only (no embedding, head or loss),
    # so this shows what those cost in qeffect's step and the ratio on a layers-comparable model
    step 200 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" \
        --only h4096:reference --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    step 200 profile-h2048 python3 benchmarks/profile_matrix.py --out "$out" --tomls examples/configs/h2048.toml \
        --steps 20 --warmup 3 --trace 2 --microbatches 2,4,8,16
    sed 's/^vocab_size = .*/vocab_size = 256/' examples/configs/h4096.toml > "$out/h4096-vocab256.toml"
    step 200 profile-h4096-vocab256 python3 -m qeffect profile --config "$out/h4096-vocab256.toml" \
        --configs captured-direct,te-graphed --steps 12 --warmup 3 --trace 1 \
        --json "$out/profile-h4096-vocab256-te-h200.json"
    ;;
copy-bandwidth)
    # how fast offload's copies run: pinned <-> VMM / caching memory, idle and beside GEMMs; then one
    # profiled h2048 step per offload mode with each memcpy's device time and the kernels' busy time
    step 120 copy-bandwidth python3 scripts/copy_bandwidth.py --json "$out/copy-bandwidth-h200.json"
    for s in interleaved zbv; do
        step 150 "offload-device-$s" python3 scripts/offload_host_profile.py --schedule "$s" \
            --modes off,resident,resident@6,release --json "$out/offload-device-profile-h2048-$s-h200.json"
    done
    ;;
offload-futile)
    # resident look-ahead skipping the restores a forward evicts before their backward: the offload and
    # training GPU tests, then the offload benchmark with and without (+QEFFECT_SKIP_FUTILE_RESTORES=0, the
    # A/B, each twice in alternation), both schedules
    if step 180 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        tests/test_train.py; then
        for s in interleaved zbv; do
            step 200 "offload-futile-$s" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
                --schedule "$s" --steps 20 --out "$out/offload-bench-h2048-$s-h200.json" --modes \
                off,release,resident,resident+QEFFECT_SKIP_FUTILE_RESTORES=0,resident#2,resident#2+QEFFECT_SKIP_FUTILE_RESTORES=0
        done
    fi
    ;;
offload-chunks)
    # resident copies in 2 MiB chunks and offload's stream operations through the driver (both the default since
    # 2026-11-30): the host cost of each kind of stream operation, the offload and training GPU tests, the
    # compute stream's stalls, then the A/B per schedule (QEFFECT_OFFLOAD_CHUNK_MIB=0: one copy per group;
    # QEFFECT_OFFLOAD_DRIVER_STREAMS=0: torch's operations), repeated in alternation
    step 60 offload-host-ops python3 scripts/offload_host_ops.py --json "$out/offload-host-ops-h200.json"
    if step 180 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        tests/test_train.py; then
        step 120 offload-waits python3 scripts/offload_waits.py --modes off,resident \
            --json "$out/offload-waits-h2048-chunks-h200.json"
        C=+QEFFECT_OFFLOAD_CHUNK_MIB=0
        D=+QEFFECT_OFFLOAD_DRIVER_STREAMS=0
        for sched in interleaved zbv; do
            modes="off,resident,resident$C,resident$D,release,release$D,resident#2,resident#2$C,resident#2$D,off#2"
            step 240 "offload-chunks-$sched" python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
                --schedule "$sched" --steps 20 --out "$out/offload-bench-h2048-$sched-chunks-h200.json" --modes "$modes"
        done
    fi
    ;;
offload-store-batch)
    # saved tensors under 256 KiB go into the slots together, one multi-tensor copy per group (the default since
    # 2026-11-30), against one device-to-device copy node per tensor (+QEFFECT_OFFLOAD_STORE_BATCH_MIB=0), in
    # alternation. (The run of that day also tried QEFFECT_OFFLOAD_STORE_KERNEL=1, the larger ones through an
    # elementwise kernel instead of a copy node: no gain, removed.)
    if step 180 pytest-offload python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_offload_gpu.py \
        tests/test_train.py; then
        B=+QEFFECT_OFFLOAD_STORE_BATCH_MIB=0
        for sched in interleaved zbv; do
            modes="off,resident,resident$B,release,release$B,resident#2,resident#2$B,release#2,release#2$B,off#2"
            step 240 "offload-store-batch-$sched" python3 benchmarks/offload_bench.py \
                --config examples/configs/h2048.toml --schedule "$sched" --steps 20 --modes "$modes" \
                --out "$out/offload-bench-h2048-$sched-store-batch-h200.json"
        done
    fi
    ;;
offload-bank-search)
    # the simulation (CPU, host of zero cost) puts resident with these 4-bank plans at x1.00-1.06 of no offload,
    # with no more bank memory than assign_banks' 4 banks, against x1.11 for the default plan: does the GPU agree?
    I=0:3:0:1:0:3:2:1:0:1:0:3:2:1:0:3  # h2048 Interleaved, 74 MiB of banks (sim x1.000; default 54 MiB x1.115)
    Z=0:3:0:3:2:1:0:1:0:3:0:1:2:0:3:0  # h2048 ZB-V, 74 MiB as the default plan (sim x1.057; default x1.111)
    H=0:1:0:2:1:2:3:2:0:3:0:1:0:3:0:1:0:1:0:2:0:1:2:3:0:3:0:1:3:2:0:3  # h4096 Interleaved, 98 MiB (x1.011)
    B=+QEFFECT_OFFLOAD_BANKS
    offload_ab 200 bank-search-interleaved h2048 interleaved bank-search \
        "off,resident,resident$B=$I,resident@4,resident#2,resident#2$B=$I,resident@4#2,off#2"
    offload_ab 150 bank-search-zbv h2048 zbv bank-search "off,resident,resident$B=$Z,resident#2,resident#2$B=$Z,off#2"
    offload_ab 200 bank-search-h4096 h4096 interleaved bank-search "off,resident,resident$B=$H,resident#2,resident#2$B=$H,off#2"
    ;;
bank-plan-interleaved)
    C3="off,resident,resident-colour,resident#2,resident-colour#2,resident#3,resident-colour#3,off#2"
    offload_ab 200 bank-plan-interleaved h2048 interleaved bank-plan "$C3"
    ;;
bank-plan-zbv-h4096)
    offload_ab 200 bank-plan-zbv h2048 zbv bank-plan \
        "off,resident,resident-colour,resident#2,resident-colour#2,resident#3,resident-colour#3,off#2"
    offload_ab 240 bank-plan-h4096 h4096 interleaved bank-plan "off,resident,resident-colour,resident#2,resident-colour#2,off#2"
    ;;
bank-tries)
    # the capture-time search with 400 tries (the default) against 200 and with 6 banks' memory budget
    T=+QEFFECT_OFFLOAD_SEARCH_TRIES=200
    offload_ab 240 bank-tries-h4096 h4096 interleaved bank-tries "off,resident,resident$T,resident@6,resident#2,resident#2$T,off#2"
    offload_ab 120 bank-tries-zbv h2048 zbv bank-tries "off,resident,resident@6,resident#2,resident@6#2,off#2"
    ;;
resident-window)
    # the simulation: the slot copies inside the forward graphs drop from 289 to 117 MiB per step at h2048
    # (778 to 378 at h4096) and the banks from 84-128 to 40-50 MiB; the copies' cost is outside the model
    M="off,resident-all,resident,resident-all#2,resident#2,off#2"
    for sched in interleaved zbv; do
        offload_ab 150 "resident-window-$sched" h2048 "$sched" resident-window "$M"
    done
    offload_ab 200 resident-window-h4096 h4096 interleaved resident-window "$M"
    ;;
offload-acceptance)
    # issue 7's benchmark with every mode built first, then timed in rounds of 2 steps, the order rotated
    # each round (a busy host's slow spells fall on all alike): off, release, release/la0 (restoring each
    # group only at its own backward: the A/B of the default look-ahead depth 1), resident, resident-memory
    # (the search preferring less memory to fewer copies: the A/B of the default); h2048 both schedules;
    # h4096 Interleaved with off, release, resident (four h4096 pipelines at once would be ~120 GiB)
    h2048_modes offload-acceptance off,release,release/la0,resident,resident-memory
    step 200 offload-acceptance-h4096 python3 benchmarks/offload_bench.py --config examples/configs/h4096.toml \
        --schedule interleaved --steps 30 --interleave 2 --out "$out/offload-bench-h4096-interleaved-h200.json" \
        --modes off,release,resident
    ;;
token-ab)
    # issue 8: h4096's fastest-vs-anchor gap is 0.44 ms of a GPU-bound step; the token copies are ~96 of its
    # 169 device-to-device copies
    switch_ab QEFFECT_TOKEN_COPY=1 token-ab
    ;;
optim-graph)
    # the optimizer step replayed from a CUDA graph (a third of h2048's host time was its launches): its
    # GPU tests, the A/B against the eager step (off, bitwise compared), and issue 7's h2048 modes with it
    step 200 optim-graph-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_adamw.py \
        tests/test_weight_cast_gpu.py tests/test_offload_gpu.py
    switch_ab QEFFECT_OPTIM_GRAPH=0 optim-graph-ab
    h2048_modes offload off,release,resident,release+QEFFECT_OPTIM_GRAPH=0
    ;;
release-depth)
    # release offload once the host runs ahead (optimizer graph): the compute stream's stall at each offload
    # wait, then the look-ahead depth A/B on h2048, both schedules
    step 150 release-waits python3 scripts/offload_waits.py --modes off,release,release/la2 \
        --json "$out/offload-waits-release-h2048-h200.json"
    h2048_modes release-depth off,release,release/la2,release/la3,resident
    ;;
vmm-gpu-cost)
    # do VMM driver calls slow kernels already running? (release at h2048: ~1.3 ms slower, few stalls)
    step 120 vmm-gpu-cost python3 scripts/vmm_gpu_cost.py --json "$out/vmm-gpu-cost-h200.json"
    step 120 vmm-gpu-cost-2mib python3 scripts/vmm_gpu_cost.py --mib 2 --json "$out/vmm-gpu-cost-2mib-h200.json"
    ;;
offload-h4096)
    # issue 7's h4096 modes (Interleaved, 30 steps in rounds of 2)
    h4096_modes off,release,resident
    ;;
release-gaps)
    # where release offload's h2048 step waits for the host: each GPU gap and the host phase that launched late
    for mode in off release resident; do
        step 120 "gaps-h2048-$mode" python3 scripts/step_gaps.py --config examples/configs/h2048.toml \
            --schedule interleaved --offload "$mode" --json "$out/step-gaps-h2048-$mode-h200.json"
    done
    ;;
launch-first)
    # QEFFECT_OFFLOAD_LAUNCH_FIRST=1 (reaps and look-ahead restores after a replay's launch, not before it):
    # the whole GPU suite (the offload tests run both settings), h2048's A/B in both schedules, release's
    # gaps with it (about 8 minutes)
    gpu_suite launch-first-tests
    h2048_modes launch-first off,release,release+QEFFECT_OFFLOAD_LAUNCH_FIRST=1,resident,resident+QEFFECT_OFFLOAD_LAUNCH_FIRST=1
    step 120 gaps-h2048-release-first env QEFFECT_OFFLOAD_LAUNCH_FIRST=1 python3 scripts/step_gaps.py \
        --config examples/configs/h2048.toml --schedule interleaved --offload release \
        --json "$out/step-gaps-h2048-release-launch-first-h200.json"
    ;;
launch-first-depth)
    # the switch read by the manager: the whole GPU suite, then launch-first against release's look-ahead
    # depth 1 and 2 and resident, at h2048 in both schedules (about 7 minutes)
    gpu_suite pytest-gpu
    lf=QEFFECT_OFFLOAD_LAUNCH_FIRST=1
    h2048_modes launch-first-depth "off,release,release+$lf,release/la2,release/la2+$lf,resident,resident+$lf"
    ;;
launch-first-default)
    # launch-first as the default: the whole GPU suite, h4096's modes with the earlier order as the A/B, then
    # where a captured h2048 step's host time goes now (about 8 minutes)
    gpu_suite pytest-gpu
    h4096_modes off,release,release+QEFFECT_OFFLOAD_LAUNCH_FIRST=0,resident
    host_python 150
    ;;
raw-stream)
    # offload's current stream as a raw handle and its event queries through the driver: the whole GPU
    # suite, the host cost of each operation both ways, then issue 7's h2048 modes (about 6 minutes)
    gpu_suite pytest-gpu
    step 60 offload-host-ops python3 scripts/offload_host_ops.py --json "$out/offload-host-ops-h200.json"
    h2048_modes raw-stream off,release,release/la2,resident
    ;;
offload-acceptance-final)
    # the final source: the whole GPU suite, then issue 7's h2048 modes (off / release / resident, both schedules)
    gpu_suite pytest-gpu
    h2048_modes acceptance-final off,release,resident
    ;;
offload-chained)
    # issue 7's h2048 modes with each round's steps queued back to back (--chained: one device synchronization
    # per round of 4 steps, a loop that does not wait for each loss), then synchronized around every step (the
    # default) in the same call, both schedules (about 4 minutes)
    h2048_chained chained off,release,resident
    h2048_modes synchronized off,release,resident
    ;;
share-slots)
    # QEFFECT_OFFLOAD_SHARE_SLOTS=1 (release: nested groups share one slot, 12 groups in 8 or 7 slots): the whole GPU
    # suite (its pipeline offload test runs it in both schedules), then the h2048 A/B, both schedules (about 7 minutes)
    gpu_suite pytest-gpu
    h2048_modes share-slots off,release,release+QEFFECT_OFFLOAD_SHARE_SLOTS=1
    ;;
share-slots-more)
    # slot sharing as the default (=0: a slot per group): the A/B with each round's steps queued back to back
    # (both schedules), then h4096 Interleaved, then issue 7's h2048 modes, both schedules (about 6 minutes)
    noshare=release+QEFFECT_OFFLOAD_SHARE_SLOTS=0
    h2048_chained share-chained "off,$noshare,release"
    h4096_modes "off,$noshare,release,resident"
    h2048_modes offload-final off,release,resident
    ;;
share-runs)
    # slots shared by any run of groups whose backwards follow one another and whose forwards come first (the
    # default, two to a slot): the whole GPU suite, then the h2048 A/B against a slot per group, nested groups
    # only (9db5598's rule) and three to a slot, with resident, both schedules (about 7 minutes)
    gpu_suite pytest-gpu
    sh=QEFFECT_OFFLOAD_SHARE_SLOTS
    h2048_modes share-runs "off,release+$sh=0,release+$sh=nested,release,release+QEFFECT_OFFLOAD_SLOT_MEMBERS=3,resident"
    ;;
resident-chunks)
    # resident's host cost: its 2 MiB chunks make ~9 copies and 9 event records per h2048 group, each a driver
    # call on the host; one copy per group (QEFFECT_OFFLOAD_CHUNK_MIB=0) against them, with off and release,
    # both schedules (about 3 minutes)
    resident_chunks
    ;;
suite-chunks)
    # the whole GPU suite, then resident-chunks' A/B (about 7 minutes)
    gpu_suite pytest-gpu
    resident_chunks
    ;;
release-in-place)
    # release's backward that comes before any hook saw its D2H done reads the bytes in place (the default)
    # against waiting, releasing and restoring (QEFFECT_OFFLOAD_RELEASE_AT_BACKWARD=1), and shared runs needing 4
    # actions between their last forward and first backward (QEFFECT_OFFLOAD_SHARE_GAP=4); resident's one copy
    # per group (CHUNK_MIB=0) against 2 MiB chunks: the whole GPU suite, then h2048 both schedules (about 7 minutes)
    gpu_suite pytest-gpu
    h2048_modes release-in-place "off,release,release+QEFFECT_OFFLOAD_RELEASE_AT_BACKWARD=1,release+QEFFECT_OFFLOAD_SHARE_GAP=4,resident,resident+QEFFECT_OFFLOAD_CHUNK_MIB=0"
    ;;
share-gap)
    # the share gap of 4 actions as the default, backwards before their slot went reading in place: the whole
    # GPU suite, then h2048 off / release / release with any run sharing (SHARE_GAP=0) / resident, both schedules,
    # then h4096 Interleaved off / release / resident (about 8 minutes)
    gpu_suite pytest-gpu
    h2048_modes share-gap off,release,release+QEFFECT_OFFLOAD_SHARE_GAP=0,resident
    h4096_modes off,release,resident
    ;;
repeat-host)
    # issue 7's h2048 modes on another lease, then where release's and resident's host time goes (about 5 minutes)
    h2048_modes repeat off,release,resident
    host_python 200
    ;;
min-window)
    # the trade of memory for time: release and resident leaving more short-window groups on the device
    # (train.offload_min_window 6 / 12 against the default 2), with off#2 as the noise control, h2048 both
    # schedules (about 4 minutes)
    h2048_modes min-window "off,release,release/mw12,resident,resident/mw6,resident/mw12,off#2"
    ;;
default-window)
    # train.offload_min_window's default of 12: the whole GPU suite, then h2048 off / release / resident
    # against both at the old default of 2 (/mw2), off#2 the noise control, both schedules (about 7 minutes)
    gpu_suite pytest-gpu
    h2048_modes default-window "off,release,resident,release/mw2,resident/mw2,off#2"
    ;;
suite-profile-h2048)
    # a session's closing check: the whole GPU suite, then the h2048 te profile matrix with traces and the M
    # analysis (issue 8's figures at the revision that lands; about 6 minutes)
    gpu_suite pytest-gpu
    profile_h2048_te
    ;;
suite-profile-h4096)
    # the whole GPU suite, then the h4096 te profile matrix (issue 8's figures, with each configuration's
    # setup by build phase; about 7 minutes)
    gpu_suite pytest-gpu
    profile_h4096_te
    ;;
suite-profiles)
    # the whole GPU suite, then both te profile matrices (about 7 minutes)
    gpu_suite pytest-gpu
    profile_h4096_te
    profile_h2048_te
    ;;
default-window-h4096)
    # the same at h4096 Interleaved: off / release / resident, resident at the old default (about 3 minutes)
    h4096_modes off,release,resident,resident/mw2
    ;;
offload-repeat)
    # issue 7's h2048 modes again, on another lease (about 2 minutes)
    h2048_modes repeat off,release,resident
    ;;
host-python)
    # where a captured h2048 step's host time goes, by Python function (cProfile), off / release / resident
    host_python 200
    ;;
weight-cast-kernels)
    # the cast's kernels alone on h4096's matrix weights (bits against TE's cast, transpose tile sweep)
    step 150 weight-cast-kernels python3 benchmarks/weight_cast_ab.py --config examples/configs/h4096.toml \
        --sweep --iters 1,2,4,16 --json "$out/weight-cast-kernels-h4096-h200.json"
    ;;
weight-cast)
    # issue 8: the optimizer casts the FP8 weight caches in its pass (TE's weight cast read every weight
    # again: 1.23 ms of the h4096 step); its GPU tests, then the A/B against TE's own cast, bitwise compared
    step 200 weight-cast-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_weight_cast_gpu.py \
        tests/test_adamw.py
    switch_ab QEFFECT_WEIGHT_CAST=0 weight-cast-ab
    ;;
ref-wgrad)
    # the reference wgrad GEMM in the activation dtype (bf16 staging slots): the whole GPU suite, the
    # reference bitwise matrix, then the reference profiles (about 8 minutes)
    gpu_suite pytest-gpu
    verify_reference
    profile_h4096_reference
    profile_h2048_reference
    ;;
ref-wgrad-ab)
    # its A/B in one process: the GEMM in bf16 (default) against fp32 (QEFFECT_REF_WGRAD_DTYPE=weight),
    # bitwise compared per mode, h4096 reference Interleaved, 2 interleaved rounds (about 2 minutes)
    ref_ab_h4096 200 ref-wgrad "off,off+QEFFECT_REF_WGRAD_DTYPE=weight"
    ;;
ref-bias)
    # the reference forward's bias in the FP8 GEMM's epilogue: the reference bitwise matrix, the A/B against
    # the separate add (QEFFECT_REF_BIAS_EPILOGUE=0) at h4096 in one process, then the whole GPU suite
    verify_reference
    ref_ab_h4096 150 ref-bias "off,off+QEFFECT_REF_BIAS_EPILOGUE=0"
    gpu_suite pytest-gpu
    ;;
ref-dbias)
    # the reference bias gradient from the output gradient's quantize pass (branch next/ref-fused-dbias,
    # on next/ref-bias-epilogue): the fused-quantize GPU tests, the reference bitwise matrix, the A/Bs of
    # both at h4096 in one process, the whole GPU suite, the h4096 reference profile (about 7 minutes)
    ref_gpu_tests 120 fq-tests
    verify_reference
    ref_ab_h4096 200 ref-dbias "off,off+QEFFECT_FUSED_DBIAS=0,off+QEFFECT_FUSED_DBIAS=0+QEFFECT_REF_BIAS_EPILOGUE=0"
    gpu_suite pytest-gpu
    profile_h4096_reference
    ;;
ref-branches)
    # the three stacked reference branches at their tip (next/ref-weight-cast: the bias epilogue, the bias
    # gradient from the quantize pass, the weights cast in the optimizer's pass): their GPU tests, the
    # reference bitwise matrix, the A/B of the last two at h4096 in one process (the epilogue's: 6480edd), the whole GPU suite, the
    # h4096 reference profile (about 9 minutes)
    ref_gpu_tests 150 ref-tests
    verify_reference
    ref_ab_h4096 240 ref-branches "off,off+QEFFECT_WEIGHT_CAST=0,off+QEFFECT_FUSED_DBIAS=0"
    gpu_suite pytest-gpu
    profile_h4096_reference
    ;;
ref-final)
    # the main line with the three reference changes (bias epilogue, bias gradient from the quantize pass,
    # weights cast in the optimizer): the whole GPU suite, the reference bitwise matrix, both reference
    # profiles (about 6 minutes)
    gpu_suite pytest-gpu
    verify_reference
    profile_h4096_reference
    profile_h2048_reference
    ;;
ref-transition)
    # the reference quantize pass completing its own scale transition, its bias-gradient sums by column
    # strips, and the bias cast once per epoch: the fused-quantize, fused-update and reference GPU tests,
    # the A/B against the two launches (QEFFECT_FUSED_TRANSITION=0) and torch's bias-gradient sum
    # (QEFFECT_FUSED_DBIAS=0) at h4096 in one process, bitwise compared, the step's kernels, then the
    # reference bitwise matrix (about 6 minutes)
    ref_gpu_tests 150 ref-tests
    step 60 fu-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_update_gpu.py
    ref_ab_h4096 240 ref-transition "off,off+QEFFECT_FUSED_TRANSITION=0,off+QEFFECT_FUSED_DBIAS=0"
    ref_gaps_h4096
    verify_reference
    ;;
quantize-final)
    # the quantize pass's defaults: their GPU tests, the pass's variants in one process, the step's kernels, the
    # reference bitwise matrix (about 4 minutes)
    ref_gpu_tests 200 ref-tests
    step 60 fu-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_update_gpu.py
    step 200 quantize-ab python3 benchmarks/quantize_ab.py --config examples/configs/h4096.toml \
        --json "$out/quantize-ab-h4096-h200.json"
    ref_gaps_h4096
    verify_reference
    ;;
quantize-ab)
    # the fused-quantize GPU tests, then the quantize pass's variants on h4096's launch shapes (about 3 minutes)
    step 120 fq-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_fused_quantize_gpu.py
    step 300 quantize-ab python3 benchmarks/quantize_ab.py --config examples/configs/h4096.toml \
        --json "$out/quantize-ab-h4096-h200.json"
    cat "$LOGS/quantize-ab.log"
    ;;
rank-streams)
    # each rank of the one-process captured pipeline on its own stream: its GPU tests (with the reference
    # backend's and the graph manager's), the h4096 reference A/B against one stream in one process
    # (bitwise compared), the reference bitwise matrix at h2048 (about 6 minutes)
    step 200 rank-streams-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rank_streams_gpu.py \
        tests/test_fp8_reference.py tests/test_graphs_gpu.py
    ref_ab_h4096 200 rank-streams "off,off+QEFFECT_RANK_STREAMS=0"
    verify_reference
    ;;
rank-streams-te)
    # rank streams for the te backend (each rank's captures on a cuBLAS workspace of its own): the rank-stream
    # and weight-cast GPU tests, the h4096 te A/B against one stream (bitwise compared), the te bitwise
    # matrix at h2048 (about 4 minutes)
    step 240 rank-streams-te-tests python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_rank_streams_gpu.py \
        tests/test_weight_cast_gpu.py
    ab_h4096 200 rank-streams-te te "off,off+QEFFECT_RANK_STREAMS=0"
    verify_backend te
    ;;
final-h4096)
    # a closing check in two calls: the whole GPU suite and both h4096 matrices (about 6 minutes) ...
    gpu_suite pytest-gpu
    profile_h4096_te
    profile_h4096_reference
    ;;
final-h2048)
    # ... then both h2048 matrices and the h4096 reference step gaps (about 3 minutes)
    profile_h2048_te
    profile_h2048_reference
    ref_gaps_h4096
    ;;
final-ref)
    # a session's closing check for the reference backend: the whole GPU suite, both reference profile
    # matrices, then the h4096 reference step's kernels and GPU gaps (about 8 minutes)
    gpu_suite pytest-gpu
    profile_h4096_reference
    profile_h2048_reference
    ref_gaps_h4096
    ;;
final-te)
    # and for the te backend: both te profile matrices (about 6 minutes)
    profile_h4096_te
    profile_h2048_te
    ;;
capture-guard)
    # the whole GPU suite with the quantize pass's old settings (4 warps, acquire-release amax atomics), then
    # with 2 warps and relaxed (the defaults since 6d49f37; before GraphManager paused the collector during
    # captures they failed it twice), stopping at the first failure and logging Triton modules loaded during a
    # capture to capture-loads.txt (about 9 minutes)
    step 300 pytest-gpu python3 scripts/suite_with_quantize_settings.py --warps 4 --amax-sem acq_rel -- \
        -m gpu -q -p no:cacheprovider
    step 280 suite-fast python3 scripts/suite_with_quantize_settings.py --warps 2 --amax-sem relaxed -- \
        -m gpu -q -x -p no:cacheprovider
    ;;
suite-ref-h4096)
    # the whole GPU suite, then the h4096 reference profile (about 7 minutes)
    gpu_suite pytest-gpu
    profile_h4096_reference
    ;;
ref-te-h4096)
    # one more sample of both h4096 matrices, on another lease (about 5 minutes)
    profile_h4096_reference
    profile_h4096_te
    ;;
h4096-te)
    # the h4096 te profile alone (one more sample of the host-bound baselines on the machine lent now)
    profile_h4096_te
    ;;
h2048-te)
    # the h2048 te profile alone (traces, M = 2, 4, 8, 16)
    profile_h2048_te
    ;;
offload-waits)
    # how long the compute stream stalls at each resident-offload wait, per category, 2 to 6 banks
    step 240 offload-waits python3 scripts/offload_waits.py --modes off,resident,resident@3,resident@4,resident@6 \
        --json "$out/offload-waits-h2048-h200.json"
    ;;
split-heads)
    # the attention's q, k, v split with a one-copy backward: the GPU suite, then step gaps (every
    # kernel's time per step) with autograd's route and with the split, then the profile
    if step 240 pytest-gpu python3 -m pytest -m gpu -q; then
        gaps_ab QEFFECT_SPLIT_HEADS=autograd autograd-heads split-heads
        profile_h4096_te
    fi
    ;;
bias)
    # TE's biases in the activation dtype (cast once per step): the TE tests, then the whole GPU suite and
    # the h4096 te profile
    if step 200 bias-tests python3 -m pytest -m gpu -q tests/test_te_backend.py tests/test_adamw.py; then
        step 240 pytest-gpu python3 -m pytest -m gpu -q
        profile_h4096_te
    fi
    ;;
fold)
    # the staged fold inside the Triton AdamW's pass: its GPU tests (the pass against fold + torch's AdamW,
    # and training steps against native eager), then the whole GPU suite and the A/B with the block sweep
    if step 200 fold-tests python3 -m pytest -m gpu -q tests/test_adamw.py tests/test_accumulate_gpu.py; then
        step 240 pytest-gpu python3 -m pytest -m gpu -q
        step 120 adamw-ab python3 benchmarks/adamw_ab.py --config examples/configs/h4096.toml --fold-sweep \
            --json "$out/adamw-ab-h4096-h200.json"
    fi
    ;;
adamw)
    # the Triton AdamW: its GPU tests (bits against torch's fused kernel), the A/B benchmark on h4096's
    # parameters, the arithmetic diagnostic, then the whole GPU suite (native eager keeps torch's AdamW,
    # so every bitwise native-vs-qeffect test covers it)
    step 120 adamw-tests python3 -m pytest -m gpu -q tests/test_adamw.py
    step 200 adamw-ab python3 benchmarks/adamw_ab.py --config examples/configs/h4096.toml \
        --json "$out/adamw-ab-h4096-h200.json"
    step 60 adamw-bits python3 scripts/adamw_bits.py --json "$out/adamw-bits-h200.json"
    step 300 pytest-gpu python3 -m pytest -m gpu -q
    ;;
layernorm)
    # the model's Triton LayerNorm: its GPU tests, then (only if they pass) the whole GPU suite (the
    # native-vs-qeffect bitwise tests run it on both sides) and the h4096 profiles
    if step 120 layernorm-tests python3 -m pytest -m gpu -q tests/test_layernorm.py; then
        step 240 pytest-gpu python3 -m pytest -m gpu -q
        profile_h4096_te
        step 150 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
            --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    fi
    ;;
model-anchor)
    # te-graphed-model (TE's per-layer graphs in the whole model, fp32 masters): its GPU test, then (only if
    # it passes) the h4096 and h2048 te matrices, both anchors in each
    if step 200 model-anchor-test python3 -m pytest -m gpu -q tests/test_lazy_rows.py \
            tests/test_profile.py -k "lazy or te_anchors or profile_on_cuda"; then
        profile_h4096_te
        profile_h2048_te
    fi
    ;;
mcore-anchor)
    # te-graphed-mcore (te-graphed-model as Megatron-LM sets TE up): the TE references' GPU tests, then (only
    # if they pass) the h4096 and h2048 te matrices, every reference in each
    if step 200 mcore-anchor-test python3 -m pytest -m gpu -q tests/test_profile.py \
            -k "te_anchors or megatron or whole_model"; then
        profile_h4096_te
        profile_h2048_te
    fi
    ;;
lazy-rows)
    # the token table's row-lazy AdamW: its GPU tests and the optimizer's, then (only if they pass) the
    # whole GPU suite and the h4096 te profile
    if step 200 lazy-rows-tests python3 -m pytest -m gpu -q tests/test_lazy_rows.py tests/test_adamw.py \
            tests/test_weight_cast_gpu.py tests/test_embedding_grad.py; then
        step 300 pytest-gpu python3 -m pytest -m gpu -q
        profile_h4096_te
    fi
    ;;
ln-embedding)
    # the LayerNorm partial sums as a Triton pass and the token table's pairwise renumbering: their GPU
    # tests, the LayerNorm backward's rows-per-program sweep, then (only if the tests pass) the whole GPU
    # suite and h4096's per-kernel step table
    if step 150 ln-embedding-tests python3 -m pytest -m gpu -q tests/test_layernorm.py tests/test_embedding_grad.py; then
        step 90 layernorm-backward python3 benchmarks/layernorm_backward.py --json "$out/layernorm-backward-h200.json"
        step 300 pytest-gpu python3 -m pytest -m gpu -q
        step 120 step-gaps-h4096 python3 scripts/step_gaps.py --config examples/configs/h4096.toml \
            --json "$out/step-gaps-h4096-te-h200.json"
    fi
    ;;
gil)
    # do the VMM driver calls release the GIL (a driver thread for release offload needs them to)?
    step 30 gil-control python3 scripts/gil_check.py --control
    step 30 gil python3 scripts/gil_check.py --json "$out/gil-check-h200.json"
    ;;
profile-h2048)
    step 280 profile-h2048 python3 benchmarks/profile_matrix.py --out "$out" --only h2048:reference,h2048:te \
        --steps 20 --warmup 3 --trace 3
    ;;
profile-h4096)
    step 290 profile-h4096-reference python3 benchmarks/profile_matrix.py --out "$out" --only h4096:reference \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    step 290 profile-h4096-te python3 benchmarks/profile_matrix.py --out "$out" --only h4096:te \
        --steps 12 --warmup 3 --trace 2 --microbatches 2,16
    ;;
*)
    echo "usage: gpu_session.sh OUT accumulate|refresh|split-heads|bias|fold|adamw|layernorm|verify|staged|offload|offload-final|offload-next|resident-skip|release-window|replay-protocol|combined|combined2|combined3|kernel-transpose|fused-update|fused-quantize|fused-quantize-profile|profile-h2048|profile-h4096 ..." >&2
    exit 2
    ;;
esac
done
