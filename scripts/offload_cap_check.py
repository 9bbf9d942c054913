"""Offload that pays, under a memory cap: the capped `h4096-long` pair on one GPU.

    source .gpu-kit/setup.sh
    python3 scripts/offload_cap_check.py --config examples/configs/h4096-long.toml --steps 20 \
        --dir /tmp/cap --json $OUT/offload-cap-h4096-long.json

Four `qeffect train` runs, each in its own process (a cap is per process, and a refused run must not
leave memory behind for the next):

1. uncapped, no offload (`train.memory_fraction = 0`), a checkpoint at the last step: the reference;
2. uncapped, `offload.mode = release`: its peak places the cap;
3. capped, no offload: must stop with the one-line refusal and a nonzero status;
4. capped, `release`: must train every step, its last checkpoint bitwise equal to run 1's.

The cap bounds what torch's caching allocator reserves plus offload's mapped slots (CUDA VMM, counted with
it under a cap), so it must lie above what run 2 reserved and mapped and below what run 1 reserved
(`summary.json`'s `peak_reserved_bytes` and `offload_peak_mapped_bytes`). What run 1 reserved beyond what it
allocated is mostly its graphs' private pools, which the allocator cannot give back while the graphs live,
so it is the upper end of the search, not a proof: run 3 must still be refused. It is the config's own
`train.memory_fraction` when that lies between the two on this device (so that on the GPU the config was
written for, that is what is checked); otherwise the fraction halfway between them, and the report says so.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from qeffect.checkpoint import diff_checkpoints
from qeffect.cli.common import write_json
from qeffect.config import apply_sets, load_config
from qeffect.graphs.handshake import git_revision

REFUSAL_MARK = "does not fit in"


def train(config: str, steps: int, out: Path, sets: list[str], checkpoint: bool) -> dict:
    """One `qeffect train` process; its status, wall time, last lines and summary (None if it wrote none)."""
    cmd = [sys.executable, "-m", "qeffect", "train", "-c", config, "--steps", str(steps), "--out", str(out),
           "--set", "train.eval_every=0"]
    if checkpoint:
        cmd += ["--checkpoint-every", str(steps)]
    for s in sets:
        cmd += ["--set", s]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    summary = out / "summary.json"
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    print(f"== {' '.join(cmd[3:])}: rc={p.returncode} in {wall:.0f} s; last: {lines[-1] if lines else ''}", flush=True)
    return {"command": " ".join(["python3"] + cmd[1:]), "returncode": p.returncode, "wall_s": wall,
            "last_lines": lines[-4:], "summary": json.loads(summary.read_text()) if summary.exists() else None}


def peak(run: dict, key: str = "peak_allocated_bytes") -> int | None:
    s = run["summary"]
    return None if s is None else s.get(key)


def place_cap(total: int, *, release_reserved: int, off_reserved: int, own: float) -> tuple[float, str] | str:
    """The cap as a fraction of `total` device bytes and why; or, where none separates the runs, why not.

    The cap bounds what the caching allocator reserves (graph pools included) and offload's mapped slots,
    so release needs what it reserved and mapped (`release_reserved`), not what it allocated; no offload
    must not fit, and its reserved peak (`off_reserved`) is the upper end: its graph pools stay reserved
    as long as its graphs live, whatever a cap asks (the capped run of no offload is the proof)."""
    low, high = release_reserved, off_reserved
    if low >= high:
        return (f"no cap separates the two runs: release reserved and mapped {low / 2**30:.1f} GiB, no offload "
                f"reserved {high / 2**30:.1f} GiB")
    if own and low < own * total < high:
        return own, "the config's own train.memory_fraction (between the two uncapped peaks here)"
    return round((low + high) / 2 / total, 4), (
        f"halfway between release's reserved and mapped peak and no offload's reserved peak, uncapped (the config's "
        f"{own} = {own * total / 2**30:.1f} GiB does not lie between {low / 2**30:.1f} and {high / 2**30:.1f} GiB on "
        "this device)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h4096-long.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dir", required=True, help="scratch folder for the four run folders and checkpoints")
    ap.add_argument("--json", required=True)
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override for all four runs, as `qeffect train --set` takes it; repeatable "
                         "(train.memory_fraction and offload.mode are the script's)")
    a = ap.parse_args()
    cfg = apply_sets(load_config(a.config), a.set)
    total = torch.cuda.get_device_properties(0).total_memory
    root = Path(a.dir)
    report: dict = {"kind": "offload-cap", "command": " ".join(["python3"] + sys.argv),
                    "git_revision": git_revision() or "unknown", "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__, "config": a.config, "sets": a.set, "steps": a.steps,
                    "total_bytes": total}
    runs = report["runs"] = {}
    runs["uncapped-off"] = train(a.config, a.steps, root / "off",
                                 [*a.set, "train.memory_fraction=0", "offload.mode=\"off\""], checkpoint=True)
    runs["uncapped-release"] = train(a.config, a.steps, root / "release",
                                     [*a.set, "train.memory_fraction=0", "offload.mode=\"release\""],
                                     checkpoint=False)
    p_off, p_rel = peak(runs["uncapped-off"]), peak(runs["uncapped-release"])
    r_off = peak(runs["uncapped-off"], "peak_reserved_bytes")
    r_rel = peak(runs["uncapped-release"], "peak_reserved_bytes")
    mapped = peak(runs["uncapped-release"], "offload_peak_mapped_bytes") or 0
    if p_off is None or p_rel is None or r_rel is None or r_off is None:
        report["verdict"] = "an uncapped run failed: no cap to place"
        write_json(Path(a.json), report)
        print(report["verdict"])
        return 1
    placed = place_cap(total, release_reserved=r_rel + mapped, off_reserved=r_off, own=cfg.train.memory_fraction)
    if isinstance(placed, str):
        report["verdict"] = placed
        write_json(Path(a.json), report)
        print(report["verdict"])
        return 1
    fraction, why = placed
    report["cap"] = {"fraction": fraction, "bytes": int(fraction * total), "why": why,
                     "uncapped_off_peak_bytes": p_off, "uncapped_off_peak_reserved_bytes": r_off,
                     "uncapped_release_peak_bytes": p_rel,
                     "uncapped_release_peak_reserved_bytes": r_rel, "uncapped_release_peak_mapped_bytes": mapped}
    print(f"cap: {fraction} of {total / 2**30:.1f} GiB = {fraction * total / 2**30:.1f} GiB: {why}", flush=True)
    runs["capped-off"] = train(a.config, a.steps, root / "capped-off",
                               [*a.set, f"train.memory_fraction={fraction}", "offload.mode=\"off\""],
                               checkpoint=False)
    runs["capped-release"] = train(a.config, a.steps, root / "capped-release",
                                   [*a.set, f"train.memory_fraction={fraction}", "offload.mode=\"release\""],
                                   checkpoint=True)
    off = runs["capped-off"]
    refused = off["returncode"] != 0 and any(REFUSAL_MARK in ln for ln in off["last_lines"])
    rel = runs["capped-release"]
    trained = rel["returncode"] == 0 and rel["summary"] is not None
    diff = None
    if trained:
        d = diff_checkpoints(root / "off" / "checkpoints", root / "capped-release" / "checkpoints")  # each one's latest
        diff = {"identical": d.identical, "tensors_compared": d.tensors_compared,
                "tensors_differing": [t.model_dump() for t in d.tensors_differing][:10],
                "state_differences": d.state_differences}
    report["capped_off_refused"] = refused
    report["capped_release_trained"] = trained
    report["capped_release_vs_uncapped_off"] = diff
    ok = refused and trained and diff is not None and diff["identical"]
    report["passed"] = ok
    write_json(Path(a.json), report)
    print(f"capped no-offload refused in one line: {refused}; capped release trained {a.steps} steps: {trained}; "
          f"bitwise equal to the uncapped run without offload: {diff['identical'] if diff else None} "
          f"({diff['tensors_compared'] if diff else 0} tensors) -> {'passed' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
