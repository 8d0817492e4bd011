"""One JSON value re-serialized as it arrives, character by character, in `json.dumps`' form
(", " and ": " between tokens, non-ASCII kept), for streaming a call's arguments.

What it has emitted is always a prefix of the value's final form, and emitted text followed
by `closers()` is valid JSON: a key is held until its value starts, a number or literal
until it ends, so a call cut short (max_tokens, a broken tail) still ends as valid JSON.
"""

from __future__ import annotations

import json
import re

NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
LITERALS = ("true", "false", "null")
WHITESPACE = " \t\r\n"
SIMPLE_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
                  "t": "\t"}  # fmt: skip


class JsonStreamer:
    """Reads one JSON value (an object, when `object_only`) from successive pieces of text."""

    def __init__(self, object_only: bool = True):
        self.object_only = object_only
        self.stack: list[str] = []  # open containers, "{" or "["
        self.state = "value"  # value | key | colon | after | string | key_string | token
        self.first = True  # the open container has no member yet
        self.pending = ""  # separator and key, written when the value starts
        self.token = ""  # a number or literal being read, or a key's text
        self.escape: str | None = None  # a partial escape sequence inside a string
        self.out = ""  # emitted text not yet taken
        self.done = False
        self.failed = False

    def feed(self, text: str, final: bool = False) -> int:
        """Consumes `text` until the value ends or breaks; returns how many characters it used."""
        for i, ch in enumerate(text):
            if self.done or self.failed or not self._char(ch):
                return i
        if final and self.state == "token" and not self.done:
            self._end_token()
        return len(text)

    def take(self) -> str:
        """The text emitted since the last call."""
        out, self.out = self.out, ""
        return out

    def closers(self) -> str:
        """What closes the emitted text into valid JSON."""
        if self.done:
            return ""
        quote = '"' if self.state == "string" else ""
        return quote + "".join("}" if c == "{" else "]" for c in reversed(self.stack))

    # ---- one character; False: it does not belong to the value (not consumed) ----

    def _char(self, ch: str) -> bool:
        if self.state in ("string", "key_string"):
            return self._string_char(ch)
        if self.state == "token":
            if ch.isalnum() or ch in "+-.":
                self.token += ch
                return True
            if not self._end_token():
                return False
            if self.done:
                return False
        if ch in WHITESPACE:
            return True
        handler = {"value": self._value_start, "key": self._key_start, "colon": self._colon,
                   "after": self._after_value}[self.state]  # fmt: skip
        return handler(ch)

    def _value_start(self, ch: str) -> bool:
        if self.object_only and not self.stack and ch != "{":
            return self._fail()
        if ch in "{[":
            self._emit(self.pending + ch)
            self.stack.append(ch)
            self.state, self.first = ("key" if ch == "{" else "value"), True
            return True
        if ch == "]" and self.stack and self.stack[-1] == "[" and self.first:
            return self._close(ch)
        if ch == '"':
            self._emit(self.pending + '"')
            self.state = "string"
            return True
        if ch == "-" or ch.isalnum():
            self.state, self.token = "token", ch
            return True
        return self._fail()

    def _key_start(self, ch: str) -> bool:
        if ch == "}" and self.first:
            return self._close(ch)
        if ch != '"':
            return self._fail()
        self.state, self.token = "key_string", ""
        return True

    def _colon(self, ch: str) -> bool:
        if ch != ":":
            return self._fail()
        self.state = "value"
        return True

    def _after_value(self, ch: str) -> bool:
        top = self.stack[-1]
        if ch == ",":
            self.state = "key" if top == "{" else "value"
            self.pending = ", "
            return True
        if ch == ("}" if top == "{" else "]"):
            return self._close(ch)
        return self._fail()

    def _close(self, ch: str) -> bool:
        self.stack.pop()
        self._emit(ch)
        self._value_end()
        return True

    def _value_end(self) -> None:
        self.pending, self.first = "", False
        self.state = "after"
        self.done = not self.stack

    def _end_token(self) -> bool:
        token, self.token = self.token, ""
        if token not in LITERALS and not NUMBER.fullmatch(token):
            return self._fail()
        self._emit(self.pending + token)
        self._value_end()
        return True

    def _string_char(self, ch: str) -> bool:
        if self.escape is not None:
            return self._escape_char(ch)
        if ch == "\\":
            self.escape = ""
        elif ch == '"':
            self._string_end()
        else:
            self._string_text(ch)
        return True

    def _escape_char(self, ch: str) -> bool:
        self.escape += ch
        if self.escape[0] in SIMPLE_ESCAPES and len(self.escape) == 1:
            char, self.escape = SIMPLE_ESCAPES[ch], None
            self._string_text(char)
            return True
        if self.escape[0] != "u" or not re.fullmatch(r"u[0-9a-fA-F]{0,4}", self.escape):
            return self._fail()
        if len(self.escape) == 5:
            char, self.escape = chr(int(self.escape[1:], 16)), None
            self._string_text(char)
        return True

    def _string_text(self, char: str) -> None:
        if 0xD800 <= ord(char) <= 0xDFFF:  # a lone surrogate half: kept as its escape
            encoded = f"\\u{ord(char):04x}"
        else:
            encoded = json.dumps(char, ensure_ascii=False)[1:-1]
        if self.state == "key_string":
            self.token += encoded
        else:
            self._emit(encoded)

    def _string_end(self) -> None:
        if self.state == "key_string":
            self.pending = f'{self.pending}"{self.token}": '
            self.state, self.token = "colon", ""
            return
        self._emit('"')
        self._value_end()

    def _emit(self, text: str) -> None:
        self.out += text
        self.pending = ""

    def _fail(self) -> bool:
        self.failed = True
        return False
