"""`qeffect audit-megatron`: which of Megatron-Core's own CUDA-graph modes work for a pipeline shape.

For each pipeline shape (PP=1 on one GPU; PP=2 x VPP=2 when two GPUs are present) the parent launches
one process per mode (eager, `local`, `transformer_engine`, `full_iteration`, then the delayed
weight-gradient attempt), each with a timeout, and builds the report from what each child wrote, or,
when a child died without writing, from its exit code and the traceback on its stderr. One failing
mode therefore never takes the others down. Step times are medians after warm-up and ratios are
within Megatron (graph / eager); losses are compared with eager as logged, at six significant digits.
"""

from __future__ import annotations

import datetime as _dt
import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qeffect.audit.report import AuditReport, AuditShape, Failure, ModeResult, Versions, summarize
from qeffect.audit.runner import DELAY_WGRAD, MODES, mode_settings, short_path
from qeffect.errors import UserError

DEFAULT_CONFIG = Path("examples/configs/h2048.toml")
PIPELINE_SHAPES: tuple[tuple[int, int | None], ...] = ((1, None), (2, 2))  # (PP, VPP)
STDERR_TAIL = 30


# ----------------------------------------------------------------------------------------- environment


def _has_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ModuleNotFoundError:
        return False


def _python_ok() -> bool:
    return sys.version_info >= (3, 12)


def _gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver counts as no GPU
        return 0


def check_environment() -> int:
    """Return the GPU count, or raise a one-line UserError (exit 2) saying what is missing."""
    if not _has_megatron():
        raise UserError("audit-megatron needs megatron-core, which is not installed "
                        "(pip install 'qeffect[megatron]'; it needs Python >= 3.12)")
    if not _python_ok():
        raise UserError(f"audit-megatron needs Python >= 3.12 for megatron-core; this is "
                        f"{sys.version_info.major}.{sys.version_info.minor}")
    gpus = _gpu_count()
    if gpus < 1:
        raise UserError("audit-megatron needs a CUDA GPU: every Megatron capture mode runs on one, and none is visible")
    return gpus


def _installed_versions() -> Versions:
    """Versions from package metadata, without importing Megatron or TE into the parent."""
    from importlib import metadata

    def ver(*names: str) -> str | None:
        for n in names:
            try:
                return metadata.version(n)
            except metadata.PackageNotFoundError:
                continue
        return None

    import platform

    return Versions(megatron_core=ver("megatron-core", "megatron_core"),
                    transformer_engine=ver("transformer-engine", "transformer_engine", "transformer-engine-torch",
                                           "transformer_engine_torch"),
                    torch=ver("torch"), python=platform.python_version())


# ----------------------------------------------------------------------------------------------- shape


def shape_from_config(path: Path | None) -> tuple[AuditShape, str]:
    """Read the GPT shape, FP8 recipe and optimizer from a qeffect TOML (default examples/configs/h2048.toml)."""
    from qeffect.config import load_config

    if path is None:
        if not DEFAULT_CONFIG.is_file():
            return AuditShape(), f"built-in defaults (equal to {DEFAULT_CONFIG})"
        path = DEFAULT_CONFIG
    cfg = load_config(path)
    m, p, f, o = cfg.model, cfg.pipeline, cfg.fp8, cfg.optim
    shape = AuditShape(vocab_size=m.vocab_size, hidden=m.hidden, ffn=m.ffn, heads=m.heads,
                       layers=m.layers_per_chunk * p.pp * p.chunks_per_rank, seq_len=m.seq_len,
                       microbatch_size=m.microbatch_size, microbatches=p.microbatches, fp8_margin=f.margin,
                       amax_history_len=f.amax_history_len, amax_compute_algo=f.amax_compute_algo, lr=o.lr,
                       beta1=o.beta1, beta2=o.beta2, eps=o.eps, weight_decay=o.weight_decay, seed=cfg.train.seed)
    return shape, str(path)


def _pipeline_blocker(shape: AuditShape, pp: int, vpp: int | None, gpus: int) -> str | None:
    if gpus < pp:
        return f"needs {pp} GPUs (one per pipeline rank); {gpus} present"
    chunks = pp * (vpp or 1)
    if shape.layers % chunks:
        return f"{shape.layers} layers do not split into {chunks} model chunks"
    if vpp and shape.microbatches % pp:
        return f"interleaved schedule needs microbatches ({shape.microbatches}) divisible by PP={pp}"
    return None


# ---------------------------------------------------------------------------------------- child runs


@dataclass
class ModeRequest:
    mode: str
    pp: int
    vpp: int | None
    steps: int
    shape: AuditShape
    json_path: Path
    timeout_s: float
    port: int = 0

    @property
    def nproc(self) -> int:
        return self.pp


@dataclass
class ChildOutcome:
    returncode: int | None  # None: killed at the timeout
    output: str  # stdout and stderr together
    data: dict[str, Any] | None  # the JSON rank 0 wrote (possibly partial)
    rank_data: list[dict[str, Any]] = field(default_factory=list)  # what the other ranks wrote
    wall_s: float = 0.0
    timed_out: bool = False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class SubprocessRunner:
    """Launch `prefix + args` (torchrun in front for several ranks), capture output, enforce the timeout."""

    def __init__(self, prefix: Sequence[str] | None = None, env: dict[str, str] | None = None):
        self.prefix = list(prefix) if prefix else [sys.executable, "-m", "qeffect.audit.runner"]
        self.env = env

    def command(self, req: ModeRequest) -> list[str]:
        args = ["--mode", req.mode, "--json", str(req.json_path), "--shape", req.shape.model_dump_json(),
                "--steps", str(req.steps), "--pp", str(req.pp), "--vpp", str(req.vpp or 0), "--port", str(req.port)]
        if req.nproc == 1:
            return self.prefix + args
        torchrun = [self.prefix[0], "-m", "torch.distributed.run", f"--nproc-per-node={req.nproc}",
                    "--master-addr=127.0.0.1", f"--master-port={req.port}"]
        return torchrun + self.prefix[1:] + args

    def __call__(self, req: ModeRequest) -> ChildOutcome:
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        t0 = time.perf_counter()
        with tempfile.TemporaryFile(mode="w+") as out:
            proc = subprocess.Popen(self.command(req), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
            timed_out = False
            try:
                rc: int | None = proc.wait(timeout=req.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                os.killpg(proc.pid, signal.SIGKILL)  # the child's own session: it and its ranks, nothing else
                proc.wait()
                rc = None
            out.seek(0)
            output = out.read()
        ranks = sorted(req.json_path.parent.glob(req.json_path.name + ".rank*"))
        return ChildOutcome(returncode=rc, output=output, data=_read_json(req.json_path),
                            rank_data=[d for d in map(_read_json, ranks) if d], wall_s=time.perf_counter() - t0,
                            timed_out=timed_out)


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)?)(?::\s?(.*))?$")


def parse_crash(output: str) -> dict[str, Any]:
    """Type, message and innermost Megatron frame of the last Python traceback in a child's output."""
    lines = output.splitlines()
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("Traceback (most recent call last)")]
    if not starts:
        fatal = [ln.strip() for ln in lines if re.search(r"CUDA error|Segmentation fault|terminate called|Aborted|"
                                                         r"illegal memory access|NCCL error", ln)]
        return {"type": None, "message": fatal[-1] if fatal else None, "megatron_location": None,
                "origin_location": None}
    block = lines[starts[-1]:]
    frames = [(m.group(1), int(m.group(2)), m.group(3)) for m in map(_FRAME.search, block) if m]
    exc_type = message = None
    for line in block[1:]:
        if line.startswith((" ", "\t")) or not line.strip():
            continue
        m = _EXC_LINE.match(line.strip())
        if m and (m.group(2) is not None or m.group(1)[:1].isupper()):
            exc_type, message = m.group(1).rsplit(".", 1)[-1], (m.group(2) or "")
            break
    megatron = [f for f in frames if "/megatron/" in f[0].replace("\\", "/")]

    def where(f: tuple[str, int, str]) -> str:
        return f"{short_path(f[0])}:{f[1]} in {f[2]}"

    return {"type": exc_type, "message": message, "megatron_location": where(megatron[-1]) if megatron else None,
            "origin_location": where(frames[-1]) if frames else None}


def outcome_to_result(req: ModeRequest, outcome: ChildOutcome, warmup: int) -> ModeResult:
    """Turn what a child left behind (JSON, exit code, output) into the mode's row of the report."""
    data = outcome.data or {}
    ranks = [data] + outcome.rank_data if data else outcome.rank_data
    tail = outcome.output.splitlines()[-STDERR_TAIL:]
    res = ModeResult(mode=req.mode, pp=req.pp, vpp=req.vpp, status="failed", steps_requested=req.steps,
                     warmup_steps=warmup, settings=data.get("settings") or mode_settings(req.mode),
                     steps_completed=int(data.get("steps_completed", 0)),
                     step_times_ms=[float(x) for x in data.get("step_times_ms", [])],
                     losses=[float(x) for x in data.get("losses", [])], probes=list(data.get("probes", [])),
                     wall_s=outcome.wall_s)
    finished = (data.get("status") == "finished" and outcome.returncode == 0
                and all(d.get("status") == "finished" for d in ranks))
    if finished:
        res.status = "finished"
        return res
    recorded = next((d["failure"] for d in ranks if d.get("failure")), None)
    stage = next((d.get("stage") for d in ranks if d.get("failure")), None) or data.get("stage") or "process"
    if recorded:
        fail = Failure(**{**recorded, "stage": recorded.get("stage") or stage})
    else:
        crash = parse_crash(outcome.output)
        if outcome.timed_out:
            etype, msg = "Timeout", f"no result within {req.timeout_s:.0f} s"
            if crash["type"]:
                msg += f"; last traceback: {crash['type']}: {crash['message']}"
        elif crash["type"]:
            etype, msg = crash["type"], crash["message"] or ""
        else:
            rc = outcome.returncode
            etype = f"signal {signal.Signals(-rc).name}" if rc is not None and rc < 0 else f"exit code {rc}"
            msg = crash["message"] or "the process ended without writing a result"
        fail = Failure(type=etype, message=msg, megatron_location=crash["megatron_location"],
                       origin_location=crash["origin_location"], stage=stage)
    fail.exit_code = outcome.returncode
    fail.stderr_tail = tail
    res.failure = fail
    res.reason = f"{fail.type} at {fail.stage}"
    return res


def parse_pipelines(text: str) -> list[tuple[int, int | None]]:
    """`--pipeline 1,2x2` -> [(1, None), (2, 2)]: PP, optionally x VPP (VPP 1 means none)."""
    out: list[tuple[int, int | None]] = []
    for part in (p.strip() for p in text.split(",")):
        pp, _, vpp = part.partition("x")
        if not pp.isdigit() or int(pp) < 1 or (vpp and (not vpp.isdigit() or int(vpp) < 1)):
            raise UserError(f"--pipeline: {part!r} is not PP or PPxVPP (e.g. 1,2x2)")
        out.append((int(pp), int(vpp) if vpp and int(vpp) > 1 else None))
    return out


# ------------------------------------------------------------------------------------------- the audit


def run_audit(
    shape: AuditShape,
    *,
    shape_source: str = "built-in defaults",
    steps: int = 20,
    warmup: int = 5,
    timeout_s: float = 240.0,
    modes: Sequence[str] = MODES,
    gpu_count: int = 1,
    pipelines: Sequence[tuple[int, int | None]] = PIPELINE_SHAPES,
    runner: Callable[[ModeRequest], ChildOutcome] | None = None,
    workdir: Path | None = None,
    log: Callable[[ModeRequest, ChildOutcome], None] | None = None,
    progress: Callable[[str], None] | None = None,
    on_partial: Callable[[AuditReport], None] | None = None,
) -> AuditReport:
    """Run every mode at every pipeline shape, each in its own process, and build the report."""
    if steps <= warmup:
        raise UserError(f"--steps ({steps}) must exceed --warmup ({warmup}) to leave steps for the median")
    unknown = [m for m in modes if m not in MODES]
    if unknown or "eager" not in modes:
        raise UserError(f"--modes must include eager and only name {', '.join(MODES)} (got {', '.join(modes)})")
    runner = runner or SubprocessRunner()
    tmp = tempfile.TemporaryDirectory(prefix="qeffect-audit-") if workdir is None else None
    root = Path(tmp.name if tmp else workdir)  # type: ignore[arg-type]
    root.mkdir(parents=True, exist_ok=True)
    ordered = ["eager"] + [m for m in MODES if m in modes and m != "eager"]
    runs: list[ModeResult] = []
    wgrad: list[ModeResult] = []
    first_data: dict[str, Any] = {}

    def launch(mode: str, pp: int, vpp: int | None) -> ModeResult:
        tag = f"pp{pp}-vpp{vpp or 1}-{mode}"
        if progress:
            progress(tag)
        req = ModeRequest(mode=mode, pp=pp, vpp=vpp, steps=steps, shape=shape, json_path=root / f"{tag}.json",
                          timeout_s=timeout_s, port=_free_port())
        outcome = runner(req)
        if log:
            log(req, outcome)
        if outcome.data and outcome.data.get("versions") and not first_data:
            first_data.update(outcome.data)
        return outcome_to_result(req, outcome, warmup)

    try:
        for pp, vpp in pipelines:
            blocker = _pipeline_blocker(shape, pp, vpp, gpu_count)
            shape_runs = []
            for mode in ordered + [DELAY_WGRAD]:
                if blocker:
                    r = ModeResult(mode=mode, pp=pp, vpp=vpp, status="not-run", reason=blocker,
                                   settings=mode_settings(mode), steps_requested=steps, warmup_steps=warmup)
                else:
                    r = launch(mode, pp, vpp)
                (wgrad if mode == DELAY_WGRAD else shape_runs).append(r)
                if on_partial and not blocker:  # a report after every mode: a killed audit still leaves one
                    _summarize_shape(shape_runs)
                    on_partial(_report(shape, shape_source, steps, warmup, gpu_count, first_data,
                                       runs + shape_runs, wgrad))
            _summarize_shape(shape_runs)
            runs.extend(shape_runs)
    finally:
        if tmp:
            tmp.cleanup()

    return _report(shape, shape_source, steps, warmup, gpu_count, first_data, runs, wgrad)


def _summarize_shape(shape_runs: list[ModeResult]) -> None:
    """Derived fields of one pipeline shape's rows; eager (the first row) is the reference if it finished."""
    eager = shape_runs[0] if shape_runs[0].status == "finished" else None
    summarize(shape_runs[0], None)
    for r in shape_runs[1:]:
        summarize(r, eager)


def _report(shape: AuditShape, shape_source: str, steps: int, warmup: int, gpu_count: int,
            first_data: dict[str, Any], runs: list[ModeResult], wgrad: list[ModeResult]) -> AuditReport:
    versions = Versions(**first_data["versions"]) if first_data.get("versions") else _installed_versions()
    common = dict(first_data.get("common_settings") or {})
    common.update({
        "model": "megatron.core GPTModel, get_gpt_layer_with_transformer_engine_spec(), learned absolute positions, "
                 "untied embeddings, Float16Module (bf16), Megatron DDP (fp32 main_grad), Megatron Adam (fp32 master)",
        "fp8": f"hybrid, delayed scaling, margin {shape.fp8_margin}, amax history {shape.amax_history_len}, "
               f"{shape.amax_compute_algo}",
        "rng": "model_parallel_cuda_manual_seed(te_rng_tracker=True, use_cudagraphable_rng=True) in every mode",
        "init": "parameters re-drawn from one CUDA generator per chunk (identical across modes)",
        "data": f"synthetic tokens, {4 * shape.microbatches} fixed microbatches cycled",
    })
    return AuditReport(
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        versions=versions, device=first_data.get("device"), gpu_count=gpu_count, shape=shape,
        shape_source=shape_source, steps=steps, warmup_steps=warmup, common_settings=common, runs=list(runs),
        delayed_wgrad=list(wgrad),
        notes=[
            "Ratios are within Megatron: graph median / eager median step time at the same pipeline shape "
            "(full optimizer step, synchronized), after the warm-up steps (which include graph capture).",
            "Losses are compared at six significant digits (Megatron's training log prints '{:.6E}'); "
            "losses_bitwise_equal_eager is the exact comparison of the fp32 values.",
        ],
    )
