"""`qeffect prepare-data`: tokenize a corpus once into a memory-mapped token folder for `train --data`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer

from qeffect.cli.root import app


@app.command("prepare-data")
def prepare_data(
    inputs: list[str] = typer.Argument(
        ..., metavar="INPUT", help="JSON-lines (.jsonl, .json[.gz]), plain text (.txt[.gz]) or parquet files, or "
        "globs of them (quote the glob)."),
    out: Path = typer.Option(..., "--out", "-o", help="The prepared folder to write (must not exist or be empty)."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json (default: the bundled BPE)."),
    text_field: str = typer.Option("text", "--text-field", help="The text field of JSON-lines records and the text "
                                   "column of parquet files."),
    eot: str = typer.Option("", "--eot", help="The end-of-text token put after every document (default: the "
                            "tokenizer's own, e.g. <|endoftext|>)."),
    heldout_fraction: float = typer.Option(0.1, "--heldout-fraction", help="Hold out the last ceil(documents x F) "
                                           "documents for evaluation (0: none; then train with data.heldout_path)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing non-empty --out."),
    json_flag: bool = typer.Option(False, "--json", help="Print the folder's index (index.json) as JSON."),
) -> None:
    """Tokenize a corpus once into a prepared folder for `train --data DIR`.

    DIR (--out) gets tokens.bin (uint16, or uint32 for a vocabulary over 65,536), documents.npy and
    index.json (tokenizer sha256, split, sources with their sha256).

    `qeffect train --data DIR` then reads only the sequences each step needs: memory stays flat whatever its
    size, and a checkpoint records the exact position. The folder is written under a temporary name and renamed into place,
    so a bad input leaves nothing behind. Set data.heldout_fraction to the same F when training.
    """
    from qeffect.data.prepare import prepare_data as run

    t0 = time.perf_counter()
    show = sys.stderr.isatty() and not json_flag
    if show:
        from rich.console import Console
        from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("prepare-data"), BarColumn(), DownloadColumn(), TextColumn("{task.fields[info]}"),
                       TimeRemainingColumn(), console=Console(stderr=True), transient=True)
        task = bar.add_task("bytes", total=None, info="")

        def on_progress(done: int, total: int, tokens: int) -> None:
            bar.update(task, completed=done, total=total, info=f"{tokens:,} tokens")

        with bar:
            index = run(inputs, out, tokenizer=tokenizer, text_field=text_field, eot=eot,
                        heldout_fraction=heldout_fraction, overwrite=overwrite, on_progress=on_progress)
    else:
        index = run(inputs, out, tokenizer=tokenizer, text_field=text_field, eot=eot,
                    heldout_fraction=heldout_fraction, overwrite=overwrite)
    if json_flag:
        typer.echo(json.dumps(index.model_dump(mode="json"), indent=2))
        return
    s = index.split
    typer.echo(f"{out}: {index.num_tokens:,} tokens ({index.dtype}) in {index.num_documents:,} documents from "
               f"{len(index.sources)} file(s) in {time.perf_counter() - t0:.1f} s")
    typer.echo(f"training {s.train_tokens[1] - s.train_tokens[0]:,} tokens ({s.train_documents[1]:,} documents), "
               f"held out {s.heldout_tokens[1] - s.heldout_tokens[0]:,} tokens "
               f"({s.heldout_documents[1] - s.heldout_documents[0]:,} documents, fraction {s.heldout_fraction})")
    typer.echo(f"end of text {index.eot!r} (id {index.eot_id}), tokenizer sha256 {index.tokenizer_sha256[:16]}")
