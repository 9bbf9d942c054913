"""``qeffect prepare-data``: tokenize inputs once into a prepared folder (the format: ``prepared.py``).

Inputs are JSON-lines files (``.jsonl``, ``.json``, optionally gzip: one document per record, its
``text_field``), plain text files (``.txt``, ``.md``, optionally gzip: one document per file) and parquet
files (one document per row of the string column ``text_field``; needs pyarrow: the ``parquet`` extra).
Globs expand in sorted order; inputs keep the order given. Everything is checked before the folder
appears: the folder is written under a temporary name next to ``out`` and renamed into place at the end,
so a bad input (a missing file, a malformed line, an empty corpus) leaves nothing behind.
"""

from __future__ import annotations

import array
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

from qeffect import __version__
from qeffect.data.prepared import (
    DOCUMENTS_FILE,
    DTYPES,
    INDEX_FILE,
    TOKENS_FILE,
    PreparedIndex,
    SourceEntry,
    Split,
    dtype_for,
)
from qeffect.data.records import (
    check_parquet_available,
    input_kind,
    iter_jsonl,
    iter_parquet,
    iter_text,
    resolve_files,
)
from qeffect.data.tokenizer import file_sha256, load_tokenizer, resolve_eot, tokenizer_file
from qeffect.errors import UserError

_BATCH_DOCS = 1024  # pieces per encode_batch call
_BATCH_CHARS = 1 << 22  # or this many characters, whichever comes first (bounds the encodings' memory)

# (bytes done, bytes in all, tokens written so far)
OnProgress = Callable[[int, int, int], None]


def _pieces(path: Path, kind: str, text_field: str, progress) -> Iterator[tuple[str, bool]]:
    """``(text, ends_a_document)`` pairs of one input file."""
    if kind == "jsonl":
        return ((r[text_field], True) for r in iter_jsonl(path, text_field, progress))
    if kind == "parquet":
        return ((t, True) for t in iter_parquet(path, text_field, progress))
    return iter_text(path, progress)


class _Writer:
    """Appends encoded documents to tokens.bin and their start offsets to a raw int64 file."""

    def __init__(self, folder: Path, tokenizer, dtype: str, eot_id: int):
        self.tokenizer, self.dtype, self.eot_id = tokenizer, np.dtype(DTYPES[dtype]), eot_id
        self.tokens_f = open(folder / TOKENS_FILE, "wb")  # noqa: SIM115 -- closed by close()
        self.offsets_path = folder / ".documents.raw"
        self.offsets_f = open(self.offsets_path, "wb")  # noqa: SIM115
        self.sha = hashlib.sha256()
        self.tokens = 0
        self.documents = 0
        self._at_start = True

    def add(self, pieces: Iterable[tuple[str, bool]], on_batch: Callable[[], None]) -> None:
        texts: list[str] = []
        ends: list[bool] = []
        chars = 0
        for text, end in pieces:
            texts.append(text)
            ends.append(end)
            chars += len(text)
            if len(texts) >= _BATCH_DOCS or chars >= _BATCH_CHARS:
                self._flush(texts, ends)
                on_batch()
                texts, ends, chars = [], [], 0
        self._flush(texts, ends)
        on_batch()

    def _flush(self, texts: list[str], ends: list[bool]) -> None:
        if not texts:
            return
        ids = array.array("I")
        starts = array.array("q")
        for enc, end in zip(self.tokenizer.encode_batch(texts, add_special_tokens=False), ends, strict=True):
            if self._at_start:
                starts.append(self.tokens + len(ids))
            ids.extend(enc.ids)
            if end:
                ids.append(self.eot_id)
                self.documents += 1
            self._at_start = end
        data = np.frombuffer(ids, dtype=np.uint32).astype(self.dtype).tobytes()
        self.tokens_f.write(data)
        self.sha.update(data)
        self.offsets_f.write(np.frombuffer(starts, dtype=np.int64).astype("<i8").tobytes())
        self.tokens += len(ids)

    def offset_of(self, document: int) -> int:
        """Start offset of a document already written (``documents``: the token count)."""
        if document == self.documents:
            return self.tokens
        self.offsets_f.flush()
        with open(self.offsets_path, "rb") as f:
            f.seek(8 * document)
            return int(np.frombuffer(f.read(8), dtype="<i8")[0])

    def finish(self, folder: Path) -> None:
        """Close tokens.bin and turn the raw offsets into documents.npy (streamed: flat memory)."""
        for f in (self.tokens_f, self.offsets_f):
            f.flush()
            os.fsync(f.fileno())
            f.close()
        with open(folder / DOCUMENTS_FILE, "wb") as out, open(self.offsets_path, "rb") as raw:
            np.lib.format.write_array_header_1_0(
                out, {"descr": "<i8", "fortran_order": False, "shape": (self.documents,)})
            shutil.copyfileobj(raw, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        self.offsets_path.unlink()

    def close(self) -> None:
        for f in (self.tokens_f, self.offsets_f):
            if not f.closed:
                f.close()


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"{out}: exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"{out}: exists and is not empty (--overwrite replaces it)")


def _place(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an old ``out`` goes only once the new one is there."""
    if not out.exists():
        os.rename(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    os.rename(out, old)
    os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def prepare_data(inputs: Sequence[str | Path], out: str | Path, *, tokenizer: str | Path | None = None,
                 text_field: str = "text", eot: str = "", heldout_fraction: float = 0.1, overwrite: bool = False,
                 on_progress: OnProgress | None = None) -> PreparedIndex:
    """Tokenize ``inputs`` into the prepared folder ``out``; returns its index.

    The held-out split is the last ``ceil(documents x heldout_fraction)`` documents (in input order).
    ``tokenizer``: a tokenizer.json (None: the bundled one); ``eot``: the end-of-text token ('': the
    tokenizer's own). Refuses an existing non-empty ``out`` unless ``overwrite``.
    """
    if not 0 <= heldout_fraction < 1:
        raise UserError(f"--heldout-fraction {heldout_fraction}: must be at least 0 and below 1")
    if not inputs:
        raise UserError("no input given")
    if not text_field:
        raise UserError("--text-field must not be empty")
    out = Path(out).expanduser()
    _check_out(out, overwrite)
    files = [f for spec in inputs for f in resolve_files(spec)]
    kinds = [input_kind(f) for f in files]
    if "parquet" in kinds:
        check_parquet_available()
    tok_path = tokenizer_file(tokenizer)
    tok = load_tokenizer(tok_path)
    tok_sha = file_sha256(tok_path)
    eot_text, eot_id = resolve_eot(tok, eot)
    vocab = tok.get_vocab_size()
    dtype = dtype_for(vocab)
    sizes = [f.stat().st_size for f in files]
    total = sum(sizes)

    created = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    umask = os.umask(0o022)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 is for the temporary name only
    writer = _Writer(tmp, tok, dtype, eot_id)
    try:
        sources: list[SourceEntry] = []
        done = 0
        for path, kind, size in zip(files, kinds, sizes, strict=True):
            pos = [0]

            def report(_pos=pos, _done=done) -> None:
                if on_progress is not None:
                    on_progress(_done + _pos[0], total, writer.tokens)

            d0, t0_tokens = writer.documents, writer.tokens
            writer.add(_pieces(path, kind, text_field, lambda p, _pos=pos: _pos.__setitem__(0, p)), report)
            sources.append(SourceEntry(path=str(path), kind=kind, bytes=size, sha256=file_sha256(path),
                                       documents=writer.documents - d0, tokens=writer.tokens - t0_tokens))
            done += size
            if on_progress is not None:
                on_progress(done, total, writer.tokens)
        n_docs, n_tokens = writer.documents, writer.tokens
        held = math.ceil(n_docs * Fraction(repr(heldout_fraction)))
        if n_docs - held < 1:
            raise UserError(f"{n_docs} document(s) in all: holding out {held} (--heldout-fraction "
                            f"{heldout_fraction}) leaves none to train on")
        cut = writer.offset_of(n_docs - held)
        writer.finish(tmp)
        index = PreparedIndex(
            dtype=dtype, num_tokens=n_tokens, num_documents=n_docs, tokens_sha256=writer.sha.hexdigest(),
            vocab_size=vocab, eot=eot_text, eot_id=eot_id, tokenizer=str(tokenizer or ""), tokenizer_sha256=tok_sha,
            text_field=text_field,
            split=Split(heldout_fraction=heldout_fraction, train_documents=(0, n_docs - held),
                        heldout_documents=(n_docs - held, n_docs), train_tokens=(0, cut),
                        heldout_tokens=(cut, n_tokens)),
            sources=sources, created_by=f"qeffect {__version__}",
        )
        with open(tmp / INDEX_FILE, "w") as f:
            f.write(json.dumps(index.model_dump(mode="json"), indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        _check_out(out, overwrite)  # nothing appeared there meanwhile
        _place(tmp, out)
    except BaseException:
        writer.close()
        shutil.rmtree(tmp, ignore_errors=True)
        for p in created:  # the parents this call made, deepest first, if still empty
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return index
