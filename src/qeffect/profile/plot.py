"""PNG figures of a `ProfileReport` (needs matplotlib, the `plot` extra; imported only here, lazily).

- `step_times.png`: median step time per configuration with its interquartile range and min/max,
  and the matrix-FLOP floor (the layers-only floor for `te-graphed`, TE's graphed layers alone).
- `break_even.png`: cumulative wall time (setup + n x median step) against steps, with each
  configuration's break-even step against native eager marked.
- `m_scaling.png` (with `--microbatches`): graphs, arena bytes, peak live tapes and pending dW, and
  capture host time (CUDA) against the microbatch count M.
"""

from __future__ import annotations

from pathlib import Path

from qeffect.errors import UserError
from qeffect.profile.report import TE_PATHS, ProfileReport

PLOT_MISSING_MSG = "--plot needs matplotlib (pip install 'qeffect[plot]'); it is not importable here"


def matplotlib_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require_matplotlib() -> None:
    if not matplotlib_available():
        raise UserError(PLOT_MISSING_MSG)


def _pyplot():
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a CI or GPU machine
    import matplotlib.pyplot as plt

    return plt


def _title(report: ProfileReport) -> str:
    m = report.config["model"]
    p = report.config["pipeline"]
    where = f"{report.world_size} x {report.device_name}, PP={p['pp']}" if report.world_size > 1 else report.device_name
    return f"h{m['hidden']} / M={p['microbatches']} / {report.backend} on {where} ({report.steps} steps)"


def write_plots(report: ProfileReport, out_dir: str | Path) -> list[Path]:
    """Write the figures under `out_dir` (created if needed); returns the files written."""
    plt = _pyplot()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [_step_times(plt, report, out / "step_times.png"), _break_even(plt, report, out / "break_even.png")]
    if report.resources:
        written.append(_m_scaling(plt, report, out / "m_scaling.png"))
    return written


def _step_times(plt, report: ProfileReport, path: Path) -> Path:
    ran = [c for c in report.configs if c.status == "ok"]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.6 * max(1, len(report.configs))))
    labels = [c.name for c in report.configs]
    for i, c in enumerate(report.configs):
        if c.status != "ok":
            ax.text(0, i, f"  {c.status}: {c.reason}", va="center", fontsize=8, color="grey")
            continue
        s = c.spread
        ms = 1e3
        ax.barh(i, c.median_step_seconds * ms, color="tab:orange" if c.path in TE_PATHS else "tab:blue", alpha=0.8)
        ax.errorbar(s.median * ms, i, xerr=[[(s.median - s.q1) * ms], [(s.q3 - s.median) * ms]], fmt="none",
                    ecolor="black", capsize=4)
        ax.plot([s.min * ms, s.max * ms], [i, i], color="black", linewidth=0.6)
        if c.floor_ratio is not None:
            ax.text(s.max * ms, i, f"  {c.median_step_seconds * ms:.2f} ms, {c.floor_ratio:.1f}x floor", va="center",
                    fontsize=8)
    ax.axvline(report.floor.seconds * 1e3, color="tab:red", linestyle="--",
               label=f"GEMM floor {report.floor.seconds * 1e3:.3f} ms")
    if report.floor.limit_seconds is not None:
        ax.axvline(report.floor.limit_seconds * 1e3, color="tab:green", linestyle="--",
                   label=f"limit (peak-rate + optimizer floor) {report.floor.limit_seconds * 1e3:.3f} ms")
    if any(c.path == "te" for c in ran):
        ax.axvline(report.floor.seconds_layers_only * 1e3, color="tab:red", linestyle=":",
                   label=f"layers-only floor {report.floor.seconds_layers_only * 1e3:.3f} ms (te-graphed, layers alone)")
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms): median, interquartile range, min-max")
    ax.set_title(_title(report), fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _break_even(plt, report: ProfileReport, path: Path) -> Path:
    ran = [c for c in report.configs if c.status == "ok"]
    marks = [c.break_even_steps for c in ran if c.break_even_steps]
    horizon = max(20.0, 2.0 * max(marks, default=10.0))
    fig, ax = plt.subplots(figsize=(8, 5))
    for c in ran:
        xs = [0.0, horizon]
        ax.plot(xs, [c.setup_seconds + x * c.median_step_seconds for x in xs], label=c.name,
                linestyle="--" if c.name == "native-eager" else "-")
        if c.break_even_steps is not None and c.name != "native-eager":
            n = c.break_even_steps
            ax.plot([n], [c.setup_seconds + n * c.median_step_seconds], "o", color="black", markersize=4)
            ax.annotate(f"{n:.1f}", (n, c.setup_seconds + n * c.median_step_seconds), fontsize=7,
                        textcoords="offset points", xytext=(4, -10))
    ax.set_xlabel("optimizer steps after setup")
    ax.set_ylabel("cumulative wall time (s): setup + n x median step")
    ax.set_title("break-even against native eager\n" + _title(report), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _m_scaling(plt, report: ProfileReport, path: Path) -> Path:
    rows = report.resources or []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for sched in sorted({r.schedule for r in rows}):
        rs = sorted((r for r in rows if r.schedule == sched), key=lambda r: r.microbatches)
        ms = [r.microbatches for r in rs]
        axes[0][0].plot(ms, [r.graphs_per_rank for r in rs], "o-", label=f"{sched} (provisioned)")
        captured = [(r.microbatches, r.graphs_captured_per_rank) for r in rs if r.graphs_captured_per_rank is not None]
        if captured:
            axes[0][0].plot(*zip(*captured, strict=True), "x", label=f"{sched} (captured)")
        axes[0][1].plot(ms, [r.arena_bytes / 2**20 for r in rs], "o-", label=sched)
        axes[1][0].plot(ms, [max(r.max_live_tapes) for r in rs], "o-", label=f"{sched}: live tapes")
        axes[1][0].plot(ms, [max(r.max_pending_dw) for r in rs], "s--", label=f"{sched}: pending dW")
        cap = [(r.microbatches, r.capture_host_seconds) for r in rs if r.capture_host_seconds is not None]
        if cap:
            axes[1][1].plot(*zip(*cap, strict=True), "o-", label=sched)
    axes[0][0].set_title("graphs per rank", fontsize=9)
    axes[0][1].set_title("arena (MiB, all ranks)", fontsize=9)
    axes[1][0].set_title("peak per rank (max over ranks)", fontsize=9)
    axes[1][1].set_title("capture host time (s)", fontsize=9)
    if not any(r.capture_host_seconds is not None for r in rows):
        axes[1][1].text(0.5, 0.5, "not run: needs a CUDA device", ha="center", va="center",
                        transform=axes[1][1].transAxes, color="grey")
    for ax in axes.flat:
        ax.set_xlabel("microbatches M")
        ax.set_xscale("log", base=2)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("M scaling\n" + _title(report), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
