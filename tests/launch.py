"""Shared by the torchrun tests: the launcher command on a free loopback port."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *target: str) -> list[str]:
    """`python -m torch.distributed.run` with `nproc` processes on loopback, then the script or `-m module`."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *target]
