"""Benchmarks: `qeffect profile` for h2048 and h4096 with the reference and te backends, in interleaved rounds,
judged by a targets file (default examples/targets/h200.toml).

On the H200 (from the repository root, one device call per pair if the 10-minute limit is near):

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/profile_matrix.py --out $OUT --only h2048:reference
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/profile_matrix.py --out $OUT --only h2048:te
    ... h4096:reference, h4096:te

then copy the JSON files into benchmarks/results/ and draw the figures where matplotlib is installed:

    qeffect profile --report benchmarks/results/profile-h2048-reference-h200.json --plot <dir>

Writes OUT/profile-<config>-<backend>-<device>.json per pair and prints one line per configuration
(and, with --trace N, default 3, a profiler summary line of N more untimed steps: where the time goes).
A dry run on a CPU: `--tomls src/qeffect/configs/tiny.toml --backends reference --device cpu --steps 2`.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

from qeffect.cli.common import write_json
from qeffect.config import apply_sets, load_config
from qeffect.errors import UserError
from qeffect.profile.matrix import CONFIG_NAMES, device_tag, run_profile
from qeffect.profile.resources import parse_microbatches
from qeffect.profile.targets import load_targets
from qeffect.profile.trace import trace_line

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOMLS = f"{ROOT / 'examples/configs/h2048.toml'},{ROOT / 'examples/configs/h4096.toml'}"


def _f(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tomls", default=DEFAULT_TOMLS, help="comma-separated config files")
    ap.add_argument("--backends", default="reference,te")
    ap.add_argument("--only", default=None, help="comma-separated <config stem>:<backend> pairs to run")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--microbatches", default="2,4,8,16")
    ap.add_argument("--configs", default=None, help="subset of the configuration matrix (default: all)")
    ap.add_argument("--trace", type=int, default=3,
                    help="profiled (untimed) steps per configuration for the trace summary; 0: none")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per configuration, interleaved (ABC ABC ABC)")
    ap.add_argument("--targets", default=str(ROOT / "examples/targets/h200.toml"),
                    help="targets file to judge each report by ('' for none)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override, as `qeffect train --set` takes it; repeatable")
    ap.add_argument("--tag", default="", help="added to each report's file name (runs with --set)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    ap.add_argument("--plot", action="store_true", help="also write figures (needs matplotlib)")
    a = ap.parse_args()
    out = Path(a.out)
    only = set(a.only.split(",")) if a.only else None
    ms = parse_microbatches(a.microbatches) if a.microbatches else None
    names = a.configs.split(",") if a.configs else None
    targets = load_targets(a.targets, CONFIG_NAMES) if a.targets else None
    ok = True
    for toml in a.tomls.split(","):
        stem = Path(toml).stem
        for backend in a.backends.split(","):
            if only is not None and f"{stem}:{backend}" not in only:
                continue
            cfg = apply_sets(load_config(toml).with_overrides(**{"fp8.backend": backend, "train.device": a.device}),
                             a.set)
            command = (f"python3 benchmarks/profile_matrix.py --tomls {toml} --backends {backend} --device {a.device} "
                       f"--steps {a.steps} --warmup {a.warmup} --trace {a.trace} --microbatches {a.microbatches} "
                       f"--rounds {a.rounds}" + (f" --targets {a.targets}" if a.targets else "")
                       + (f" --configs {a.configs}" if a.configs else "")
                       + "".join(f" --set {x}" for x in a.set) + (f" --tag {a.tag}" if a.tag else ""))
            t0 = time.perf_counter()
            try:
                report = run_profile(cfg, steps=a.steps, warmup=a.warmup, configs=names, microbatches=ms,
                                     command=command, config_path=toml, trace_steps=a.trace, rounds=a.rounds,
                                     targets=targets, targets_source=a.targets or None,
                                     progress=lambda msg, s=stem, b=backend: print(f"[{s}:{b}] {msg}", flush=True))
            except UserError as err:  # e.g. te without Transformer Engine: say so and go on
                print(f"{stem}:{backend}: not run: {err}", flush=True)
                ok = False
                continue
            except Exception:
                print(f"{stem}:{backend}: ERROR\n{traceback.format_exc()[-3000:]}", flush=True)
                ok = False
                continue
            path = out / f"profile-{stem}{f'-{a.tag}' if a.tag else ''}-{backend}-{device_tag(a.device)}.json"
            write_json(path, report)
            f = report.floor
            print(f"{stem}:{backend}: floor {f.seconds * 1e3:.3f} ms (layers {f.seconds_layers_only * 1e3:.3f} ms), "
                  f"FP8 GEMM {f.effective_tflops:.4g} TFLOP/s effective / {f.peak_tflops:.4g} peak; "
                  f"initial weights drawn once in {report.init_draw_seconds or 0:.2f} s; "
                  f"{time.perf_counter() - t0:.0f}s -> {path}", flush=True)
            if f.limit_seconds is not None:
                print(f"  limit {f.limit_seconds * 1e3:.3f} ms = peak-rate {f.peak_rate_seconds * 1e3:.3f} "
                      f"({f.peak_rate_tflops:.0f} TFLOP/s) + optimizer {f.optimizer_seconds * 1e3:.3f} "
                      f"({f.copy_bytes_per_second / 1e9:.0f} GB/s)", flush=True)
            for c in report.configs:
                if c.status != "ok":
                    print(f"  {c.name}: {c.status}: {c.reason}", flush=True)
                    ok &= c.status != "failed"
                    continue
                peak = None if c.peak_allocated_bytes is None else c.peak_allocated_bytes / 2**30
                rounds = c.medians_by_round()
                print(f"  {c.name}{f' ({c.variant})' if c.variant else ''}: median {c.median_step_seconds * 1e3:.2f} ms "
                      f"(rounds {min(rounds) * 1e3:.2f}-{max(rounds) * 1e3:.2f}) "
                      f"[{c.spread.q1 * 1e3:.2f}-{c.spread.q3 * 1e3:.2f}] x{_f(c.speedup_vs_native)} vs native, "
                      f"x{_f(c.limit_ratio)} limit, host/GPU {_f(c.host_gpu_ratio)}, "
                      f"setup {_f(c.setup_seconds)}s, break-even {_f(c.break_even_steps, '.1f')}, "
                      f"floor x{_f(c.floor_ratio, '.1f')}, peak {_f(peak)} GiB, "
                      f"growth {c.persistent_growth_bytes_per_step} B/step, graphs {c.graph_count}, "
                      f"replays/step {_f(c.replays_per_step, '.0f')}, handoffs/step {_f(c.handoffs_per_step, '.0f')}",
                      flush=True)
                if c.trace is not None:
                    print(f"    {trace_line(c.trace)}", flush=True)
                elif c.trace_error is not None:
                    print(f"    trace failed: {c.trace_error}", flush=True)
            for r in report.resources or []:
                print(f"  M={r.microbatches} {r.schedule}: graphs/rank {r.graphs_per_rank} "
                      f"(captured {r.graphs_captured_per_rank}), arena {r.arena_bytes / 2**20:.0f} MiB, "
                      f"live tapes {r.max_live_tapes}, pending dW {r.max_pending_dw}, "
                      f"capture {r.capture_host_seconds} s{'; ' + r.capture_note if r.capture_note else ''}",
                      flush=True)
            for t in report.targets:
                state = "not measured" if t.met is None else "met" if t.met else "MISSED"
                print(f"  target {t.name}: {state} ({_f(t.value)} {t.comparison} {t.threshold:g})"
                      + (f"; needs {t.needed}" if t.needed else "") + (f"; where: {t.where}" if t.where else ""),
                      flush=True)
            if a.plot:
                from qeffect.profile.plot import write_plots

                write_plots(report, out / f"profile-{stem}-{backend}-plots")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
