"""The run's data and tokenizer, resolved and checked before any model is built (no torch here).

``plan_data`` resolves ``data.path`` and ``data.heldout_path`` (a prepared folder, a JSON-lines file or a
glob of shards, or the bundled asset), loads the tokenizer, finds the end-of-text token and checks that a
prepared folder was tokenized with this tokenizer and this held-out fraction. Everything wrong with the
data or the tokenizer is a one-line ``UserError`` here, within a second or two, before ``qeffect train``
imports the model. Reading the tokens is ``loader.load_plan``'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from qeffect.data.prepared import INDEX_FILE, PreparedFolder, is_prepared
from qeffect.data.records import resolve_files
from qeffect.data.tokenizer import file_sha256, load_tokenizer, resolve_eot, tokenizer_file
from qeffect.errors import UserError

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from qeffect.config import DataConfig

DEFAULT_HELDOUT_FRACTION = 0.1


@dataclass(frozen=True)
class Source:
    """Where one side of the data comes from: the bundled asset, JSON-lines files or a prepared folder."""

    spec: str
    kind: Literal["bundled", "jsonl", "prepared"]
    files: tuple[Path, ...] = ()
    folder: PreparedFolder | None = None


@dataclass(frozen=True)
class DataPlan:
    train: Source
    heldout: Source | None  # None: held out of `train` (its split, or `heldout_fraction` of its records)
    tokenizer: Tokenizer
    tokenizer_sha256: str | None
    eot: str
    eot_id: int
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION


def resolve_source(spec: str | Path) -> Source:
    """A prepared folder (a folder with index.json) or the JSON-lines files a file or glob names."""
    text = str(spec)
    if Path(text).name == INDEX_FILE and is_prepared(Path(text).parent):  # the folder's index names the folder
        text = str(Path(text).parent)
    if is_prepared(text):
        return Source(text, "prepared", folder=PreparedFolder(text))
    return Source(text, "jsonl", files=tuple(resolve_files(text)))


def plan_data(path: str | None = None, *, tokenizer: str | Tokenizer | None = None, eot: str = "",
              heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, heldout_path: str | None = None,
              vocab_size: int | None = None) -> DataPlan:
    """Resolve and check the data and tokenizer (see the module docstring).

    ``tokenizer``: a tokenizer.json path ('' / None: the bundled one), or an already loaded ``Tokenizer``
    (then a prepared folder's tokenizer hash cannot be checked). ``vocab_size``: the model's, which must hold
    every token id.
    """
    if not 0 <= heldout_fraction < 1:
        raise UserError(f"data.heldout_fraction = {heldout_fraction}: must be at least 0 and below 1")
    # the inputs first: a missing file is the commonest mistake, and the cheapest to find
    train = resolve_source(path) if path else Source("bundled", "bundled")
    held = resolve_source(heldout_path) if heldout_path else None
    if isinstance(tokenizer, str | Path) or tokenizer is None:
        tok_path = tokenizer_file(tokenizer)
        tok = load_tokenizer(tok_path)
        sha = file_sha256(tok_path)
        where = str(tokenizer) if tokenizer else "(the bundled one)"
    else:
        tok, sha, where = tokenizer, None, "(given)"
    vocab = tok.get_vocab_size()
    if vocab_size is not None and vocab > vocab_size:
        raise UserError(f"model.vocab_size ({vocab_size}) is smaller than the tokenizer's vocabulary ({vocab})")
    for src in (train, held):
        if src is None or src.folder is None:
            continue
        ix = src.folder.index
        if sha is not None:
            src.folder.check_tokenizer(sha, where)
        if vocab_size is not None and ix.vocab_size > vocab_size:
            raise UserError(f"{src.spec}: vocabulary of {ix.vocab_size} tokens, more than model.vocab_size "
                            f"({vocab_size})")
    if train.folder is not None:
        ix = train.folder.index
        if eot and eot != ix.eot:
            raise UserError(f"{train.spec}: documents end with {ix.eot!r}, but data.eot = {eot!r}: leave "
                            f"data.eot empty or prepare the data again with --eot")
        eot_text, eot_id = ix.eot, ix.eot_id
        if held is None and abs(ix.split.heldout_fraction - heldout_fraction) > 1e-12:
            raise UserError(f"{train.spec}: prepared with a held-out fraction of {ix.split.heldout_fraction}, "
                            f"but data.heldout_fraction = {heldout_fraction}: set it to "
                            f"{ix.split.heldout_fraction}, set data.heldout_path, or prepare the data again")
    else:
        eot_text, eot_id = resolve_eot(tok, eot)
    return DataPlan(train, held, tok, sha, eot_text, eot_id, heldout_fraction)


def plan_from_config(data: DataConfig, *, vocab_size: int | None = None) -> DataPlan:
    """``plan_data`` for a run's ``[data]`` section."""
    return plan_data(data.path or None, tokenizer=data.tokenizer or None, eot=data.eot,
                     heldout_fraction=data.heldout_fraction, heldout_path=data.heldout_path or None,
                     vocab_size=vocab_size)
