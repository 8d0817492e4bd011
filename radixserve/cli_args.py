"""Builds argparse options from config dataclasses; each field's docstring is its help text."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from functools import cache
from typing import Any

from radixserve.config.field_types import flag_of

_TYPES = {"int": int, "float": float, "str": str}


@cache
def field_docs(cls: type) -> dict[str, str]:
    """Maps each field of a dataclass to the string literal written right below it."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_dataclass_args(
    parser: argparse.ArgumentParser, cls: type, title: str, exclude: tuple[str, ...] = ()
) -> None:
    """Adds one `--field-name` option per dataclass field (but those in `exclude`), typed and
    documented from the class."""
    group = parser.add_argument_group(title)
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        flag = flag_of(f.name)
        help_text = _help_text(docs.get(f.name, ""), f.default)
        annotation = str(f.type).replace(" | None", "").strip()
        if annotation == "list[str]":
            group.add_argument(flag, nargs="+", default=f.default, help=help_text)
        elif annotation == "bool":
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text
            )
        else:
            group.add_argument(flag, type=_TYPES[annotation], default=f.default, help=help_text)


def _help_text(doc: str, default: Any) -> str:
    """`doc` and the default; an unset default (None) is left to the doc where it says what
    unset means ("default: 32"), not shown as "(default: None)" after it."""
    if default is not None or "default" not in doc.lower():
        doc = f"{doc} (default: {default})"
    # argparse %-formats help text: a literal "%" (LoadConfig's "~20% slower") is escaped
    return doc.replace("%", "%%")


def field_names(cls: type) -> list[str]:
    """The dataclass's field names, which are also its options' argparse destinations."""
    return [f.name for f in dataclasses.fields(cls)]


def dataclass_flags(values: dict[str, Any], cls: type, exclude: tuple[str, ...] = ()) -> list[str]:
    """The inverse of `add_dataclass_args`: the options that reproduce `values` (fields at
    their default are left out), to hand a parsed configuration to a child command."""
    flags: list[str] = []
    for f in dataclasses.fields(cls):
        value = values.get(f.name, f.default)
        if f.name in exclude or value == f.default:
            continue
        if isinstance(value, bool):
            flags.append(flag_of(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list | tuple):
            flags += [flag_of(f.name), *map(str, value)]
        elif value is not None:
            flags += [flag_of(f.name), str(value)]
    return flags
