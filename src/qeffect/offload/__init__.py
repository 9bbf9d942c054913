"""Activation offload under CUDA graphs: fixed-VA VMM slots with swappable physical pages.

`vmm.VmmSlot` keeps a graph's captured address valid while its memory is released and restored;
`group.OffloadManager` / `OffloadGroup` move a captured forward's saved activations to pinned host
memory and back around the replays (release or resident ping-pong mode, with look-ahead), every knob
from one `qeffect.config.OffloadConfig` (the run config's `[offload]` section);
`plan` and `timing` give resident mode its banks (the schedule's conflicts; the simulated step and the
bank search); `planning.plan` is the one call a builder makes at capture (events, costs, banks, short
windows, then the allocation); `checks` is the GPU check behind `qeffect offload-check`. Importing this
package needs neither a GPU nor `cuda.bindings` (imported lazily by `driver.load_bindings`).

Tested on CPU against `fake.FakeDevice` and on a GPU by tests/test_offload_gpu.py and `qeffect offload-check`.
"""

from __future__ import annotations

from qeffect.offload.driver import (
    CudaDriverError,
    OffloadUnavailable,
    VmmDriver,
    bindings_available,
    load_bindings,
)
from qeffect.offload.group import (
    MODES,
    GroupState,
    OffloadGroup,
    OffloadManager,
    OffloadMode,
    OffloadStateError,
    OffloadStats,
    TensorSpec,
    default_eligible,
)
from qeffect.offload.streams import StreamOps, TorchCudaStreams
from qeffect.offload.vmm import VmmSlot, round_up, wrap_pointer

__all__ = ["MODES", "CudaDriverError", "GroupState", "OffloadGroup", "OffloadManager", "OffloadMode",
           "OffloadStateError", "OffloadStats", "OffloadUnavailable", "StreamOps", "TensorSpec", "TorchCudaStreams",
           "VmmDriver", "VmmSlot", "bindings_available", "default_eligible", "load_bindings", "round_up",
           "wrap_pointer"]
