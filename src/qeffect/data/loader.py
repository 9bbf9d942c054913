"""Token packing, the run's datasets and a resumable microbatch stream (reading files: ``records``;
prepared folders: ``prepared``; the checks before any of it: ``plan``).

Every check runs when a dataset is built, before any training step: a bad shard must fail in one line
naming the file (and line), not an hour into a run. Everything here is deterministic in (data, seed),
so a resumed run sees exactly the microbatches an uninterrupted one would have seen.
"""

from __future__ import annotations

import array
import hashlib
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from qeffect.data.plan import DataPlan, Source, plan_data
from qeffect.data.prepared import PreparedDataset, SequenceBatches, heldout_dataset, train_dataset
from qeffect.data.records import iter_records, resolve_files
from qeffect.data.tokenizer import HELDOUT_ASSET, TRAIN_ASSET, bundled_asset, resolve_eot
from qeffect.errors import UserError

_ENCODE_CHUNK = 1024  # documents per encode_batch call: bounds memory on large user corpora

__all__ = ["DataStream", "Dataset", "PackedDataset", "iter_records", "load_datasets", "load_plan", "resolve_files"]


class PackedDataset(SequenceBatches):
    """Documents tokenized, joined with end-of-text ids, cut into sequences of ``seq_len + 1`` tokens.

    Sequence ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]``: consecutive sequences share one
    token, so every token after the first is a target exactly once. The tail shorter than a sequence is
    dropped. An end-of-text id follows every document (so it also separates documents across shards).
    """

    def __init__(self, texts: Iterable[str], tokenizer: Tokenizer, seq_len: int, *, source: str = "data",
                 eot: int | None = None):
        """``eot``: the end-of-text id (None: the tokenizer's own, ``resolve_eot``)."""
        if not isinstance(seq_len, int) or seq_len < 1:
            raise UserError(f"seq_len must be a positive integer, got {seq_len!r}")
        eot = resolve_eot(tokenizer)[1] if eot is None else eot
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
    def from_spec(cls, spec: str | Path, tokenizer: Tokenizer, seq_len: int, *, eot: int | None = None
                  ) -> PackedDataset:
        return cls((r["text"] for r in iter_records(spec)), tokenizer, seq_len, source=str(spec), eot=eot)

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

    def order(self, seed: int, epoch: int) -> list[int]:
        """A permutation of the sequence indices, fixed by (seed, epoch).

        ``random.Random`` seeded with a string (SHA-512 based) and ``shuffle`` are stable across Python
        versions and platforms, unlike ``torch.randperm``'s stream.
        """
        perm = list(range(len(self)))
        random.Random(f"qeffect.data.order:{int(seed)}:{int(epoch)}").shuffle(perm)
        return perm


Dataset = PackedDataset | PreparedDataset  # what DataStream walks and evaluation reads


class DataStream:
    """Training microbatches in a shuffled, per-epoch order; resumable from ``state_dict()``.

    Each epoch walks ``dataset.order(seed, epoch)`` in global batches of ``batch_size * dp_size``
    sequences (the tail that does not fill one is skipped, so every microbatch has the same shape, as
    captured graphs need); data-parallel rank ``dp_rank`` takes its contiguous slice of each.
    """

    def __init__(
        self, dataset: Dataset, batch_size: int, seed: int, *, dp_rank: int = 0, dp_size: int = 1
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


def _whole(src: Source, plan: DataPlan, seq_len: int) -> Dataset:
    """All of a source: a prepared folder's every token, or every record of JSON-lines files."""
    if src.folder is not None:
        return train_dataset(src.folder, seq_len, whole=True)
    return PackedDataset.from_spec(src.spec, plan.tokenizer, seq_len, eot=plan.eot_id)


def load_plan(plan: DataPlan, seq_len: int) -> tuple[Dataset, Dataset | None]:
    """(train, held-out) datasets of a checked ``DataPlan``, both read and checked before this returns.

    - ``train`` bundled: the bundled Jargon File assets (1,600 train / 400 held-out records); a held-out
      source replaces the bundled held-out file.
    - a held-out source given: all of ``train`` trains, all of the held-out source evaluates.
    - a prepared folder alone: its own split (``index.json``), read through a memory map.
    - JSON lines alone: the last ``ceil(n x heldout_fraction)`` records (in sorted shard order) are held out
      and NOT trained on; the rest trains (0.1: the last ``ceil(n / 10)``). A fraction of 0: no held-out.
    """
    src, held_src = plan.train, plan.heldout
    held: Dataset | None = _whole(held_src, plan, seq_len) if held_src is not None else None
    if src.kind == "bundled":
        train = PackedDataset.from_spec(bundled_asset(TRAIN_ASSET), plan.tokenizer, seq_len, eot=plan.eot_id)
        if held_src is None:
            held = PackedDataset.from_spec(bundled_asset(HELDOUT_ASSET), plan.tokenizer, seq_len, eot=plan.eot_id)
        return train, held
    if held_src is not None:
        return _whole(src, plan, seq_len), held
    if src.folder is not None:
        return train_dataset(src.folder, seq_len), heldout_dataset(src.folder, seq_len)
    texts = [r["text"] for r in iter_records(src.spec)]
    fraction = Fraction(repr(plan.heldout_fraction))  # exact: ceil(30 x 0.1) must be 3, not 4
    if fraction == 0:
        return PackedDataset(texts, plan.tokenizer, seq_len, source=src.spec, eot=plan.eot_id), None
    k = math.ceil(len(texts) * fraction)
    cut = len(texts) - k
    if cut < 1:
        need = next(n for n in range(2, 10**6) if n - math.ceil(n * fraction) >= 1)
        raise UserError(f"{src.spec}: {len(texts)} record(s); need at least {need} to hold out the last "
                        f"{float(fraction) * 100:g}% (data.heldout_fraction) and train on the rest")
    train = PackedDataset(texts[:cut], plan.tokenizer, seq_len, source=f"{src.spec} (first {cut} records, training)",
                          eot=plan.eot_id)
    held = PackedDataset(texts[cut:], plan.tokenizer, seq_len, source=f"{src.spec} (last {k} records, held out)",
                         eot=plan.eot_id)
    return train, held


def load_datasets(
    data: str | Path | None, tokenizer: Tokenizer, seq_len: int, heldout: str | Path | None = None,
    *, heldout_fraction: float = 0.1, eot: str = "",
) -> tuple[Dataset, Dataset | None]:
    """(train, held-out) datasets with an already loaded tokenizer (``load_plan``'s rules).

    ``data`` None (or ""): the bundled assets. A prepared folder's tokenizer hash is not checked here:
    ``plan_data`` with the tokenizer's path does that.
    """
    plan = plan_data(str(data) if data else None, tokenizer=tokenizer, eot=eot, heldout_fraction=heldout_fraction,
                     heldout_path=str(heldout) if heldout else None)
    return load_plan(plan, seq_len)
