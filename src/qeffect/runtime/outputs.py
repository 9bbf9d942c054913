"""Output paths judged before any work: a file or folder that cannot be created is bad input, reported in
one line before a run, not as an OSError after it (a verification or a build can take minutes)."""

from __future__ import annotations

import os
from pathlib import Path

from qeffect.errors import UserError


def check_creatable(path: Path, what: str) -> None:
    """`UserError` unless `path` could be created: its nearest existing ancestor must be a folder this process
    may write into. An existing `path` is the caller's to judge (a run folder may be reused, a report
    replaced)."""
    path = Path(path)
    ancestor = path.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{path}: cannot create {what}: {ancestor} is not a folder")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise UserError(f"{path}: cannot create {what}: {ancestor} is not writable")


def check_folder_target(path: Path, what: str) -> None:
    """A folder to write into: an existing folder, or one that can be created."""
    if path.exists() and not path.is_dir():
        raise UserError(f"{path}: {what} exists and is not a folder")
    if not path.exists():
        check_creatable(path, what)


def check_report_target(path: Path | None) -> None:
    """A `--json` report file: creatable, and not an existing folder."""
    if path is None:
        return
    if Path(path).is_dir():
        raise UserError(f"{path}: is a folder; --json wants a file name")
    check_creatable(path, "the report")
