"""C4-format JSON-lines reading, token packing and a resumable microbatch stream.

Every check runs when a dataset is built, before any training step: a bad shard must fail in one line
naming the file (and line), not an hour into a run. Everything here is deterministic in (data, seed),
so a resumed run sees exactly the microbatches an uninterrupted one would have seen.
"""

from __future__ import annotations

import array
import glob
import gzip
import hashlib
import json
import math
import os
import random
import zlib
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from qeffect.data.tokenizer import HELDOUT_ASSET, TRAIN_ASSET, bundled_asset, eot_id
from qeffect.errors import UserError

_GZIP_MAGIC = b"\x1f\x8b"
_GLOB_CHARS = frozenset("*?[")
_ENCODE_CHUNK = 1024  # documents per encode_batch call: bounds memory on large user corpora
HELDOUT_FRACTION = 10  # with a user spec and no held-out spec, the last ceil(n / 10) records are held out


def _one_line(text: object, limit: int = 200) -> str:
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
        raise UserError(f"{path}: is a directory; pass a file or a glob such as '{path}/*.json.gz'")
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    return [path]


def _raw_lines(path: Path) -> Iterator[bytes]:
    """Lines of a plain or gzip file (detected by magic bytes, whatever the suffix says)."""
    try:
        with open(path, "rb") as f:
            gz = f.read(2) == _GZIP_MAGIC
        if not gz:
            with open(path, "rb") as f:
                yield from f
            return
        with gzip.open(path, "rb") as f:
            yield from f
    except EOFError:
        raise UserError(f"{path}: truncated gzip (compressed data ends early)") from None
    except (gzip.BadGzipFile, zlib.error) as e:
        raise UserError(f"{path}: corrupt gzip: {_one_line(e)}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read: {_one_line(e.strerror or e)}") from None


def _iter_file(path: Path) -> Iterator[dict[str, Any]]:
    count = 0
    for lineno, raw in enumerate(_raw_lines(path), start=1):
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
        if not isinstance(record.get("text"), str):
            got = "missing" if "text" not in record else f"a {type(record['text']).__name__}"
            raise UserError(f'{path}:{lineno}: record has no string "text" field ({got})')
        count += 1
        yield record
    if count == 0:
        raise UserError(f"{path}: empty shard")


def iter_records(spec: str | Path) -> Iterator[dict[str, Any]]:
    """C4 records (dicts with a string ``text``) from a file or a glob of shards, in sorted shard order.

    Files are JSON lines, optionally gzip-compressed (``.json``, ``.jsonl``, ``.json.gz``,
    ``.jsonl.gz``: C4's own shards are JSON lines despite the ``.json.gz`` name). Problems raise
    ``UserError`` naming the file and line. The files are resolved at once; records stream lazily.
    """
    files = resolve_files(spec)

    def gen() -> Iterator[dict[str, Any]]:
        for path in files:
            yield from _iter_file(path)

    return gen()


class PackedDataset:
    """Documents tokenized, joined with end-of-text ids, cut into sequences of ``seq_len + 1`` tokens.

    Sequence ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: consecutive sequences share one
    token, so every token after the first is a target exactly once. The tail shorter than a sequence is
    dropped. An end-of-text id follows every document (so it also separates documents across shards).
    """

    def __init__(self, texts: Iterable[str], tokenizer: Tokenizer, seq_len: int, *, source: str = "data"):
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len must be a positive integer, got {seq_len!r}")
        eot = eot_id(tokenizer)
        ids = array.array("i")
        docs = 0
        chunk: list[str] = []
        for text in texts:
            chunk.append(text)
            if len(chunk) == _ENCODE_CHUNK:
                docs += self._extend(ids, tokenizer, chunk, eot)
                chunk = []
        docs += self._extend(ids, tokenizer, chunk, eot)
        if len(ids) < seq_len + 1:
            raise UserError(
                f"{source}: {len(ids)} tokens in {docs} documents, fewer than one sequence of "
                f"seq_len + 1 = {seq_len + 1}"
            )
        self.source = source
        self.seq_len = seq_len
        self.num_documents = docs
        self.vocab_size = tokenizer.get_vocab_size()
        self.fingerprint = hashlib.sha256(ids.tobytes()).hexdigest()  # identifies the token stream
        # int32 halves memory on large corpora; batches come out int64
        self.tokens = torch.frombuffer(ids, dtype=torch.int32).clone()

    @staticmethod
    def _extend(ids: array.array, tokenizer: Tokenizer, texts: list[str], eot: int) -> int:
        for enc in tokenizer.encode_batch(texts, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eot)
        return len(texts)

    @classmethod
    def from_spec(cls, spec: str | Path, tokenizer: Tokenizer, seq_len: int) -> PackedDataset:
        return cls((r["text"] for r in iter_records(spec)), tokenizer, seq_len, source=str(spec))

    @property
    def num_tokens(self) -> int:
        return self.tokens.numel()

    def __len__(self) -> int:
        return (self.num_tokens - 1) // self.seq_len

    def sequences(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[len(indices), seq_len]`` int64, for the given sequence indices."""
        n = len(self)
        for i in indices:
            if not 0 <= i < n:
                raise IndexError(f"sequence {i} out of range for {n} sequences")
        if not indices:
            raise IndexError("no sequence indices")
        rows = torch.stack(
            [self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in indices]
        )
        rows = rows.to(torch.int64)
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def num_batches(self, batch_size: int) -> int:
        return len(self) // batch_size

    def batch(self, index: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Batch ``index`` in file order (sequences ``index*batch_size`` onward): for evaluation."""
        if batch_size < 1 or not 0 <= index < self.num_batches(batch_size):
            raise IndexError(f"batch {index} of size {batch_size} out of range for {len(self)} sequences")
        return self.sequences(range(index * batch_size, (index + 1) * batch_size))

    def order(self, seed: int, epoch: int) -> list[int]:
        """A permutation of the sequence indices, fixed by (seed, epoch).

        ``random.Random`` seeded with a string (SHA-512 based) and ``shuffle`` are stable across Python
        versions and platforms, unlike ``torch.randperm``'s stream.
        """
        perm = list(range(len(self)))
        random.Random(f"qeffect.data.order:{int(seed)}:{int(epoch)}").shuffle(perm)
        return perm


class DataStream:
    """Training microbatches in a shuffled, per-epoch order; resumable from ``state_dict()``.

    Each epoch walks ``dataset.order(seed, epoch)`` in global batches of ``batch_size * dp_size``
    sequences (the tail that does not fill one is skipped, so every microbatch has the same shape, as
    captured graphs need); data-parallel rank ``dp_rank`` takes its contiguous slice of each.
    """

    def __init__(
        self, dataset: PackedDataset, batch_size: int, seed: int, *, dp_rank: int = 0, dp_size: int = 1
    ):
        if batch_size < 1:
            raise UserError(f"batch size must be positive, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        if len(dataset) < batch_size * dp_size:
            raise UserError(
                f"{dataset.source}: {len(dataset)} sequences of {dataset.seq_len} tokens, fewer than one "
                f"global batch of {batch_size} x {dp_size} data-parallel ranks"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = int(seed)
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.batches_per_epoch = len(dataset) // (batch_size * dp_size)
        self.epoch = 0
        self.cursor = 0  # global batches already served in this epoch
        self._order: list[int] | None = None

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            self._order = self.dataset.order(self.seed, self.epoch)
        return self._order

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next microbatch (inputs, targets), each ``[batch_size, seq_len]`` int64."""
        if self.cursor >= self.batches_per_epoch:
            self.epoch += 1
            self.cursor = 0
            self._order = None
        start = (self.cursor * self.dp_size + self.dp_rank) * self.batch_size
        indices = self._epoch_order()[start : start + self.batch_size]
        self.cursor += 1
        return self.dataset.sequences(indices)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """Plain ints and strings (JSON-safe): the position plus what must match to resume."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "seq_len": self.dataset.seq_len,
            "num_sequences": len(self.dataset),
            "fingerprint": self.dataset.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` left off; refuse a stream over other data or another batching."""
        mine = self.state_dict()
        for key in ("seed", "batch_size", "dp_rank", "dp_size", "seq_len", "num_sequences", "fingerprint"):
            if state.get(key) != mine[key]:
                raise UserError(
                    f"cannot resume the data stream: saved {key}={state.get(key)!r}, this run has {mine[key]!r}"
                )
        epoch, cursor = state.get("epoch"), state.get("cursor")
        if (
            not (isinstance(epoch, int) and isinstance(cursor, int))
            or epoch < 0
            or not 0 <= cursor <= self.batches_per_epoch
        ):
            raise UserError(f"cannot resume the data stream: bad position epoch={epoch!r} cursor={cursor!r}")
        self.epoch, self.cursor, self._order = epoch, cursor, None


def load_datasets(
    data: str | Path | None, tokenizer: Tokenizer, seq_len: int, heldout: str | Path | None = None
) -> tuple[PackedDataset, PackedDataset]:
    """(train, held-out) datasets, both fully read and checked before this returns.

    - ``data`` None (or ""): the bundled Jargon File assets (1,600 train / 400 held-out records).
    - ``data`` given, ``heldout`` None: the last ``ceil(n / 10)`` records of ``data`` (in sorted shard
      order) are held out and NOT trained on; the rest is the training set. Needs at least 2 records.
    - both given: all of ``data`` trains, all of ``heldout`` evaluates.
    - ``data`` None, ``heldout`` given: bundled train, that held-out set.
    """
    if heldout:
        held = PackedDataset.from_spec(heldout, tokenizer, seq_len)
    if not data:
        train = PackedDataset.from_spec(bundled_asset(TRAIN_ASSET), tokenizer, seq_len)
        if not heldout:
            held = PackedDataset.from_spec(bundled_asset(HELDOUT_ASSET), tokenizer, seq_len)
        return train, held
    if heldout:
        return PackedDataset.from_spec(data, tokenizer, seq_len), held
    texts = [r["text"] for r in iter_records(data)]
    if len(texts) < 2:
        raise UserError(f"{data}: {len(texts)} record; need at least 2 to hold out the last 10%")
    cut = len(texts) - math.ceil(len(texts) / HELDOUT_FRACTION)
    train = PackedDataset(texts[:cut], tokenizer, seq_len, source=f"{data} (first {cut} records, training)")
    held = PackedDataset(
        texts[cut:], tokenizer, seq_len, source=f"{data} (last {len(texts) - cut} records, held out)"
    )
    return train, held
