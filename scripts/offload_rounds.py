"""Offload's step ratio against the host's speed, round by round, from `offload_bench.py` results.

Why: release offload's step follows the host that queues it, and the lent hosts differ from lease to lease
and from minute to minute (no offload's h2048 step queued in 3.3 to 8.9 ms in committed runs), so one run's
median ratio says as much about the host as about the code. `offload_bench.py --interleave N` times every
mode in the same rounds; this reads those rounds back and bins each round's ratio (the mode's median step
over `off`'s in that round, as `paired_step_ratio_vs_off` pairs them) by how long the host took to queue
`off`'s step in that round: what each mode costs on a host of a given speed. CPU only; reads JSON.

    python3 scripts/offload_rounds.py benchmarks/results/offload-bench-h2048-*-7f1718e-h200.json
    python3 scripts/offload_rounds.py --edges 4,5,6 --json /tmp/rounds.json FILE...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import script_provenance

DEFAULT_EDGES = (4.0, 4.5, 5.0, 5.5, 6.0, 7.0)


def round_ratios(times: list[float], off_times: list[float], block: int) -> list[float]:
    """`benchmarks/offload_bench.py`'s pairing of a mode's rounds with off's (the one its
    `paired_step_ratio_vs_off` takes the median of)."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from offload_bench import round_ratios as bench_round_ratios

    return bench_round_ratios(times, off_times, block)


def rounds(report: dict, mode: str) -> list[tuple[float, float]]:
    """(off's median host queue in ms, the mode's median step / off's) for each round of an interleaved run."""
    block = report.get("interleave")
    if not block:
        raise ValueError("not an interleaved run (--interleave): its modes were not timed in the same rounds")
    off, this = report["modes"]["off"], report["modes"][mode]
    hosts = off["host_step_seconds"]
    ratios = round_ratios(this["step_seconds"], off["step_seconds"], block)
    return [(1e3 * statistics.median(hosts[i * block:(i + 1) * block]), r) for i, r in enumerate(ratios)]


def binned(points: list[tuple[float, float]], edges: tuple[float, ...]) -> list[dict[str, Any]]:
    """The points grouped by host queue: [0, e0), [e0, e1), ..., [eN, inf); empty bins left out."""
    bounds = [0.0, *edges, float("inf")]
    out = []
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        ratios = [r for host, r in points if lo <= host < hi]
        if ratios:
            out.append({"host_ms_from": lo, "host_ms_to": None if hi == float("inf") else hi, "rounds": len(ratios),
                        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios), "max_ratio": max(ratios)})
    return out


def analyse(paths: list[Path], modes: list[str], edges: tuple[float, ...]) -> list[dict[str, Any]]:
    """One row per (config, schedule, mode): its rounds from every file that has the mode, binned."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for path in paths:
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable JSON report ({err})") from err
        if "modes" not in report or "off" not in report.get("modes", {}):
            raise ValueError(f"{path}: not an offload_bench.py report with an `off` mode")
        for mode in modes:
            if mode not in report["modes"]:
                continue
            try:
                points = rounds(report, mode)
            except (KeyError, ValueError) as err:
                raise ValueError(f"{path}: {err}") from err
            key = (Path(str(report.get("config", "?"))).name, str(report.get("schedule", "?")), mode)
            g = groups.setdefault(key, {"config": key[0], "schedule": key[1], "mode": mode, "files": [], "points": []})
            g["files"].append(path.name)
            g["points"] += points
    return [{**g, "bins": binned(g["points"], edges)} for g in groups.values()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path, help="offload_bench.py JSON reports (run with --interleave)")
    ap.add_argument("--modes", default="release,resident", help="comma-separated modes (default: release,resident)")
    ap.add_argument("--edges", default=",".join(map(str, DEFAULT_EDGES)),
                    help="bin edges of off's host queue in ms, ascending (default: %(default)s)")
    ap.add_argument("--json", type=Path, help="also write the rows, with every round, to this file")
    a = ap.parse_args()
    try:
        edges = tuple(float(e) for e in a.edges.split(","))
    except ValueError:
        ap.error(f"--edges must be numbers separated by commas, got {a.edges!r}")
    if list(edges) != sorted(set(edges)) or edges[0] <= 0:
        ap.error(f"--edges must be positive and strictly ascending, got {a.edges!r}")
    try:
        rows = analyse(a.files, [m for m in a.modes.split(",") if m], edges)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if not rows:
        print(f"error: none of the files has the modes {a.modes}", file=sys.stderr)
        return 1
    for row in rows:
        print(f"{row['config']} {row['schedule']} {row['mode']} ({len(row['points'])} rounds, {len(row['files'])} files):")
        for b in row["bins"]:
            to = f"{b['host_ms_to']:.1f}" if b["host_ms_to"] is not None else "inf"
            print(f"  off queued in [{b['host_ms_from']:.1f}, {to}) ms: {b['rounds']:3d} rounds, "
                  f"median x{b['median_ratio']:.3f} (x{b['min_ratio']:.3f}-{b['max_ratio']:.3f})")
    if a.json:
        write_json(a.json, {**script_provenance(), "edges_ms": list(edges), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
