# Helpers for scripts/gpu/check.sh (source it). No QEFFECT_* switch is set here: reports take the
# revision from QEFFECT_GIT_REVISION if set, else from git (qeffect.graphs.handshake.git_revision).
#
#   check_begin PART OUTDIR    OUT=<absolute OUTDIR>, LOG=$OUT/check-PART.log; prints revision and GPUs
#   step NAME SECONDS CMD...   run CMD under its own time limit, its output appended to $LOG; print its
#                              status and summary lines; a failure is recorded, never fatal
#   merge_json KIND OUT FILE... one JSON {kind, git_revision, device, runs: {stem: report}} of several reports
#   tag_revision FILE          add git_revision (and device) to a report that lacks them
#   check_end                  list the failed steps; exit 1 if any failed
#
# CHECK_DRY_RUN=1: print each step's command instead of running it (no GPU needed).

FAILED=()
STEPS=0

check_begin() {
    PART=$1
    mkdir -p "$2" || exit 2
    OUT=$(cd "$2" && pwd)
    LOG=$OUT/check-$PART.log
    : > "$LOG"
    export PYTHONUNBUFFERED=1
    T0=$SECONDS
    if [ -n "${CHECK_DRY_RUN:-}" ]; then
        NGPU=${CHECK_DRY_RUN_GPUS:-1}
        echo "== $PART (dry run, $NGPU GPU(s)) -> $OUT"
        return
    fi
    local info err rev gpu
    err=$(mktemp)
    if ! info=$(python3 -c "
import torch
from qeffect.graphs.handshake import git_revision
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(n, git_revision() or 'unknown', torch.cuda.get_device_name(0) if n else '-')" 2>"$err"); then
        echo "qeffect does not import here: run 'source .gpu-kit/setup.sh' in the repository root first" >&2
        tail -3 "$err" >&2
        rm -f "$err"
        exit 2
    fi
    rm -f "$err"
    read -r NGPU rev gpu <<< "$(echo "$info" | tail -1)"
    if [ "$NGPU" -lt 1 ]; then
        echo "no CUDA device here" >&2
        exit 2
    fi
    if [ "$rev" = unknown ]; then
        echo "warning: no .git and QEFFECT_GIT_REVISION unset: reports will say git_revision 'unknown'" >&2
    fi
    echo "== $PART at $rev on $NGPU GPU(s): $gpu -> $OUT"
}

step() {
    local name=$1 limit=$2
    shift 2
    STEPS=$((STEPS + 1))
    if [ -n "${CHECK_DRY_RUN:-}" ]; then
        printf '== %s (%ss):' "$name" "$limit"
        printf ' %q' "$@"
        echo
        return 0
    fi
    echo "== $name: $*"
    { echo; echo "===== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*"; } >> "$LOG"
    local t0=$SECONDS rc
    timeout --kill-after=15 "$limit" "$@" >> "$LOG" 2>&1
    rc=$?
    echo "===== $name: rc=$rc in $((SECONDS - t0)) s" >> "$LOG"
    # the step's summary lines: test counts, verdicts, medians, ratios, targets
    sed -n "/^===== $name (/,\$p" "$LOG" \
        | grep -v "^=====" \
        | grep -E "passed|failed|FAILED|error|Error|ERROR|mismatch|identical|median|x[0-9.]+ vs|speedup|efficiency|target|floor|returned|not run" \
        | grep -v -E "Warning|warnings.warn" | tail -25
    if [ $rc -eq 0 ]; then
        echo "== $name: ok in $((SECONDS - t0)) s"
    else
        [ $rc -eq 124 ] && echo "== $name: TIMED OUT after ${limit} s" || echo "== $name: FAILED (rc=$rc) in $((SECONDS - t0)) s"
        FAILED+=("$name")
    fi
    return $rc
}

merge_json() {  # merge_json KIND OUT FILE...: missing files are listed under "missing"
    local kind=$1 dest=$2
    shift 2
    [ -n "${CHECK_DRY_RUN:-}" ] && { echo "== merge $kind -> $dest"; return 0; }
    python3 - "$kind" "$dest" "$@" <<'PY'
import json, sys
from pathlib import Path

import torch

from qeffect.graphs.handshake import git_revision

kind, dest, files = sys.argv[1], Path(sys.argv[2]), [Path(f) for f in sys.argv[3:]]
runs = {f.stem: json.loads(f.read_text()) for f in files if f.is_file()}
merged = {"kind": kind, "git_revision": git_revision() or "unknown",
          "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
          "gpus": torch.cuda.device_count(), "runs": runs,
          "missing": [f.stem for f in files if not f.is_file()]}
dest.write_text(json.dumps(merged, indent=1) + "\n")
print(f"{dest.name}: {len(runs)} reports" + (", missing: " + ", ".join(merged["missing"]) if merged["missing"] else ""))
PY
}

tag_revision() {  # tag_revision FILE: provenance for reports whose writer records no revision
    [ -n "${CHECK_DRY_RUN:-}" ] && return 0
    [ -f "$1" ] || return 0
    python3 - "$1" <<'PY'
import json, sys
from pathlib import Path

import torch

from qeffect.graphs.handshake import git_revision

p = Path(sys.argv[1])
d = json.loads(p.read_text())
d.setdefault("git_revision", git_revision() or "unknown")
if torch.cuda.is_available():
    d.setdefault("device_name", torch.cuda.get_device_name())
p.write_text(json.dumps(d, indent=1) + "\n")
PY
}

check_end() {
    echo "== $PART: $STEPS steps, ${#FAILED[@]} failed in $((SECONDS - T0)) s${FAILED[*]:+: ${FAILED[*]}}; log $LOG"
    [ ${#FAILED[@]} -eq 0 ]
}
