"""The `qeffect` command line: one thin module per command, registered here.

`main` turns usage errors and `UserError`s into one line on stderr with exit code 2 (never a traceback).
"""

from __future__ import annotations

import sys

import typer

from qeffect import __version__
from qeffect.errors import ReportError, UserError

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


def _register() -> None:
    from qeffect.cli import verify_state  # noqa: F401  (each module registers its command on `app`)

    for name in ("train", "capture", "inspect_checkpoint", "profile", "offload_check", "audit_megatron"):
        try:
            __import__(f"qeffect.cli.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"qeffect.cli.{name}":
                raise


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit with `code`."""
    typer.echo(f"qeffect: error: {message}", err=True)
    raise SystemExit(code)


def _is(err: BaseException, name: str) -> bool:
    """Match click's exception classes by name: typer >= 0.28 vendors click as `typer._click`."""
    return any(c.__name__ == name for c in type(err).__mro__)


def main(argv: list[str] | None = None) -> None:
    _register()
    command = typer.main.get_command(app)
    try:
        rc = command.main(args=argv, prog_name="qeffect", standalone_mode=False)
    except (UserError, ReportError) as err:
        fail(str(err).replace("\n", " "), err.exit_code)
    except NotImplementedError as err:
        fail(f"not implemented yet: {err}", 2)
    except Exception as err:
        if _is(err, "NoArgsIsHelpError"):
            ctx = getattr(err, "ctx", None)
            typer.echo(ctx.get_help() if ctx else str(err))
            raise SystemExit(2) from None
        if _is(err, "UsageError"):
            fail(err.format_message().replace("\n", " "), 2)
        if _is(err, "Exit"):
            raise SystemExit(err.exit_code) from None
        if _is(err, "Abort"):
            fail("aborted", 130)
        raise
    raise SystemExit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
