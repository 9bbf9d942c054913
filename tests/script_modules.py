"""Load a script of `benchmarks/` or `scripts/` as a module, for tests of its plain-Python parts."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


@contextmanager
def script_module(relative: str) -> Iterator[ModuleType]:
    """The script at `relative` (from the repository root) as a module registered under its stem while
    inside (dataclasses and pickling look their module up there); its folder on `sys.path`, so that it
    imports the scripts beside it."""
    path = ROOT / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path.remove(str(path.parent))
        sys.modules.pop(path.stem, None)
