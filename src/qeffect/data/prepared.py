"""Prepared data: a folder of tokens tokenized once (``qeffect prepare-data``), read through a memory map.

The folder::

    index.json      this format's name and version, the token dtype, counts, the tokenizer's sha256 and
                    vocabulary size, the end-of-text token, the train / held-out split, every source file
                    with its sha256 and size (``PreparedIndex``)
    tokens.bin      every token id, little-endian uint16 (vocabulary <= 65,536) or uint32, documents one
                    after another in input order, each followed by the end-of-text id
    documents.npy   int64 start offset (in tokens) of each document, in order

The held-out split is the last ``ceil(documents x fraction)`` documents: ``tokens[train_tokens]`` trains
and ``tokens[heldout_tokens]`` evaluates, the same tokens the in-memory JSON-lines packing gives.

Reading keeps memory flat whatever the file's size: ``PreparedDataset`` cuts the same sequences of
``seq_len + 1`` tokens as ``PackedDataset``, each read with one ``os.pread`` of its bytes, and its order is a
keyed pseudo-random permutation computed index by index (``Permutation``), never a list of every sequence.
Why not slices of the memory map: every page fault maps whole page-cache folios around the address (8 MiB
readahead and large folios on ext4: about 1.5 MiB of resident set per random 66-byte sequence, even with
MADV_RANDOM), so the resident set of a run grew with the number of sequences read, towards the file's size.
A ``pread`` copies only the bytes asked for; the page cache it fills is the kernel's, not the process's.
``PreparedFolder.tokens`` (a read-only ``numpy.memmap``) stays for inspection and tests. Nothing here imports
torch until a batch is cut.
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from collections.abc import Iterator, Sequence
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from qeffect.data.records import one_line
from qeffect.errors import UserError

if TYPE_CHECKING:
    import numpy as np
    import torch

FORMAT = "qeffect-prepared"
VERSION = 1
INDEX_FILE = "index.json"
TOKENS_FILE = "tokens.bin"
DOCUMENTS_FILE = "documents.npy"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}  # name in the index -> numpy dtype (little-endian)


def dtype_for(vocab_size: int) -> Literal["uint16", "uint32"]:
    """uint16 when every id fits (vocabulary of at most 65,536), else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SourceEntry(_Model):
    path: str
    kind: Literal["jsonl", "text", "parquet"]
    bytes: int
    sha256: str
    documents: int
    tokens: int


class Split(_Model):
    """Half-open ranges ``[start, stop)``: of documents and of tokens."""

    heldout_fraction: float
    train_documents: tuple[int, int]
    heldout_documents: tuple[int, int]
    train_tokens: tuple[int, int]
    heldout_tokens: tuple[int, int]


class PreparedIndex(_Model):
    format: Literal["qeffect-prepared"] = FORMAT
    version: int = VERSION
    dtype: Literal["uint16", "uint32"]
    num_tokens: int
    num_documents: int
    tokens_file: str = TOKENS_FILE
    tokens_sha256: str
    documents_file: str = DOCUMENTS_FILE
    vocab_size: int
    eot: str
    eot_id: int
    tokenizer: str  # the tokenizer file as given ('' = the bundled one)
    tokenizer_sha256: str
    text_field: str
    split: Split
    sources: list[SourceEntry]
    created_by: str


def is_prepared(path: str | Path) -> bool:
    """A folder holding an index.json: what ``prepare-data`` writes."""
    p = Path(path).expanduser()
    return p.is_dir() and (p / INDEX_FILE).is_file()


class PreparedFolder:
    """A prepared folder, its index read and checked against the files (no token is read here)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        index_path = self.path / INDEX_FILE
        try:
            raw = json.loads(index_path.read_text())
        except FileNotFoundError:
            raise UserError(f"{self.path}: no {INDEX_FILE}: not a prepared folder (qeffect prepare-data)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise UserError(f"{index_path}: unreadable: {one_line(e)}") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise UserError(f"{index_path}: not a qeffect prepared-data index (format {FORMAT!r} expected)")
        if raw.get("version") != VERSION:
            raise UserError(f"{index_path}: format version {raw.get('version')!r}; this qeffect reads version "
                            f"{VERSION} (prepare the data again)")
        try:
            self.index = PreparedIndex.model_validate(raw)
        except ValidationError as e:
            where = "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
            raise UserError(f"{index_path}: malformed index: {where[:200]}") from None
        ix = self.index
        self.tokens_path = self.path / ix.tokens_file
        self.documents_path = self.path / ix.documents_file
        want = ix.num_tokens * int(DTYPES[ix.dtype][-1])
        size = self.tokens_path.stat().st_size if self.tokens_path.is_file() else None
        if size != want:
            got = "missing" if size is None else f"{size:,} bytes"
            raise UserError(f"{self.tokens_path}: {got}, the index says {ix.num_tokens:,} {ix.dtype} tokens = "
                            f"{want:,} bytes (truncated or modified: prepare the data again)")
        if not self.documents_path.is_file():
            raise UserError(f"{self.documents_path}: missing (prepare the data again)")
        s = ix.split
        if not (0 == s.train_tokens[0] <= s.train_tokens[1] == s.heldout_tokens[0] <= s.heldout_tokens[1]
                == ix.num_tokens and 0 == s.train_documents[0] <= s.train_documents[1]
                == s.heldout_documents[0] <= s.heldout_documents[1] == ix.num_documents):
            raise UserError(f"{index_path}: inconsistent split {s.model_dump()}")

    @cached_property
    def tokens(self) -> np.memmap:
        """Every token, memory-mapped read-only (pages are read on touch, never the whole file)."""
        import numpy as np

        return np.memmap(self.tokens_path, dtype=DTYPES[self.index.dtype], mode="r", shape=(self.index.num_tokens,))

    @cached_property
    def _fd(self) -> int:
        fd = os.open(self.tokens_path, os.O_RDONLY)
        weakref.finalize(self, os.close, fd)
        return fd

    @cached_property
    def _dtype(self) -> np.dtype:
        import numpy as np

        return np.dtype(DTYPES[self.index.dtype])

    def read(self, start: int, count: int) -> np.ndarray:
        """Tokens ``[start, start + count)``: one ``pread`` of their bytes (nothing mapped, see the module)."""
        import numpy as np

        size = self._dtype.itemsize
        data = os.pread(self._fd, count * size, start * size)
        if len(data) != count * size:
            raise UserError(f"{self.tokens_path}: short read at token {start} (the file changed while in use?)")
        return np.frombuffer(data, dtype=self._dtype)

    @cached_property
    def documents(self) -> np.ndarray:
        """Start offset of every document (memory-mapped)."""
        import numpy as np

        return np.load(self.documents_path, mmap_mode="r")

    def check_tokenizer(self, sha256: str, where: str) -> None:
        """Refuse a run whose tokenizer is not the one the folder was tokenized with."""
        ix = self.index
        if sha256 != ix.tokenizer_sha256:
            made = ix.tokenizer or "the bundled tokenizer"
            raise UserError(f"{self.path}: tokenized with {made} (sha256 {ix.tokenizer_sha256[:12]}), but this "
                            f"run's tokenizer {where} has sha256 {sha256[:12]}: use the same tokenizer "
                            f"(data.tokenizer / --tokenizer) or prepare the data again")


class Permutation(Sequence[int]):
    """A pseudo-random permutation of ``range(n)`` fixed by ``key``, computed per index in O(1) memory.

    A balanced Feistel network (keyed BLAKE2b rounds) permutes ``[0, 4^k)`` with ``4^k >= n``; cycle-walking
    (apply again until the value falls below ``n``) restricts it to ``range(n)``: fewer than 4 walks on
    average. Stable across Python versions and platforms (hashlib only).
    """

    ROUNDS = 6

    def __init__(self, n: int, key: str):
        if n < 1:
            raise ValueError(f"permutation of {n} elements")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self.half = (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [hashlib.sha256(f"{key}:round{r}".encode()).digest()[:16] for r in range(self.ROUNDS)]

    def _encrypt(self, x: int) -> int:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            f = hashlib.blake2b(right.to_bytes(8, "little"), key=key, digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(f, "little") & self.mask)
        return (left << self.half) | right

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        i = int(i)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(f"index {i} out of range for a permutation of {self.n}")
        x = self._encrypt(i)
        while x >= self.n:
            x = self._encrypt(x)
        return x

    def __iter__(self) -> Iterator[int]:
        return (self[i] for i in range(self.n))


class SequenceBatches:
    """Evaluation batches over a dataset of packed sequences (`__len__` and `sequences(indices)`)."""

    def __len__(self) -> int:
        raise NotImplementedError

    def sequences(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def num_batches(self, batch_size: int) -> int:
        return len(self) // batch_size

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` in file order (sequences ``index*batch_size`` onward): for evaluation."""
        if batch_size < 1 or not 0 <= index < self.num_batches(batch_size):
            raise IndexError(f"batch {index} of size {batch_size} out of range for {len(self)} sequences")
        return self.sequences(range(index * batch_size, (index + 1) * batch_size))


class PreparedDataset(SequenceBatches):
    """Sequences of ``seq_len + 1`` tokens over ``tokens[start:stop]`` of a prepared folder, as
    ``PackedDataset`` cuts them (sequence ``i`` starts at token ``i * seq_len``), read from the memory map.
    The same interface as ``PackedDataset``: ``DataStream`` walks either."""

    def __init__(self, folder: PreparedFolder, start: int, stop: int, seq_len: int, *, source: str,
                 num_documents: int):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len must be a positive integer, got {seq_len!r}")
        if stop - start < seq_len + 1:
            raise UserError(f"{source}: {stop - start} tokens in {num_documents} documents, fewer than one "
                            f"sequence of seq_len + 1 = {seq_len + 1}")
        self.folder = folder
        self.start, self.stop = start, stop
        self.seq_len = seq_len
        self.source = source
        self.num_documents = num_documents
        self.vocab_size = folder.index.vocab_size
        # identifies the token stream: the file's hash (recorded when it was written) and the range
        self.fingerprint = hashlib.sha256(f"{folder.index.tokens_sha256}:{start}:{stop}".encode()).hexdigest()

    @property
    def tokens(self) -> np.memmap:
        return self.folder.tokens[self.start : self.stop]

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def sequences(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[len(indices), seq_len]`` int64, for the given sequence indices."""
        import numpy as np
        import torch

        n = len(self)
        if not len(indices):
            raise IndexError("no sequence indices")
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"sequence {i} out of range for {n} sequences")
        L = self.seq_len
        rows = np.empty((len(indices), L + 1), dtype=np.int64)
        for r, i in enumerate(indices):
            rows[r] = self.folder.read(self.start + i * L, L + 1)
        t = torch.from_numpy(rows)
        return t[:, :-1].contiguous(), t[:, 1:].contiguous()

    def order(self, seed: int, epoch: int) -> Permutation:
        """A permutation of the sequence indices fixed by (seed, epoch), without a list of them all."""
        return Permutation(len(self), f"qeffect.data.prepared.order:{int(seed)}:{int(epoch)}")


def train_dataset(folder: PreparedFolder, seq_len: int, *, whole: bool = False) -> PreparedDataset:
    """The folder's training split (``whole``: every token, when the held-out data comes from elsewhere)."""
    ix = folder.index
    if whole:
        return PreparedDataset(folder, 0, ix.num_tokens, seq_len, source=f"{folder.path}",
                               num_documents=ix.num_documents)
    (a, b), (da, db) = ix.split.train_tokens, ix.split.train_documents
    return PreparedDataset(folder, a, b, seq_len, source=f"{folder.path} (training split)", num_documents=db - da)


def heldout_dataset(folder: PreparedFolder, seq_len: int) -> PreparedDataset | None:
    """The folder's held-out split (None when it holds nothing out)."""
    ix = folder.index
    (a, b), (da, db) = ix.split.heldout_tokens, ix.split.heldout_documents
    if db == da:
        return None
    return PreparedDataset(folder, a, b, seq_len, source=f"{folder.path} (held-out split)", num_documents=db - da)
