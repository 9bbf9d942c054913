"""The bundled byte-level BPE tokenizer and asset lookup.

Assets ship inside the package (``qeffect/data/assets``) so a wheel install trains offline with pinned
bytes; ``importlib.resources`` finds them wherever the package lives.
"""

from __future__ import annotations

import hashlib
import json
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from qeffect.errors import UserError

EOT_TOKEN = "<|endoftext|>"
# special tokens taken as the end of a text when the tokenizer has no <|endoftext|> and its post-processor
# appends none (the names tokenizers of other model families use), in this order
EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]", "<|end|>", "[SEP]")
TRAIN_ASSET = "jargon-train.jsonl.gz"
HELDOUT_ASSET = "jargon-heldout.jsonl.gz"
TOKENIZER_ASSET = "tokenizer.json"


def bundled_asset(name: str) -> Path:
    """Path of a file in ``qeffect/data/assets`` (a plain file: the package is never zipped)."""
    path = Path(str(resources.files("qeffect.data").joinpath("assets", name)))
    if not path.is_file():
        raise UserError(f"{path}: bundled asset missing (reinstall qeffect)")
    return path


def tokenizer_file(path: str | Path | None = None) -> Path:
    """The tokenizer.json a spec names: None (or "") = the bundled one."""
    return bundled_asset(TOKENIZER_ASSET) if path is None or str(path) == "" else Path(path).expanduser()


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks (flat memory)."""
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(chunk):
                h.update(block)
    except OSError as e:
        raise UserError(f"{path}: cannot read: {' '.join(str(e.strerror or e).split())}") from None
    return h.hexdigest()


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json; None (or "") = the bundled one (vocab 32,768)."""
    path = tokenizer_file(path)
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception with a multi-line serde message
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"{path}: not a valid tokenizer.json: {reason}") from None


def _post_processor_ends(processor: dict | None) -> list[str]:
    """Special tokens a post-processor appends after a single sequence (TemplateProcessing's tokens after
    ``$A``, Roberta's and Bert's ``sep``), in order."""
    if not isinstance(processor, dict):
        return []
    kind = processor.get("type")
    if kind == "Sequence":
        return [t for p in processor.get("processors") or [] for t in _post_processor_ends(p)]
    if kind in ("RobertaProcessing", "BertProcessing"):
        sep = processor.get("sep")
        return [sep[0]] if isinstance(sep, list) and sep and isinstance(sep[0], str) else []
    if kind == "TemplateProcessing":
        single = processor.get("single") or []
        after = [i + 1 for i, piece in enumerate(single) if isinstance(piece, dict) and "Sequence" in piece]
        tail = single[after[-1]:] if after else []
        return [p["SpecialToken"]["id"] for p in tail
                if isinstance(p, dict) and isinstance(p.get("SpecialToken"), dict)
                and isinstance(p["SpecialToken"].get("id"), str)]
    return []


def resolve_eot(tokenizer: Tokenizer, configured: str = "") -> tuple[str, int]:
    """(text, id) of the end-of-text token put after every document.

    ``configured`` (``data.eot`` / ``--eot``) when given: it must be one token of the vocabulary. Else the
    tokenizer's own: ``<|endoftext|>``, else the special token its post-processor appends after a text,
    else a special token with a usual end-of-sequence name (``EOS_NAMES``). None of them: a ``UserError``.
    """
    if configured:
        tid = tokenizer.token_to_id(configured)
        if tid is None:
            raise UserError(f"end-of-text token {configured!r} (data.eot / --eot) is not a token of the tokenizer")
        return configured, tid
    tid = tokenizer.token_to_id(EOT_TOKEN)
    if tid is not None:
        return EOT_TOKEN, tid
    try:
        spec = json.loads(tokenizer.to_str())
    except Exception:  # a tokenizer that does not serialize: no post-processor to read
        spec = {}
    special = [t.get("content") for t in spec.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")]
    candidates = _post_processor_ends(spec.get("post_processor")) + [n for n in EOS_NAMES if n in special]
    for text in candidates:
        tid = tokenizer.token_to_id(text)
        if tid is not None:
            return text, tid
    raise UserError(f"the tokenizer has no end-of-text token (no {EOT_TOKEN}, none appended by its "
                    "post-processor, no special token such as </s>): set data.eot (prepare-data --eot) to the "
                    "token that separates documents")


def eot_id(tokenizer: Tokenizer) -> int:
    """Id of the tokenizer's own end-of-text token that separates packed documents (``resolve_eot``)."""
    return resolve_eot(tokenizer)[1]
