"""Schema of the Megatron-Core capture-mode audit report, and its rich rendering.

The report keeps raw measurements (every step time, every loss) next to the derived numbers, so a
reader can recompute medians and ratios and see exactly which step of which mode diverged.
Losses are compared the way a Megatron user sees them: as logged, at six significant digits.
"""

from __future__ import annotations

import math
import statistics
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
LOSS_FORMAT = ".5E"  # six significant digits, the precision at which graph/eager trajectories are compared

Status = Literal["finished", "failed", "not-run"]


def logged_loss(value: float) -> str:
    """Format a loss at six significant digits (`1.23457E+01`); nan/inf stay readable."""
    if not math.isfinite(value):
        return str(value)
    return format(value, LOSS_FORMAT)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Failure(_Model):
    """Why a mode stopped: the exception, where Megatron raised it, and at which point of the run."""

    type: str
    message: str
    megatron_location: str | None = None  # "megatron/core/...py:LINE in FUNC": innermost Megatron frame
    origin_location: str | None = None  # innermost frame of all (Megatron, TE, torch or qeffect)
    stage: str = "unknown"  # "setup" (config, model, optimizer), "step N" or "process" (crash, timeout)
    exit_code: int | None = None
    stderr_tail: list[str] = Field(default_factory=list)


class ModeResult(_Model):
    """One Megatron-Core capture mode (or the delayed-wgrad attempt) at one pipeline shape."""

    mode: str
    pp: int
    vpp: int | None = None
    status: Status
    reason: str | None = None  # why not run, or a one-line summary of the failure
    settings: dict[str, Any] = Field(default_factory=dict)  # the Megatron-Core fields this mode set
    steps_requested: int = 0
    steps_completed: int = 0
    warmup_steps: int = 0
    step_times_ms: list[float] = Field(default_factory=list)
    median_step_ms: float | None = None
    time_ratio_to_eager: float | None = None  # graph / eager median step time (< 1 is faster)
    speedup_vs_eager: float | None = None  # eager / graph
    losses: list[float] = Field(default_factory=list)  # full-precision step losses (fp32)
    losses_logged: list[str] = Field(default_factory=list)  # the same at six significant digits
    loss_matches_eager: list[bool] | None = None
    losses_match_eager: bool | None = None  # every step compared and equal at six significant digits
    first_loss_mismatch_step: int | None = None
    losses_bitwise_equal_eager: bool | None = None
    failure: Failure | None = None
    probes: list[dict[str, Any]] = Field(default_factory=list)  # extra config-only attempts (delayed wgrad)
    wall_s: float | None = None


class Versions(_Model):
    megatron_core: str | None = None
    transformer_engine: str | None = None
    torch: str | None = None
    python: str | None = None
    cuda: str | None = None


class AuditShape(_Model):
    """The GPT trained in every mode (defaults: examples/configs/h2048.toml)."""

    vocab_size: int = 32768
    hidden: int = 2048
    ffn: int = 8192
    heads: int = 16
    layers: int = 4
    seq_len: int = 256
    microbatch_size: int = 1
    microbatches: int = 4
    fp8_margin: int = 0
    amax_history_len: int = 4
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    lr: float = 3e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.0
    seed: int = 0


class AuditReport(_Model):
    schema_version: int = SCHEMA_VERSION
    kind: Literal["audit-megatron"] = "audit-megatron"
    created: str
    versions: Versions
    device: str | None = None
    gpu_count: int = 0
    shape: AuditShape
    shape_source: str
    steps: int
    warmup_steps: int
    loss_precision: str = "six significant digits (format .5E)"
    common_settings: dict[str, Any] = Field(default_factory=dict)
    runs: list[ModeResult]
    delayed_wgrad: list[ModeResult] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def find(self, mode: str, pp: int) -> ModeResult | None:
        return next((r for r in self.runs if r.mode == mode and r.pp == pp), None)


def summarize(result: ModeResult, eager: ModeResult | None) -> ModeResult:
    """Fill the derived fields (median after warm-up, ratios, loss comparison) from the raw ones."""
    times = result.step_times_ms[result.warmup_steps:]
    result.median_step_ms = statistics.median(times) if times else None
    result.losses_logged = [logged_loss(x) for x in result.losses]
    if eager is None or eager is result:
        return result
    if result.median_step_ms and eager.median_step_ms:
        result.time_ratio_to_eager = result.median_step_ms / eager.median_step_ms
        result.speedup_vs_eager = eager.median_step_ms / result.median_step_ms
    if eager.losses and result.losses:
        n = min(len(eager.losses), len(result.losses))
        ref = [logged_loss(x) for x in eager.losses]
        matches = [result.losses_logged[i] == ref[i] for i in range(n)]
        result.loss_matches_eager = matches
        complete = n == result.steps_requested and n == len(eager.losses) and n > 0
        result.losses_match_eager = complete and all(matches)
        result.first_loss_mismatch_step = next((i for i, ok in enumerate(matches) if not ok), None)
        result.losses_bitwise_equal_eager = complete and result.losses[:n] == eager.losses[:n]
    return result


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _loss_cell(r: ModeResult) -> str:
    if r.loss_matches_eager is None:
        return "reference" if r.mode == "eager" and r.status == "finished" else "-"
    n = len(r.loss_matches_eager)
    ok = sum(r.loss_matches_eager)
    cell = f"{ok}/{n} equal"
    if r.first_loss_mismatch_step is not None:
        cell += f" (first diff step {r.first_loss_mismatch_step})"
    return cell


def _settings_cell(r: ModeResult) -> str:
    s = r.settings
    parts = [f"impl={s.get('cuda_graph_impl', '?')}"]
    if s.get("cuda_graph_impl") in ("local", "transformer_engine"):
        parts.append(f"modules={s.get('cuda_graph_modules', [])}")
    if s.get("delay_wgrad_compute"):
        parts.append("delay_wgrad_compute=True")
    if s.get("driver"):
        parts.append(str(s["driver"]))
    return " ".join(parts)


def _failure_cell(r: ModeResult) -> str:
    if r.status == "not-run":
        return r.reason or ""
    if r.failure is None:
        return ""
    f = r.failure
    where = f.megatron_location or f.origin_location or ""
    msg = f.message if len(f.message) <= 90 else f.message[:87] + "..."
    return f"{f.type} at {f.stage}: {msg}" + (f" [{where}]" if where else "")


def render(report: AuditReport, console: Any) -> None:
    """Print the audit as rich tables: one row per (pipeline shape, mode), then delayed wgrad."""
    from rich.table import Table

    v = report.versions
    table = Table(title=f"Megatron-Core {v.megatron_core} capture modes | TE {v.transformer_engine} | "
                        f"torch {v.torch} | {report.device or 'no GPU'} | {report.steps} steps, "
                        f"median after {report.warmup_steps}")
    for col in ("PP/VPP", "mode", "status", "Megatron settings"):
        table.add_column(col)
    for col in ("steps", "median ms", "graph/eager", "speedup"):
        table.add_column(col, justify="right")
    table.add_column("loss vs eager (6 sig. digits)")
    table.add_column("failure / reason")
    for r in report.runs + report.delayed_wgrad:
        style = {"finished": None, "failed": "red", "not-run": "dim"}[r.status]
        table.add_row(f"{r.pp}/{r.vpp or 1}", r.mode, r.status, _settings_cell(r),
                      f"{r.steps_completed}/{r.steps_requested}", _fmt(r.median_step_ms, ".2f"),
                      _fmt(r.time_ratio_to_eager, ".3f"), _fmt(r.speedup_vs_eager, ".3f") + ("x" if r.speedup_vs_eager else ""),
                      _loss_cell(r), _failure_cell(r), style=style)
    console.print(table)
    for r in report.delayed_wgrad:
        for p in r.probes:
            console.print(f"delayed wgrad probe {p.get('settings')}: {p.get('type')}: {p.get('message')} "
                          f"[{p.get('megatron_location')}]")
    for note in report.notes:
        console.print(note)
