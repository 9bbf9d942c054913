#!/usr/bin/env bash
# Mutation testing of the runtime contracts (src/qeffect/contracts/) and the bitwise oracle's comparison
# (verify/state.py: bits, bitwise_equal, flip_lowest_bit, _Tally) with mutmut, on a CPU machine.
#
# Not part of .ci/run. Needs the `mutation` extra: pip install -e ".[dev,mutation]".
# The test selection and the files to mutate are [tool.mutmut] in pyproject.toml. mutmut writes a mutants/
# folder, so the run happens in a scratch copy of the tree (never in the checkout):
#
#   scripts/mutation.sh [SCRATCH_DIR] [MAX_CHILDREN]
#
# Prints mutmut's per-mutant results and writes SCRATCH_DIR/mutation-summary.json (mutants, killed,
# survived, ... per area, and every survivor's name). `mutmut show NAME` in SCRATCH_DIR shows a mutant.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)/qeffect-mutation}"
children="${2:-2}"
mkdir -p "$work"
(cd "$root" && tar --exclude=./.git --exclude=./.venv --exclude=./mutants --exclude=__pycache__ -cf - .) | (cd "$work" && tar xf -)
cd "$work"
# the copy's sources, not an editable install's (mutmut puts mutants/src ahead of this)
export PYTHONPATH="$work/src${PYTHONPATH:+:$PYTHONPATH}"
# every contract function, and the comparison's functions of verify/state.py (mutant names are globs)
names=("qeffect.contracts.*"
       "qeffect.verify.state.x_bits__mutmut_*" "qeffect.verify.state.x_bitwise_equal__mutmut_*"
       "qeffect.verify.state.x_flip_lowest_bit__mutmut_*" "qeffect.verify.state.xǁ_Tallyǁ*")
python3 -m mutmut run --max-children "$children" "${names[@]}" || true
python3 -m mutmut results --all true > mutation-results.txt
python3 - "$work" <<'EOF'
import collections, json, re, sys
from pathlib import Path

work = Path(sys.argv[1])
rows = [l.strip().rsplit(": ", 1) for l in (work / "mutation-results.txt").read_text().splitlines() if ": " in l]
comparison = re.compile(r"^qeffect\.verify\.state\.(x_bits__|x_bitwise_equal__|x_flip_lowest_bit__|xǁ_Tallyǁ)")
areas = {"contracts": lambda n: n.startswith("qeffect.contracts."), "comparison": comparison.match}
out = {}
for area, member in areas.items():
    mine = [(n, s) for n, s in rows if member(n)]
    counts = collections.Counter(s for _, s in mine)
    out[area] = {"mutants": len(mine), **dict(sorted(counts.items())),
                 "survivors": sorted(n for n, s in mine if s != "killed")}
(work / "mutation-summary.json").write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
for area, d in out.items():
    print(area, {k: v for k, v in d.items() if k != "survivors"}, f"{len(d['survivors'])} not killed")
EOF
echo "results: $work/mutation-results.txt, summary: $work/mutation-summary.json"
