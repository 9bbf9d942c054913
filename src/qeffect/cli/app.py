"""The `qeffect` command line's entry point: one thin module per command, each imported here.

`main` turns usage errors and `UserError`s into one line on stderr with exit code 2 (never a traceback).
"""

from __future__ import annotations

import sys

import typer

from qeffect.cli.root import app, fail
from qeffect.errors import ReportError, UserError

# the order `qeffect --help` lists the commands in
COMMANDS = ("verify-state", "prepare-data", "train", "capture", "inspect-checkpoint", "profile", "offload-check",
            "audit-megatron")
# command groups (typer sub-apps, such as `config show|schema`) follow the commands


def _register() -> None:
    """Import every command module (each registers its command on `app`), listed in `COMMANDS`' order; at
    `main`, not at import, so that importing this module stays cheap."""
    from qeffect.cli import (  # noqa: F401
        audit_megatron,
        capture,
        config,
        inspect_checkpoint,
        offload_check,
        prepare_data,
        profile,
        train,
        verify_state,
    )

    app.registered_commands.sort(key=lambda c: COMMANDS.index(c.name))


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
