"""`qeffect config show | schema`: the resolved run configuration as TOML, and every field it has.

`show` loads a TOML file (or the embedded default) and applies `--set section.field=value` exactly as
train, verify-state, profile and capture do, then prints every field of every section as TOML that
`qeffect.config.load_config` reads back to the same configuration. `schema` lists every field of
`qeffect.config.RunConfig`: type and bounds, default, whether it changes the numbers a run computes, and
its description (`--json`: a JSON list of the same).
"""

from __future__ import annotations

import json
import math
import typing
from pathlib import Path
from typing import Any

import typer
from pydantic.fields import FieldInfo

from qeffect.cli.common import SET_HELP, SET_METAVAR, config_from_cli
from qeffect.cli.root import app
from qeffect.config import RunConfig, changes_bits

config_app = typer.Typer(
    name="config",
    help="Show the resolved run configuration as TOML, or list every configuration field.",
    no_args_is_help=True,
    rich_markup_mode=None,
)
app.add_typer(config_app, name="config")


# --------------------------------------------------------------------------------------------- TOML
def toml_value(value: Any) -> str:
    """One value of a config field as TOML: str, int, float (repr: it reads back to the same float), bool and
    lists of them."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        # a JSON string is a TOML basic string, but for DEL, which TOML wants escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__} {value!r}")


def config_toml(cfg: RunConfig, header: typing.Sequence[str] = ()) -> str:
    """Every section and field of `cfg`, defaults included, as a TOML document (`# ` comment lines first)."""
    lines = [f"# {line}" for line in header]
    for section, values in cfg.model_dump().items():
        if lines:
            lines.append("")
        lines.append(f"[{section}]")
        lines += [f"{name} = {toml_value(value)}" for name, value in values.items()]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- schema
_BOUNDS = (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))


def _type(annotation: Any) -> tuple[str, list[Any] | None]:
    """(type name, choices of a Literal or None)."""
    if typing.get_origin(annotation) is typing.Literal:
        choices = list(typing.get_args(annotation))
        return type(choices[0]).__name__, choices
    if typing.get_origin(annotation) is list:
        (item,) = typing.get_args(annotation)
        return f"list[{item.__name__}]", None
    return getattr(annotation, "__name__", str(annotation)), None


def _bounds(field: FieldInfo) -> dict[str, Any]:
    out = {}
    for meta in field.metadata:
        for name, _ in _BOUNDS:
            if hasattr(meta, name) and getattr(meta, name) is not None:
                out[name] = getattr(meta, name)
    return out


def schema_rows() -> list[dict[str, Any]]:
    """One dict per field of `RunConfig`, in the TOML's section and field order."""
    rows = []
    for section, info in RunConfig.model_fields.items():
        for name, field in info.annotation.model_fields.items():
            kind, choices = _type(field.annotation)
            default = field.default_factory() if field.default_factory is not None else field.default
            rows.append({"field": f"{section}.{name}", "type": kind, "choices": choices, "bounds": _bounds(field),
                         "default": default, "changes_bits": changes_bits(field),
                         "description": field.description or ""})
    return rows


def _type_cell(row: dict[str, Any]) -> str:
    if row["choices"] is not None:
        return " | ".join(toml_value(c) for c in row["choices"])
    return " ".join([row["type"]] + [f"{op} {row['bounds'][name]}" for name, op in _BOUNDS
                                     if name in row["bounds"]])


# ----------------------------------------------------------------------------------------- commands
@config_app.command("show")
def show(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (default: the embedded tiny CPU config)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar=SET_METAVAR, help=SET_HELP),
) -> None:
    """Print the resolved configuration as TOML: the file (or the embedded default), then each --set.

    Every field of every section is printed, defaults included; the output is a config file that
    `--config` reads back to the same configuration. A bad file, field or value: one line, exit 2.
    """
    cfg = config_from_cli(config, sets=sets)
    header = [f"qeffect config show: {config if config is not None else 'the embedded tiny CPU config'}"]
    header += [f"--set {item}" for item in sets or ()]
    typer.echo(config_toml(cfg, header), nl=False)


@config_app.command("schema")
def schema(
    json_out: bool = typer.Option(False, "--json", help="Print a JSON list (field, type, choices, bounds, default, "
                                  "changes_bits, description) instead of the table."),
) -> None:
    """List every configuration field: section.field, type and bounds, default, changes bits, description.

    "changes bits": the field changes the numbers a run computes (a resume must keep it). Any field can
    be given in the TOML file's [section] or on the command line with --set section.field=value.
    """
    rows = schema_rows()
    if json_out:
        typer.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title=Text("qeffect configuration fields (TOML [section] field = value, or --set section.field=value)"))
    table.add_column("field", no_wrap=True)
    table.add_column("type")
    table.add_column("default")
    table.add_column("changes bits", no_wrap=True)
    table.add_column("description")
    for row in rows:  # Text: no rich markup in "[section]" or "<run folder>"
        table.add_row(Text(row["field"]), Text(_type_cell(row)), Text(toml_value(row["default"])),
                      "yes" if row["changes_bits"] else "no", Text(row["description"]))
    Console().print(table)
