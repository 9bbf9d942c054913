"""`megatron-graphs`: Megatron-Core's fastest working CUDA-graph mode on the profile's shape, as an anchor row.

Each round runs Megatron-Core in a child process (`python -m qeffect.audit.runner`, the child that
`qeffect audit-megatron` launches; a subprocess, not an import, so neither job layer depends on the
other and a crashing capture cannot take the profile down). The first round tries every graph mode
(`local`, `transformer_engine`, `full_iteration`) and keeps the fastest that finished; later rounds run
that mode only. The shape is the run config's whole model on one GPU (PP = 1: Megatron's own pipeline
needs a GPU per stage), FP8 delayed scaling with the same recipe and AdamW. A step's time is the child's
(device synchronized at both ends); peak memory is the child's `torch.cuda.max_memory_allocated`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeffect.config import RunConfig

GRAPH_MODES = ("local", "transformer_engine", "full_iteration")
CAPTURE_STEPS = 3  # the child captures at step 3 (Megatron's cuda_graph_warmup_steps): never timed
TIMEOUT_SECONDS = 600.0


def not_available_reason(device_type: str) -> str | None:
    """Why Megatron-Core's graphs cannot run here (None: they can)."""
    if device_type != "cuda":
        return f"Megatron-Core's CUDA graphs need a CUDA device (this run is on {device_type})"
    if sys.version_info < (3, 12):
        return "megatron-core needs Python >= 3.12"
    try:
        found = importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        found = False
    return None if found else "megatron-core not installed"


def shape_of(cfg: RunConfig) -> dict[str, Any]:
    """The child's shape (`audit.report.AuditShape` fields) for the run config's model on one GPU."""
    m, p, f, o = cfg.model, cfg.pipeline, cfg.fp8, cfg.optim
    return dict(vocab_size=m.vocab_size, hidden=m.hidden, ffn=m.ffn, heads=m.heads,
                layers=m.layers_per_chunk * p.pp * p.chunks_per_rank, seq_len=m.seq_len,
                microbatch_size=m.microbatch_size, microbatches=p.microbatches, fp8_margin=f.margin,
                amax_history_len=f.amax_history_len, amax_compute_algo=f.amax_compute_algo, lr=o.lr,
                beta1=o.beta1, beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, seed=cfg.train.seed)


@dataclass
class ModeRun:
    """What one child run of one mode left: status, timed steps (seconds), peak bytes, or why it failed."""

    mode: str
    finished: bool
    step_seconds: list[float] = field(default_factory=list)
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    setup_seconds: float | None = None  # child start to the end of its first timed-out step: capture included
    reason: str | None = None

    @property
    def median(self) -> float | None:
        return statistics.median(self.step_seconds) if self.step_seconds else None


def run_mode(cfg: RunConfig, mode: str, *, steps: int, warmup: int, timeout_s: float = TIMEOUT_SECONDS,
             python: str | None = None) -> ModeRun:
    """One child run of `mode`: `skip` = max(warmup, capture step + 1) untimed steps, then `steps` timed."""
    skip = max(warmup, CAPTURE_STEPS + 1)
    with tempfile.TemporaryDirectory(prefix="qeffect-megatron-") as tmp:
        path = Path(tmp) / f"{mode}.json"
        cmd = [python or sys.executable, "-m", "qeffect.audit.runner", "--mode", mode, "--json", str(path),
               "--shape", json.dumps(shape_of(cfg)), "--steps", str(skip + steps), "--pp", "1"]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        t0 = time.perf_counter()
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it, nothing else
                proc.wait()
                return ModeRun(mode, False, reason=f"no result within {timeout_s:.0f} s")
            out.seek(0)
            tail = out.read()[-2000:]
        wall = time.perf_counter() - t0
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            data = {}
    return mode_run_of(mode, data, rc, tail, skip=skip, wall=wall)


def mode_run_of(mode: str, data: dict[str, Any], returncode: int | None, output: str, *, skip: int,
                wall: float | None = None) -> ModeRun:
    """The child's JSON (its `audit.runner` result) as a `ModeRun`: the steps after `skip` timed."""
    if data.get("status") != "finished" or returncode != 0:
        failure = data.get("failure") or {}
        if failure:
            reason = f"{failure.get('type')}: {str(failure.get('message'))[:300]} (at {failure.get('stage')})"
        else:
            last = [ln for ln in output.splitlines() if ln.strip()][-1:] or ["no output"]
            reason = f"exit code {returncode}: {last[0][:300]}"
        return ModeRun(mode, False, reason=reason)
    times = [float(x) * 1e-3 for x in data.get("step_times_ms", [])]
    if len(times) <= skip:
        return ModeRun(mode, False, reason=f"{len(times)} steps recorded, {skip} untimed")
    peak, reserved = data.get("peak_allocated_bytes"), data.get("peak_reserved_bytes")
    setup = wall - sum(times[skip:]) if wall is not None else None
    return ModeRun(mode, True, step_seconds=times[skip:], peak_allocated_bytes=int(peak) if peak else None,
                   peak_reserved_bytes=int(reserved) if reserved else None, setup_seconds=setup)


class MegatronGraphs:
    """The `megatron-graphs` anchor over rounds: the first round picks the fastest mode that finished."""

    def __init__(self, cfg: RunConfig, *, steps: int, warmup: int, modes: tuple[str, ...] = GRAPH_MODES,
                 run=run_mode) -> None:
        self.cfg, self.steps, self.warmup, self.modes, self._run = cfg, steps, warmup, modes, run
        self.mode: str | None = None
        self.tried: dict[str, ModeRun] = {}

    def round(self) -> ModeRun:
        """One round's run of the chosen mode (the first round chooses it); raises when none works."""
        if self.mode is not None:
            run = self._run(self.cfg, self.mode, steps=self.steps, warmup=self.warmup)
            if not run.finished:
                raise RuntimeError(f"Megatron-Core's {self.mode} mode finished an earlier round, not this one: "
                                   f"{run.reason}")
            return run
        for mode in self.modes:
            self.tried[mode] = self._run(self.cfg, mode, steps=self.steps, warmup=self.warmup)
        ok = [r for r in self.tried.values() if r.finished]
        if not ok:
            raise RuntimeError("no Megatron-Core CUDA-graph mode finished: " + "; ".join(
                f"{m}: {r.reason}" for m, r in self.tried.items()))
        best = min(ok, key=lambda r: r.median)
        self.mode = best.mode
        return best

    def choice_note(self) -> str:
        """Which modes were tried and how each did (the row's description)."""
        parts = [f"{m} {r.median * 1e3:.2f} ms" if r.finished else f"{m} failed ({r.reason})"
                 for m, r in self.tried.items()]
        return f"fastest working mode {self.mode} of: " + ", ".join(parts)
