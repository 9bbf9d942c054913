"""Acceptance targets from a user's TOML file, judged on a profile report: met or not, by how much, and
where the time of a missed one goes.

A targets file (`qeffect profile --targets FILE`; the H200 ones are `examples/targets/h200.toml`) is a list
of `[[target]]` tables:

    [[target]]
    name = "fastest-vs-te-graphed"
    metric = "speedup"            # speedup | limit-ratio | host-gpu-ratio | losses-bitwise
    of = "fastest-captured"       # a configuration name, or fastest-captured
    against = "te-graphed"        # speedup only: the anchor, never chosen by the code
    min = 2.0                     # or max = ...: exactly one (losses-bitwise: neither)
    backend = ["te"]              # optional: only reports of these backends ...
    hidden = [2048, 4096]         # ... and these model widths

Metrics: `speedup` is the anchor's step over the configuration's, the median of the per-round ratios
(rounds of one run, interleaved: a slow stretch of the host moves one round of both); `limit-ratio` is the
configuration's step over the report's limit (peak-rate floor + optimizer floor, `profile.flops`);
`host-gpu-ratio` is the host's time to queue a step over the GPU's time for it; `losses-bitwise` counts the
captured configurations whose losses are not native eager's bit for bit (and fails on one that failed).
A target whose configuration or measurement is missing is "not measured" (`met` is None) with the
reason, never passed. Every value is derived from the report's own measurements, so a saved report can be
judged again with another file (`qeffect profile --report R --targets FILE`).
"""

from __future__ import annotations

import statistics
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qeffect.errors import UserError
from qeffect.profile.report import ConfigResult, ProfileReport, TargetCheck
from qeffect.profile.trace import trace_line

FASTEST_CAPTURED = "fastest-captured"
Metric = Literal["speedup", "limit-ratio", "host-gpu-ratio", "losses-bitwise"]


class TargetSpec(BaseModel):
    """One `[[target]]` of a targets file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="Short unique name, shown in the targets table.")
    description: str | None = Field(None, description="What the target asks, in words (default: from the fields).")
    metric: Metric = Field(description="speedup, limit-ratio, host-gpu-ratio or losses-bitwise.")
    of: str | None = Field(None, description="The configuration judged: a name, or fastest-captured.")
    against: str | None = Field(None, description="speedup: the anchor configuration.")
    min: float | None = Field(None, description="Met when the value is at least this.")
    max: float | None = Field(None, description="Met when the value is at most this.")
    backend: list[str] | None = Field(None, description="Applies only to reports of these FP8 backends.")
    hidden: list[int] | None = Field(None, description="Applies only to reports of these model widths.")

    @model_validator(mode="after")
    def _consistent(self) -> TargetSpec:
        if self.metric == "losses-bitwise":
            if self.min is not None or self.max is not None or self.of or self.against:
                raise ValueError("losses-bitwise takes no of, against, min or max (every captured configuration, "
                                 "zero differences)")
            return self
        if (self.min is None) == (self.max is None):
            raise ValueError(f"{self.metric} needs exactly one of min or max")
        if not self.of:
            raise ValueError(f"{self.metric} needs of = <configuration> or {FASTEST_CAPTURED!r}")
        if (self.metric == "speedup") != bool(self.against):
            raise ValueError("against = <configuration> is for speedup only, and speedup needs it")
        return self

    def applies(self, report: ProfileReport) -> bool:
        hidden = report.config.get("model", {}).get("hidden")
        return ((self.backend is None or report.backend in self.backend)
                and (self.hidden is None or hidden in self.hidden))


class _TargetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    target: list[dict] = Field(default_factory=list)


def load_targets(path: Path | str, known_configs: Sequence[str] = ()) -> list[TargetSpec]:
    """The targets of a TOML file; bad input raises `UserError` naming the file, the entry and the field.
    `known_configs`: the configuration names `of` and `against` may use (empty: not checked)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: targets file not found")
    try:
        raw = tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: not valid TOML: {err}") from None
    try:
        entries = _TargetsFile.model_validate(raw).target
    except ValidationError as err:
        e = err.errors()[0]
        raise UserError(f"{path}: {'.'.join(map(str, e['loc'])) or 'top level'}: {e['msg']} (expected only "
                        "[[target]] tables)") from None
    if not entries:
        raise UserError(f"{path}: no [[target]] tables")
    out: list[TargetSpec] = []
    for i, entry in enumerate(entries, 1):
        label = f"target {i}" + (f" ({entry['name']})" if isinstance(entry.get("name"), str) else "")
        try:
            spec = TargetSpec.model_validate(entry)
        except ValidationError as err:
            e = err.errors()[0]
            field = ".".join(map(str, e["loc"]))
            raise UserError(f"{path}: {label}: {field + ': ' if field else ''}{e['msg'].removeprefix('Value error, ')}"
                            ) from None
        names = [n for n in (spec.of, spec.against) if n and n != FASTEST_CAPTURED]
        unknown = [n for n in names if known_configs and n not in known_configs]
        if unknown:
            raise UserError(f"{path}: {label}: unknown configuration {unknown[0]!r}; expected "
                            f"{FASTEST_CAPTURED} or one of {', '.join(known_configs)}")
        if spec.name in {s.name for s in out}:
            raise UserError(f"{path}: {label}: name {spec.name!r} used twice")
        out.append(spec)
    return out


def _check(name: str, description: str, value: float | None, threshold: float, comparison: str, *,
           note: str | None = None, needed: str | None = None, about: ConfigResult | None = None) -> TargetCheck:
    """`about`: the configuration whose trace and host phase say where a missed target's time goes."""
    base = {"name": name, "description": description, "threshold": threshold, "comparison": comparison}
    if value is None:
        return TargetCheck(**base, value=None, met=None, note=note or "not measured")
    met = {">=": value >= threshold, "<=": value <= threshold, "<": value < threshold}[comparison]
    shortfall = None
    if not met and threshold != 0:
        shortfall = 1.0 - value / threshold if comparison == ">=" else value / threshold - 1.0
    where = _where(about) if not met and about is not None else None
    return TargetCheck(**base, value=value, met=met, shortfall=shortfall, needed=None if met else needed,
                       where=where, note=note)


def _missed(name: str, description: str, threshold: float, comparison: str, *, needed: str,
            note: str) -> TargetCheck:
    """A target with no value that is nevertheless missed (a configuration failed or never breaks even)."""
    return TargetCheck(name=name, description=description, value=None, threshold=threshold, comparison=comparison,
                       met=False, needed=needed, note=note)


def _device_work(baseline: ConfigResult, ours: ConfigResult) -> str | None:
    """The ratio on device work alone, from both traces (CUDA, --trace): how much of a ratio to a
    host-bound baseline is the baseline's host, which a faster host takes away."""
    tb, to = baseline.trace, ours.trace
    if tb is None or to is None or not tb.gpu_busy_seconds_per_step or not to.gpu_busy_seconds_per_step:
        return None
    b, o = tb.gpu_busy_seconds_per_step, to.gpu_busy_seconds_per_step
    return (f"traced GPU busy per step: {baseline.name} {b * 1e3:.2f} ms of {tb.wall_seconds_per_step * 1e3:.2f} "
            f"wall, {ours.name} {o * 1e3:.2f} of {to.wall_seconds_per_step * 1e3:.2f}: on device work alone "
            f"{ours.name} is {b / o:.2f}x")


def _notes(*notes: str | None) -> str | None:
    """The notes given, one line."""
    return "; ".join(n for n in notes if n) or None


def _ok(report: ProfileReport, name: str) -> ConfigResult | None:
    c = report.result(name)
    return c if c is not None and c.status == "ok" else None


def with_targets(report: ProfileReport, specs: Sequence[TargetSpec] | None = None,
                 source: str | None = None) -> ProfileReport:
    """Check the losses, then judge `specs` (None: keep the report's saved targets) into `report.targets`;
    returns the report."""
    report.check_losses()
    if specs is not None:
        report.targets = evaluate_targets(report, specs)
        report.targets_source = source if source is not None else report.targets_source
    return report


def evaluate_targets(report: ProfileReport, specs: Sequence[TargetSpec]) -> list[TargetCheck]:
    """The targets of `specs` that apply to this report's backend and shape, in the file's order."""
    judge = {"speedup": _speedup, "limit-ratio": _limit_ratio, "host-gpu-ratio": _host_gpu,
             "losses-bitwise": _losses_bitwise}
    return [judge[s.metric](report, s) for s in specs if s.applies(report)]


def _threshold(spec: TargetSpec) -> tuple[float, str]:
    return (spec.min, ">=") if spec.min is not None else (spec.max, "<=")


def _ours(report: ProfileReport, name: str) -> tuple[ConfigResult | None, str]:
    """The configuration a target judges, or None and why."""
    if name == FASTEST_CAPTURED:
        ran = [c for c in report.configs if c.status == "ok" and (c.path or "").startswith("captured")]
        if not ran:
            return None, "no captured configuration ran"
        return min(ran, key=lambda c: c.median_step_seconds), ""
    c = report.result(name)
    if c is None:
        return None, f"{name} is not in this report"
    if c.status != "ok":
        return None, f"{name} {c.status}: {c.reason}"
    return c, ""


def _where(c: ConfigResult) -> str:
    """Where a step's time goes: the trace by kernel category (per rank under torchrun), and the host phase."""
    parts = [f"{label}: {trace_line(t)}" for label, t in c.labelled_traces() if t is not None]
    if not parts:
        parts.append(f"{c.name}: no trace (run with --trace N for where the time goes)")
    if c.host_median_seconds is not None and c.median_step_seconds:
        line = c.host_phase_line()
        parts.append(f"{c.name} host: queues a step in {c.host_median_seconds * 1e3:.2f} ms of "
                     f"{c.median_step_seconds * 1e3:.2f} ms wall" + (f" ({line})" if line else ""))
    return "; ".join(parts)


def _rounds_note(c: ConfigResult) -> str | None:
    r = c.medians_by_round()
    if len(r) < 2:
        return f"{c.name}: one round"
    return (f"{c.name} over {len(r)} rounds: median {statistics.median(r) * 1e3:.2f} ms, "
            f"{min(r) * 1e3:.2f}-{max(r) * 1e3:.2f}")


def _speedup(report: ProfileReport, spec: TargetSpec) -> TargetCheck:
    threshold, comparison = _threshold(spec)
    ours, why = _ours(report, spec.of)
    base, why_base = _ours(report, spec.against)
    description = spec.description or f"{spec.of} at least {threshold:g}x faster than {spec.against}"
    if ours is None or base is None:
        return _check(spec.name, description, None, threshold, comparison,
                      note="not measured: " + "; ".join(w for w in (why, why_base) if w))
    if ours.name not in description:
        description += f" ({ours.name})"
    b, o = base.medians_by_round(), ours.medians_by_round()
    if len(b) == len(o):
        ratios = [x / y for x, y in zip(b, o, strict=True)]
        how = f"median of {len(ratios)} per-round ratios"
    else:  # a row with other rounds (an older report): the medians
        ratios = [base.median_step_seconds / ours.median_step_seconds]
        how = f"medians ({len(b)} and {len(o)} rounds)"
    value = statistics.median(ratios)
    ms = 1e3
    goal = base.median_step_seconds / threshold
    check = _check(spec.name, description, value, threshold, comparison,
                   needed=f"{ours.name} step <= {goal * ms:.2f} ms (now {ours.median_step_seconds * ms:.2f} ms)",
                   about=ours, note=_notes(f"wall clock, {how}: " + ", ".join(f"{r:.2f}" for r in ratios),
                                           _device_work(base, ours), _rounds_note(base), _rounds_note(ours)))
    check.round_values = ratios
    tb, to = base.trace, ours.trace
    if tb is not None and to is not None and tb.gpu_busy_seconds_per_step and to.gpu_busy_seconds_per_step:
        check.gpu_busy_value = tb.gpu_busy_seconds_per_step / to.gpu_busy_seconds_per_step
    return check


def _limit_ratio(report: ProfileReport, spec: TargetSpec) -> TargetCheck:
    threshold, comparison = _threshold(spec)
    ours, why = _ours(report, spec.of)
    description = spec.description or f"{spec.of} step at most {threshold:g}x the limit (peak-rate + optimizer floor)"
    limit = None if ours is None else report.floor.limit_for(ours.path == "te")
    if ours is None or not limit:
        return _check(spec.name, description, None, threshold, comparison,
                      note="not measured: " + (why or "the report has no limit (a report before the lower-bound floors)"))
    ratios = [m / limit for m in ours.medians_by_round()]
    f = report.floor
    check = _check(spec.name, description, statistics.median(ratios), threshold, comparison,
                   needed=f"{ours.name} step <= {limit * threshold * 1e3:.2f} ms (now {ours.median_step_seconds * 1e3:.2f} ms)",
                   about=ours, note=_notes(
                       f"limit {limit * 1e3:.2f} ms = peak-rate floor "
                       f"{f.peak_rate_seconds_layers_only if ours.path == 'te' else f.peak_rate_seconds:.6f} s + "
                       f"optimizer floor {f.optimizer_seconds_layers_only if ours.path == 'te' else f.optimizer_seconds:.6f} s",
                       _rounds_note(ours)))
    check.round_values = ratios
    return check


def _host_gpu(report: ProfileReport, spec: TargetSpec) -> TargetCheck:
    threshold, comparison = _threshold(spec)
    ours, why = _ours(report, spec.of)
    description = spec.description or f"{spec.of}: host queue time at most {threshold:g}x the GPU step time"
    if ours is None or ours.host_gpu_ratio is None:
        return _check(spec.name, description, None, threshold, comparison,
                      note="not measured: " + (why or f"{ours.name} has no host queue times (a report before them)"))
    gpu = ours.host_median_seconds / ours.host_gpu_ratio
    check = _check(spec.name, description, ours.host_gpu_ratio, threshold, comparison,
                   needed=f"{ours.name} queued in <= {gpu * threshold * 1e3:.2f} ms "
                          f"(now {ours.host_median_seconds * 1e3:.2f} ms)", about=ours,
                   note=f"host {ours.host_median_seconds * 1e3:.2f} ms over GPU {gpu * 1e3:.2f} ms "
                        f"({ours.host_gpu_basis})" + _host_rounds_note(report, ours))
    return check


def _host_rounds_note(report: ProfileReport, ours: ConfigResult) -> str:
    """The host's queue time by round, beside native eager's (a host-bound step: how fast the machine's
    host itself ran in each round), so that a reader sees how much of a host ratio is the machine's."""
    parts = []
    for c in (ours, _ok(report, "native-eager")):
        by_round = c.host_medians_by_round() if c is not None else []
        if len(by_round) > 1:
            parts.append(f"{c.name} host by round {', '.join(f'{x * 1e3:.2f}' for x in by_round)} ms "
                         f"(x{max(by_round) / min(by_round):.2f} slowest over fastest)")
    return "; " + "; ".join(parts) if parts else ""


def _losses_bitwise(report: ProfileReport, spec: TargetSpec) -> TargetCheck:
    description = spec.description or "every captured configuration's losses bitwise equal to native eager's"
    captured = [c for c in report.configs if (c.path or "").startswith("captured") and c.status != "not run"]
    failed = [c.name for c in captured if c.status == "failed"]
    if failed:
        return _missed(spec.name, description, 0.0, "<=", needed="a run of every captured configuration",
                       note="failed: " + ", ".join(failed))
    if not captured or _ok(report, "native-eager") is None:
        return _check(spec.name, description, None, 0.0, "<=",
                      note="not measured: needs native-eager and a captured configuration")
    differ = [c.name for c in captured if c.losses_equal_native is not True]
    return _check(spec.name, description, float(len(differ)), 0.0, "<=",
                  needed="losses equal native eager's in " + ", ".join(differ),
                  note=f"compared: {', '.join(c.name for c in captured)}"
                       + (f"; differ: {', '.join(differ)}" if differ else ""))
