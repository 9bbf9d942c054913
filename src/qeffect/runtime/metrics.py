"""What the training loop measures besides the loss: model FLOP utilization (MFU), device memory, and the
optional TensorBoard scalars.

MFU = the model's matrix FLOPs of one optimizer step (`qeffect.model.flops.count_matrix_flops`: every
backend linear, 2*N*in*out forward and twice that backward, all stages and microbatches, times the
data-parallel degree) / the step's seconds / (the device's dense FP8 peak x the devices the run uses:
one in a single process, the world size under torchrun). Every matrix product of the model is an FP8
GEMM, so the FP8 peak is the ceiling; attention scores, norms and the optimizer count as overhead. The
peak comes from a table of NVIDIA datasheet figures by device name; on the CPU or an unknown device MFU is
null and the summary says why.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from qeffect.config import RunConfig
from qeffect.errors import UserError
from qeffect.model.flops import count_matrix_flops

_DATASHEET = "NVIDIA {} datasheet, dense (half the with-sparsity figure)"


@dataclass(frozen=True)
class DevicePeak:
    """Dense tensor-core peaks of one device kind, in FLOP/s."""

    match: tuple[str, ...]  # all of these in the upper-cased `torch.cuda.get_device_name()`
    name: str
    fp8_flops: float
    bf16_flops: float
    source: str


# Most specific first: "NVIDIA H200 NVL" also contains "H200". torch names an H100 SXM "NVIDIA H100 80GB
# HBM3" and an H200 SXM "NVIDIA H200".
PEAKS: tuple[DevicePeak, ...] = (
    DevicePeak(("H200", "NVL"), "NVIDIA H200 NVL", 1670.5e12, 835.5e12, _DATASHEET.format("H200 NVL")),
    DevicePeak(("H200",), "NVIDIA H200 SXM", 1978.9e12, 989.4e12, _DATASHEET.format("H200 SXM")),
    DevicePeak(("H100", "NVL"), "NVIDIA H100 NVL", 1670.5e12, 835.5e12, _DATASHEET.format("H100 NVL")),
    DevicePeak(("H100", "PCIE"), "NVIDIA H100 PCIe", 1513.0e12, 756.5e12, _DATASHEET.format("H100 PCIe")),
    DevicePeak(("H100",), "NVIDIA H100 SXM", 1978.9e12, 989.4e12, _DATASHEET.format("H100 SXM")),
)


def peak_for(device_name: str) -> DevicePeak | None:
    up = device_name.upper()
    for p in PEAKS:
        if all(m in up for m in p.match):
            return p
    return None


@dataclass(frozen=True)
class MfuBasis:
    """What MFU divides by: FLOPs per step over (peak x devices); `peak_flops` None (with `note`): no MFU."""

    flops_per_step: int
    devices: int
    peak_flops: float | None
    peak_name: str | None
    peak_source: str | None
    note: str

    def mfu(self, step_seconds: float) -> float | None:
        if self.peak_flops is None or step_seconds <= 0:
            return None
        return self.flops_per_step / step_seconds / (self.peak_flops * self.devices)


def mfu_basis(cfg: RunConfig, device: torch.device, devices: int) -> MfuBasis:
    """The MFU denominator for this run: `devices` devices like `device`, dense FP8 peak each."""
    flops = count_matrix_flops(cfg).total * cfg.pipeline.dp
    if device.type != "cuda":
        return MfuBasis(flops, devices, None, None, None,
                        f"no MFU on {device.type}: no peak FLOP rate for it")
    name = torch.cuda.get_device_name(device)
    peak = peak_for(name)
    if peak is None:
        known = ", ".join(p.name for p in PEAKS)
        return MfuBasis(flops, devices, None, None, None,
                        f"no MFU: no peak FLOP rate known for {name!r} (known: {known})")
    return MfuBasis(flops, devices, peak.fp8_flops, f"{peak.name} dense FP8", peak.source,
                    f"model matrix FLOPs per step / step time / ({peak.name} dense FP8 peak x {devices} "
                    "device(s))")


def peak_allocated_bytes(device: torch.device) -> int | None:
    """This process's running peak of allocated device memory since it started (None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


def peak_reserved_bytes(device: torch.device) -> int | None:
    """This process's running peak of device memory reserved by torch's caching allocator (what a
    `train.memory_fraction` cap bounds) since it started (None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_reserved(device))


# ------------------------------------------------------------------------------------------ TensorBoard
TENSORBOARD_DIR = "tensorboard"
_MISSING = "[logging] tensorboard = true needs the tensorboard package: pip install 'qeffect[tensorboard]'"


def check_tensorboard() -> None:
    """Refuse `[logging] tensorboard = true` without the package, before the run writes anything."""
    if importlib.util.find_spec("tensorboard") is None:
        raise UserError(_MISSING)


class Scalars:
    """The step metrics as TensorBoard scalars under `<run folder>/tensorboard`: `train/<field>` for every
    numeric field of a metrics.jsonl record, `heldout/ce` for each evaluation; `purge_step` drops events a
    killed earlier attempt wrote from that step on."""

    def __init__(self, run_dir: Path, purge_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError(_MISSING) from None
        self.writer = SummaryWriter(log_dir=str(run_dir / TENSORBOARD_DIR), purge_step=purge_step)

    def step(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key in ("step", "heldout_ce") or isinstance(value, bool) or not isinstance(value, int | float):
                continue  # held-out CE comes through `eval`, which also sees the evaluation before step 1
            self.writer.add_scalar(f"train/{key}", value, step)
        self.writer.flush()

    def eval(self, step: int, ce: float | None) -> None:
        if ce is not None:
            self.writer.add_scalar("heldout/ce", ce, step)
            self.writer.flush()

    def close(self) -> None:
        self.writer.close()
