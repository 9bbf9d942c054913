"""Producer-consumer race check of the replay handshake (paper: 3 fresh processes x 200 checks).

The captured graph reads a static input `i`, spins for about a millisecond (`fp8.te_compat.cuda_sleep`),
then writes f(i) = 2 i + 1 into its static output. For each check the caller (on its own stream)
first does a little work of its own (a short spin), then writes a new `i` into a fresh tensor,
replays through the manager with that tensor as the dynamic input, snapshots the output with a clone
on the caller stream, copies it to pinned host memory and synchronizes the caller stream only. A read
is stale when the snapshot is not f(i).

- one-way (GraphPP's defect): the caller's clone is not ordered after the graph tail, so it reads the
  previous output while the graph still spins: stale reads expected in every check.
- two-way: the graph stream waits on the caller (so the copy of `i` sees the caller's write even
  though the caller was busy) and the caller waits on the graph-tail event: 0 stale reads expected.
- stream-ordered: the copy and the graph run on the caller's own stream, so the clone is behind the
  graph by stream order: 0 stale reads expected.

`python -m qeffect.graphs.handshake --protocol two-way --checks 200 --json PATH` runs one fresh
process; `run_handshake_suite` launches those processes and sums them.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from qeffect.config import RunConfig, bit_changing_settings
from qeffect.fp8.te_compat import cuda_sleep

PROTOCOLS: tuple[str, ...] = ("one-way", "two-way", "stream-ordered")
SAFE: tuple[str, ...] = ("two-way", "stream-ordered")  # must show no stale read
# ~1 ms at the H200's 1.98 GHz boost clock; longer at lower clocks, which only widens the race window.
GRAPH_SLEEP_CYCLES = 2_000_000
CALLER_SLEEP_CYCLES = 200_000


def expected(i: int) -> float:
    """f(i) written by the graph; exact in float32 for every i used here."""
    return float(2 * i + 1)


class HandshakeResult(BaseModel):
    """One process's checks for one protocol."""

    protocol: str
    checks: int
    stale_reads: int
    seconds: float
    device_name: str | None = None
    torch_version: str | None = None
    # The first few stale reads as (i, value read); f(i) = 2 i + 1 was expected.
    stale_examples: list[tuple[int, float]] = Field(default_factory=list)


class ProtocolSummary(BaseModel):
    protocol: str
    processes: int
    checks: int  # all processes together
    stale_reads: int
    runs: list[HandshakeResult]


class HandshakeReport(BaseModel):
    schema_version: int = 1
    kind: Literal["handshake"] = "handshake"
    processes: int
    checks_per_process: int
    protocols: list[ProtocolSummary]
    passed: bool  # one-way showed stale reads (the check can see a race) and two-way showed none
    command: str | None = None
    git_revision: str | None = None
    device_name: str | None = None
    torch_version: str | None = None


class HandshakeError(RuntimeError):
    """A handshake subprocess failed (not a stale read: the check itself did not run)."""


# ------------------------------------------------------------------------------------ in-process
def run_handshake_check(protocol: str, checks: int = 200, device: str = "cuda", *,
                        graph_sleep_cycles: int = GRAPH_SLEEP_CYCLES,
                        caller_sleep_cycles: int = CALLER_SLEEP_CYCLES) -> HandshakeResult:
    """Run `checks` producer-consumer checks through a `GraphManager(protocol=protocol)`."""
    import torch

    from qeffect.graphs.manager import GraphManager

    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    dev = torch.device(device)
    with torch.cuda.device(dev):
        mgr = GraphManager(dev, protocol=protocol)  # type: ignore[arg-type]
        x = torch.zeros(1, device=dev, dtype=torch.float32)
        out = torch.full((1,), -1.0, device=dev, dtype=torch.float32)

        def body() -> torch.Tensor:
            y = x * 2 + 1  # read i first ...
            cuda_sleep(graph_sleep_cycles)  # ... then stay busy ...
            out.copy_(y)  # ... and publish f(i) only at the tail
            return out

        action = mgr.capture("handshake", body, static_inputs={"i": x}, warmup=1)
        caller = torch.cuda.current_stream(dev)
        host = torch.empty(1, dtype=torch.float32, pin_memory=True)
        torch.cuda.synchronize(dev)
        stale, examples = 0, []
        t0 = time.perf_counter()
        for k in range(checks):
            i = k + 1  # warm-up left f(0) in `out`: never the answer of a check
            cuda_sleep(caller_sleep_cycles)  # caller still busy when replay is enqueued
            dyn = torch.full((1,), float(i), device=dev, dtype=torch.float32)
            res = mgr.replay(action, {"i": dyn})
            del dyn  # freed at once: record_stream must keep it alive for the graph stream's copy
            snap = res.clone()  # consumer, on the caller stream
            host.copy_(snap, non_blocking=True)
            caller.synchronize()  # the caller stream only, never the graph stream
            got = float(host.item())
            if got != expected(i):
                stale += 1
                if len(examples) < 5:
                    examples.append((i, got))
        seconds = time.perf_counter() - t0
        torch.cuda.synchronize(dev)
        return HandshakeResult(protocol=protocol, checks=checks, stale_reads=stale, seconds=seconds,
                               device_name=torch.cuda.get_device_name(dev), torch_version=torch.__version__,
                               stale_examples=examples)


# ---------------------------------------------------------------------------------- subprocesses
def _run_child(protocol: str, checks: int, json_path: Path, device: str) -> HandshakeResult:
    """One fresh process: its own CUDA context, allocator and streams."""
    cmd = [sys.executable, "-m", "qeffect.graphs.handshake", "--protocol", protocol, "--checks", str(checks),
           "--device", device, "--json", str(json_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        raise HandshakeError(f"handshake process ({protocol}) exited {proc.returncode}: {tail[0]}")
    return HandshakeResult.model_validate_json(json_path.read_text())


def run_settings(cfg: RunConfig) -> dict[str, Any]:
    """The settings a run or measurement ran under, for provenance (summaries, checkpoints' configs, reports):
    every bit-changing setting (`config.bit_changing_settings`) and the `[runtime]` section, as
    `section.field -> value`. Two runs of one revision can differ only by their config, never by the
    environment: nothing reads a switch from it."""
    runtime = {f"runtime.{k}": v for k, v in cfg.runtime.model_dump().items()}
    return {**bit_changing_settings(cfg), **runtime}


def script_provenance() -> dict[str, str]:
    """What a benchmark or check script's JSON records first: the command line that ran and the revision."""
    return {"command": " ".join(["python3", *sys.argv]), "git_revision": git_revision() or "unknown"}


def gpu_provenance(device: object = None) -> dict[str, str]:
    """`script_provenance` plus the GPU's name and torch's version: what a GPU script's JSON records first."""
    import torch

    return {**script_provenance(), "device": torch.cuda.get_device_name(device), "torch": torch.__version__}


def git_revision() -> str | None:
    """QEFFECT_GIT_REVISION if set (machines with a copy of the tree but no .git), else git HEAD."""
    env = os.environ.get("QEFFECT_GIT_REVISION")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10)
        return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def run_handshake_suite(processes: int = 3, checks: int = 200, *, device: str = "cuda",
                        command: str | None = None,
                        progress: Callable[[str, int], None] | None = None) -> HandshakeReport:
    """`processes` fresh processes per protocol, `checks` checks each; stale reads summed per protocol."""
    summaries = []
    with tempfile.TemporaryDirectory(prefix="qeffect-handshake-") as tmp:
        for protocol in PROTOCOLS:
            runs = []
            for p in range(processes):
                runs.append(_run_child(protocol, checks, Path(tmp) / f"{protocol}-{p}.json", device))
                if progress:
                    progress(protocol, p)
            summaries.append(ProtocolSummary(protocol=protocol, processes=processes, checks=sum(r.checks for r in runs),
                                             stale_reads=sum(r.stale_reads for r in runs), runs=runs))
    by = {s.protocol: s for s in summaries}
    first = summaries[0].runs[0] if summaries and summaries[0].runs else None
    return HandshakeReport(processes=processes, checks_per_process=checks, protocols=summaries,
                           passed=by["one-way"].stale_reads > 0 and all(by[p].stale_reads == 0 for p in SAFE if p in by),
                           command=command, git_revision=git_revision(),
                           device_name=first.device_name if first else None,
                           torch_version=first.torch_version if first else None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m qeffect.graphs.handshake", description=__doc__.splitlines()[0])
    ap.add_argument("--protocol", choices=PROTOCOLS, required=True)
    ap.add_argument("--checks", type=int, default=200)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("qeffect.graphs.handshake: no CUDA device is available", file=sys.stderr)
        return 2
    result = run_handshake_check(args.protocol, args.checks, args.device)
    text = result.model_dump_json(indent=2)
    if args.json:
        args.json.write_text(text + "\n")
    print(json.dumps({"protocol": result.protocol, "checks": result.checks, "stale_reads": result.stale_reads,
                      "seconds": round(result.seconds, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
