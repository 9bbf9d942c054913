"""Reading documents from input files: C4-format JSON lines, plain text and parquet. No torch here.

Every problem is a ``UserError`` of one line naming the file (and the line or row): a bad shard must fail
before any training step, not an hour into a run. ``qeffect train`` reads JSON lines; ``qeffect
prepare-data`` reads all three kinds.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from qeffect.errors import UserError

_GZIP_MAGIC = b"\x1f\x8b"
_GLOB_CHARS = frozenset("*?[")
_POS_EVERY = 256  # lines between two progress reports

# suffixes (after an optional .gz) of each input kind
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text", ".md")
PARQUET_SUFFIXES = (".parquet",)

# a plain text file is one document, tokenized in pieces of about this many characters (bounded memory)
TEXT_PIECE_CHARS = 1 << 20
_TEXT_PIECE_MAX = 8 * TEXT_PIECE_CHARS  # without a safe place to cut, cut here anyway

Progress = Callable[[int], None]  # bytes of the current file consumed so far


def one_line(text: object, limit: int = 200) -> str:
    return " ".join(str(text).split())[:limit]


def resolve_files(spec: str | Path) -> list[Path]:
    """The files a spec names: one file, or every file a glob matches (sorted, so shard order is fixed)."""
    text = os.path.expanduser(str(spec))
    if _GLOB_CHARS & set(text):
        files = sorted(Path(p) for p in glob.glob(text, recursive=True) if os.path.isfile(p))
        if not files:
            raise UserError(f"{text}: no file matches")
        return files
    path = Path(text)
    if path.is_dir():
        raise UserError(f"{path}: is a folder without index.json: pass a prepared folder (qeffect "
                        f"prepare-data), a file or a glob such as '{path}/*.json.gz'")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    return [path]


def input_kind(path: Path) -> str:
    """'jsonl', 'text' or 'parquet', from the name (a trailing .gz is looked through)."""
    name = path.name.lower()
    if name.endswith(".gz"):
        name = name[:-3]
    for kind, suffixes in (("jsonl", JSONL_SUFFIXES), ("text", TEXT_SUFFIXES), ("parquet", PARQUET_SUFFIXES)):
        if name.endswith(suffixes):
            return kind
    known = ", ".join(JSONL_SUFFIXES + TEXT_SUFFIXES + PARQUET_SUFFIXES)
    raise UserError(f"{path}: unknown kind of input (expected a name ending in {known}, optionally .gz)")


def _open_raw(path: Path) -> tuple[io.BufferedReader, io.BufferedIOBase]:
    """(the file as stored, its decompressed reader): gzip is detected by magic bytes, whatever the suffix."""
    try:
        raw = open(path, "rb")  # noqa: SIM115 -- closed by the caller
    except OSError as e:
        raise _read_errors(path, e) from None
    gz = raw.read(2) == _GZIP_MAGIC
    raw.seek(0)
    return raw, (gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw)


def _read_errors(path: Path, e: BaseException) -> UserError:
    if isinstance(e, EOFError):
        return UserError(f"{path}: truncated gzip (compressed data ends early)")
    if isinstance(e, gzip.BadGzipFile | zlib.error):
        return UserError(f"{path}: corrupt gzip: {one_line(e)}")
    assert isinstance(e, OSError)
    return UserError(f"{path}: cannot read: {one_line(e.strerror or e)}")


def _raw_lines(path: Path, progress: Progress | None = None) -> Iterator[bytes]:
    """Lines of a plain or gzip file; ``progress`` gets the stored bytes consumed now and then."""
    raw, f = _open_raw(path)
    try:
        with raw, f:
            for n, line in enumerate(f, start=1):
                yield line
                if progress is not None and n % _POS_EVERY == 0:
                    progress(raw.tell())
            if progress is not None:
                progress(raw.tell())
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise _read_errors(path, e) from None


def iter_jsonl(path: Path, text_field: str = "text", progress: Progress | None = None) -> Iterator[dict[str, Any]]:
    """The records of one JSON-lines file (plain or gzip), each a dict with a string ``text_field``."""
    count = 0
    for lineno, raw in enumerate(_raw_lines(path, progress), start=1):
        if not raw.strip():
            continue  # blank lines (a trailing newline pair) are not records
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{path}:{lineno}: not UTF-8 ({e.reason} at byte {e.start})") from None
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(record, dict):
            raise UserError(f"{path}:{lineno}: record is a JSON {type(record).__name__}, not an object")
        if not isinstance(record.get(text_field), str):
            got = "missing" if text_field not in record else f"a {type(record[text_field]).__name__}"
            raise UserError(f'{path}:{lineno}: record has no string "{text_field}" field ({got})')
        count += 1
        yield record
    if count == 0:
        raise UserError(f"{path}: empty shard")


def iter_records(spec: str | Path, text_field: str = "text") -> Iterator[dict[str, Any]]:
    """C4 records (dicts with a string ``text``) from a file or a glob of shards, in sorted shard order.

    Files are JSON lines, optionally gzip-compressed (``.json``, ``.jsonl``, ``.json.gz``,
    ``.jsonl.gz``: C4's own shards are JSON lines despite the ``.json.gz`` name). Problems raise
    ``UserError`` naming the file and line. The files are resolved at once; records stream lazily.
    """
    files = resolve_files(spec)

    def gen() -> Iterator[dict[str, Any]]:
        for path in files:
            yield from iter_jsonl(path, text_field)

    return gen()


def _safe_cut(text: str) -> int:
    """Where a piece of plain text may end (0: nowhere): just after a newline between two non-space
    characters, where a byte-level BPE's pre-tokenizer splits anyway, so pieces encode as the whole does."""
    k = text.rfind("\n", 0, len(text) - 1)
    while k > 0:
        if not text[k - 1].isspace() and not text[k + 1].isspace():
            return k + 1
        k = text.rfind("\n", 0, k)
    return 0


def iter_text(path: Path, progress: Progress | None = None) -> Iterator[tuple[str, bool]]:
    """A plain text file (UTF-8, plain or gzip) as ONE document: ``(piece, last)`` pairs of about
    ``TEXT_PIECE_CHARS`` characters each, cut at newlines (see ``_safe_cut``), so memory stays bounded."""
    raw, f = _open_raw(path)
    carry, empty = "", True
    try:
        with raw, f, io.TextIOWrapper(f, encoding="utf-8", errors="strict", newline="") as text:
            while True:
                chunk = text.read(TEXT_PIECE_CHARS)
                if progress is not None:
                    progress(raw.tell())
                if not chunk:
                    break
                empty = False
                carry += chunk
                if len(carry) < TEXT_PIECE_CHARS:
                    continue
                cut = _safe_cut(carry) or (len(carry) if len(carry) >= _TEXT_PIECE_MAX else 0)
                if cut:
                    yield carry[:cut], False
                    carry = carry[cut:]
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not UTF-8 ({e.reason})") from None
    except (EOFError, gzip.BadGzipFile, zlib.error, OSError) as e:
        raise _read_errors(path, e) from None
    if empty:
        raise UserError(f"{path}: empty file")
    yield carry, True


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise UserError("reading parquet needs pyarrow: pip install 'qeffect[parquet]'") from None
    return pq


def check_parquet_available() -> None:
    """A one-line ``UserError`` now (before anything is written) when pyarrow is missing."""
    _parquet()


def iter_parquet(path: Path, text_field: str = "text", progress: Progress | None = None) -> Iterator[str]:
    """The string column ``text_field`` of a parquet file, one document per row (needs pyarrow)."""
    pq = _parquet()
    import pyarrow as pa

    try:
        f = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError with multi-line messages
        raise UserError(f"{path}: not a readable parquet file: {one_line(e)}") from None
    with f:
        schema = f.schema_arrow
        if text_field not in schema.names:
            raise UserError(f'{path}: no column "{text_field}" (columns: {", ".join(schema.names)[:150]})')
        typ = schema.field(text_field).type
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise UserError(f'{path}: column "{text_field}" is {typ}, not a string')
        total, size, row = max(1, f.metadata.num_rows), path.stat().st_size, 0
        try:
            for batch in f.iter_batches(columns=[text_field], batch_size=1024):
                for value in batch.column(0).to_pylist():
                    if value is None:
                        raise UserError(f'{path}: row {row}: "{text_field}" is null')
                    row += 1
                    yield value
                if progress is not None:
                    progress(size * row // total)
        except UserError:
            raise
        except Exception as e:
            raise UserError(f"{path}: unreadable parquet data: {one_line(e)}") from None
    if row == 0:
        raise UserError(f"{path}: empty (no rows)")
