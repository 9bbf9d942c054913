"""File-level helpers shared by the writer and the readers: hashes, atomic writes, quiet DCP calls."""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint import CheckpointException

# DCP raises CheckpointException, a BaseException (not an Exception): catch both, never SystemExit.
DCP_ERRORS = (Exception, CheckpointException)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in `path` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Temp file + fsync + rename: readers see the old content or the new one, never half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@contextmanager
def quiet_dcp() -> Iterator[None]:
    """DCP warns on every single-process call that it assumes a single process: that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def first_line(err: BaseException) -> str:
    """The informative line of an exception (DCP's CheckpointException embeds whole tracebacks)."""
    lines = [ln.strip() for ln in str(err).strip().splitlines()]
    lines = [ln for ln in lines if ln and not ln.startswith(("Traceback", "File ", "^", "~"))]
    return (lines[-1] if lines else type(err).__name__)[:300]
