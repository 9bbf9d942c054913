#!/usr/bin/env python3
"""Build qeffect's pinned training asset and tokenizer from the Jargon File 4.4.7.

C4 cannot be downloaded on the build machines, so the bundled data is the Jargon File (public domain),
as installed by Debian's ``jargon-text`` package, written in C4's JSON-lines format. Everything here is
deterministic: re-running the script gives byte-identical assets, and it prints their sha256.

    apt-get install -y jargon-text
    python3 scripts/build_jargon_asset.py            # writes src/qeffect/data/assets/
    python3 scripts/build_jargon_asset.py --check    # rebuilds in a temp dir, compares with SHA256SUMS

Rules (also in assets/README.md):
- An entry starts at a headword line ``   :headword: ...`` in Part II (The Jargon Lexicon) and runs to
  the next headword, the next letter heading (``  A``), or the start of Part III (Appendices).
- Record text = the entry with the 3-space indent removed, trailing spaces stripped, the leading ``:``
  of the headword dropped (``abbrev: /@·breev'/, n.`` then the body).
- Keep entries whose text has at least 128 characters; take the first 2,000 in file order.
- Record i (0-based, in that order) is held out when i % 5 == 4: 1,600 train, 400 held out.
- Byte-level BPE (vocab 32,768, min_frequency 1, ``<|endoftext|>`` = id 0) trained on the train split.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ASSET_DIR = Path(__file__).resolve().parent.parent / "src" / "qeffect" / "data" / "assets"
SOURCE_SHA256 = "fcaa76e4c2ebdf90c6557524b9430373dc49d1a26462ef30f43c0ace70a25a3a"  # jargon.txt.gz, 4.4.7-4.1
TIMESTAMP = "2003-12-29T00:00:00Z"  # release date of 4.4.7
URL_PREFIX = "jargon-file-4.4.7#"
MIN_CHARS = 128
NUM_RECORDS = 2000
HELDOUT_EVERY = 5
VOCAB_SIZE = 32768
MIN_FREQUENCY = 1  # reaches the full 32,768 on this corpus (2 gives 18,829)
EOT = "<|endoftext|>"
FILES = ("jargon-train.jsonl.gz", "jargon-heldout.jsonl.gz", "tokenizer.json")

_HEADWORD = re.compile(r"^   :(.+?):(?: .*)?$")
_LETTER = re.compile(r"^  [A-Z0]$")
_PART = re.compile(r"^\s+Part\s+(II|III)\.\s")


def find_source() -> Path:
    """The installed jargon.txt(.gz) of the Debian package."""
    try:
        out = subprocess.run(["dpkg", "-L", "jargon-text"], check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        sys.exit(f"jargon-text is not installed ({e}); run: apt-get install -y jargon-text")
    for line in out.splitlines():
        if line.endswith(("/jargon.txt.gz", "/jargon.txt")):
            return Path(line)
    sys.exit("dpkg -L jargon-text lists no jargon.txt(.gz)")


def read_source(path: Path) -> str:
    raw = path.read_bytes()
    if path.suffix == ".gz":
        digest = hashlib.sha256(raw).hexdigest()
        if digest != SOURCE_SHA256:
            print(f"warning: {path} sha256 {digest} differs from the pinned {SOURCE_SHA256}", file=sys.stderr)
        raw = gzip.decompress(raw)
    return raw.decode("utf-8")


def split_entries(text: str) -> list[tuple[str, str]]:
    """(headword, record text) for every lexicon entry, in file order."""
    entries: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    part = None
    for line in text.split("\n"):
        m = _PART.match(line)
        if m:
            part, current = m.group(1), None
            continue
        if part != "II":
            continue
        m = _HEADWORD.match(line)
        if m:
            current = [line[4:]]  # drop the indent and the headword's leading ':'
            entries.append((m.group(1), current))
        elif current is not None and (_LETTER.match(line) or (line and not line.startswith(" "))):
            current = None
        elif current is not None:
            current.append(line[3:] if line.startswith("   ") else line)
    return [(head, "\n".join(ln.rstrip() for ln in body).strip()) for head, body in entries]


def select_records(entries: list[tuple[str, str]]) -> list[dict[str, str]]:
    kept = [(h, t) for h, t in entries if len(t) >= MIN_CHARS][:NUM_RECORDS]
    if len(kept) != NUM_RECORDS:
        sys.exit(f"only {len(kept)} entries of at least {MIN_CHARS} characters (need {NUM_RECORDS})")
    return [{"text": t, "timestamp": TIMESTAMP, "url": URL_PREFIX + h} for h, t in kept]


def write_jsonl_gz(path: Path, records: list[dict[str, str]]) -> None:
    """Gzip with mtime 0 and no file name in the header, so the bytes depend only on the records."""
    payload = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(payload)
    path.write_bytes(buf.getvalue())


def train_tokenizer(texts: list[str], path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=MIN_FREQUENCY,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOT) == 0
    tok.save(str(path), pretty=False)
    return tok.get_vocab_size()


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(out: Path, source: Path) -> dict[str, str]:
    records = select_records(split_entries(read_source(source)))
    train = [r for i, r in enumerate(records) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [r for i, r in enumerate(records) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl_gz(out / FILES[0], train)
    write_jsonl_gz(out / FILES[1], heldout)
    vocab = train_tokenizer([r["text"] for r in train], out / FILES[2])
    sums = {name: sha256(out / name) for name in FILES}
    (out / "SHA256SUMS").write_text("".join(f"{h}  {n}\n" for n, h in sums.items()))
    print(f"records: {len(train)} train, {len(heldout)} held out; tokenizer vocab {vocab}")
    for name, digest in sums.items():
        print(f"{digest}  {name}  ({(out / name).stat().st_size} bytes)")
    return sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--source", type=Path, help="jargon.txt or jargon.txt.gz (default: from dpkg -L)")
    ap.add_argument("--out", type=Path, default=ASSET_DIR)
    ap.add_argument("--check", action="store_true", help="rebuild in a temp dir and compare with --out")
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    source = args.source or find_source()
    if not args.check:
        build(args.out, source)
        return
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(Path(tmp), source)
    pinned = (args.out / "SHA256SUMS").read_text()
    if pinned != "".join(f"{h}  {n}\n" for n, h in fresh.items()):
        sys.exit(f"rebuilt assets differ from {args.out / 'SHA256SUMS'}")
    print("identical to the pinned assets")


if __name__ == "__main__":
    main()
