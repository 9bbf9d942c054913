"""The `qeffect` Typer application every command module registers on, and the one-line error exit.

Why its own module: the command modules import `app` to register themselves, and `cli.app` (the entry
point) imports every command module, so `app` sits below both.
"""

from __future__ import annotations

import typer

from qeffect import __version__

app = typer.Typer(
    name="qeffect",
    help="FP8 pipeline-parallel training that stays bitwise equal to eager under CUDA graphs.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"qeffect {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """FP8 pipeline-parallel training that stays bitwise equal to eager under CUDA graphs."""


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit with `code`."""
    typer.echo(f"qeffect: error: {message}", err=True)
    raise SystemExit(code)
