"""The expressions a program appends to its state: text, gen, select, role markers.

`s += expr` hands one of these to the state's executor. Expressions concatenate with `+`
(`"Q: " + gen("q")`), which is how role wrappers such as `user("hi" + gen("x"))` are built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.frontend_lang.choices import ChoicesSamplingMethod
from radixserve.frontend_lang.sampling import GenParams


class Expr:
    """Base of everything `s += ...` accepts besides plain strings."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList([self, to_expr(other)])

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList([to_expr(other), self])


@dataclass
class Text(Expr):
    """Constant text."""

    value: str


@dataclass
class Gen(Expr):
    """Generate text into variable `name` (None: append without storing)."""

    name: str | None
    params: GenParams
    dtype: type | None = None


@dataclass
class Select(Expr):
    """Append the best-scoring of `choices` and store it in `name`."""

    name: str | None
    choices: list[str]
    temperature: float
    method: ChoicesSamplingMethod


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


@dataclass
class VarScopeBegin(Expr):
    name: str


@dataclass
class VarScopeEnd(Expr):
    name: str


@dataclass
class SeparateReasoning(Expr):
    """Splits the variables that `expr`'s gens and selects stored into their content (kept
    under the name, and in the text) and reasoning (`<name>_reasoning_content`)."""

    expr: Expr | None
    model_type: str


@dataclass
class ExprList(Expr):
    """Expressions executed in order."""

    items: list[Expr] = field(default_factory=list)

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList([*self.items, to_expr(other)])

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList([to_expr(other), *self.items])


def to_expr(value: Any) -> Expr:
    """A string becomes Text; expressions pass through; anything else is a TypeError."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(
        f"a program state accepts strings and frontend expressions (gen, select, roles); "
        f"got {type(value).__name__}"
    )
