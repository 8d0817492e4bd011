"""check_field_types: a keyword given to a config dataclass must have its field's type.

The command line's values are typed by argparse (cli_args.py), but `Engine(page_size=16.0)`
hands Python values straight to the dataclasses: a float where an int goes reached torch as a
tensor size, a string reached a comparison, `True` was a page size of 1. NaN passes every
range check written `x < low` (all comparisons with NaN are false), so it is refused here for
every float field, from either entry.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
from typing import Any


def flag_of(name: str) -> str:
    """The command-line flag of field `name`."""
    return "--" + name.replace("_", "-")


def check_field_types(cls: type, values: dict[str, Any]) -> None:
    """TypeError (ValueError for NaN) naming the keyword and its flag, for the first value in
    `values` that its field of `cls` cannot hold: int (not bool), float (int or float, not
    NaN), str, bool, list[str]; `| None` fields also take None. Other integer and real types
    (numpy's `np.int64(16)`, `np.float32(0.5)`) are held as Python ints and floats: `values`
    is updated in place."""
    annotations = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    for name, value in values.items():
        annotation = annotations[name]
        optional = annotation.endswith("| None")
        base = annotation.removesuffix("| None").strip()
        if value is None and optional:
            continue
        named = f"{name} ({flag_of(name)})"
        value = values[name] = _as_python_number(base, value)
        if not _holds(base, value):
            raise TypeError(f"{named} must be {_KINDS[base]}; got {value!r}")
        if base == "float" and math.isnan(value):
            raise ValueError(f"{named} must be a number; got nan")


def _as_python_number(base: str, value: Any) -> Any:
    """A non-bool Integral (a real for float fields) as int / float; anything else as it is."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if base in ("int", "float") and isinstance(value, numbers.Integral):
        return int(value)
    if base == "float" and isinstance(value, numbers.Real):
        return float(value)
    return value


_KINDS = {
    "int": "an int",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "list[str]": "a list of strings",
}


def _holds(base: str, value: Any) -> bool:
    if base == "bool":
        return isinstance(value, bool)
    if isinstance(value, bool):  # an int too, but never a count, size or ratio
        return False
    if base == "int":
        return isinstance(value, int)
    if base == "float":
        return isinstance(value, int | float)
    if base == "str":  # a path may be a Path (`Engine(tmp_path / "model")`)
        return isinstance(value, str | os.PathLike)
    if base == "list[str]":
        return isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    raise AssertionError(f"no type check for the annotation {base!r}")
