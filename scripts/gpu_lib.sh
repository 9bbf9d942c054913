# Shared by scripts/gpu_session.sh and scripts/gpu_multi.sh (source it; set LOGS first).
#
# step <seconds> <log name> <command...>: run the command under its own time limit (one hang cannot cost
# the other steps), its output to $LOGS/<name>.log, then print its exit status, duration and summary lines.
step() {
    local t=$1 name=$2
    shift 2
    echo "== $name: $*"
    local t0=$SECONDS
    timeout "$t" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - t0)) s"
    grep -E "passed|failed|ERROR|Error|mismatch|PASS|FAIL|median|speedup|efficiency|graphs|x native|bitwise|trace:|floor|returned|x[0-9.]+ vs|ratios|GIL" \
        "$LOGS/$name.log" | grep -v Warning | tail -40
    return $rc
}
