"""The bundled byte-level BPE tokenizer and asset lookup.

Assets ship inside the package (``qeffect/data/assets``) so a wheel install trains offline with pinned
bytes; ``importlib.resources`` finds them wherever the package lives.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer

from qeffect.errors import UserError

EOT_TOKEN = "<|endoftext|>"
TRAIN_ASSET = "jargon-train.jsonl.gz"
HELDOUT_ASSET = "jargon-heldout.jsonl.gz"
TOKENIZER_ASSET = "tokenizer.json"


def bundled_asset(name: str) -> Path:
    """Path of a file in ``qeffect/data/assets`` (a plain file: the package is never zipped)."""
    path = Path(str(resources.files("qeffect.data").joinpath("assets", name)))
    if not path.is_file():
        raise UserError(f"{path}: bundled asset missing (reinstall qeffect)")
    return path


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A ``tokenizers.Tokenizer`` from a tokenizer.json; None (or "") = the bundled one (vocab 32,768)."""
    path = bundled_asset(TOKENIZER_ASSET) if path is None or str(path) == "" else Path(path).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: tokenizer file not found")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception with a multi-line serde message
        reason = " ".join(str(e).split())[:200]
        raise UserError(f"{path}: not a valid tokenizer.json: {reason}") from None


def eot_id(tokenizer: Tokenizer) -> int:
    """Id of the end-of-text token that separates packed documents."""
    tid = tokenizer.token_to_id(EOT_TOKEN)
    if tid is None:
        raise UserError(f"tokenizer has no {EOT_TOKEN} token (needed to separate documents)")
    return tid
