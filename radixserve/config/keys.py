"""Where the server's API keys come from, and which settings are secrets.

    user key    --api-key        >  --api-key-file PATH        >  $RADIXSERVE_API_KEY
    admin key   --admin-api-key  >  --admin-api-key-file PATH  >  $RADIXSERVE_ADMIN_API_KEY

A flag shows in `ps` to every user of the machine; a file (mode 0600: others reading it get a
warning) or the environment (/proc/PID/environ is the owner's only) does not. Both variables
leave this process's environment once read, so the engine core and any other child never
inherits a key it does not need.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import MutableMapping
from dataclasses import dataclass, replace
from typing import Any

from radixserve.config.field_types import flag_of
from radixserve.config.server import ServerConfig

logger = logging.getLogger(__name__)
API_KEY_ENV = "RADIXSERVE_API_KEY"
ADMIN_API_KEY_ENV = "RADIXSERVE_ADMIN_API_KEY"
SECRET_WORDS = frozenset({"key", "keys", "secret", "secrets", "password", "passwd", "salt"})
"""A setting whose name has one of these words (split at `_`) is a secret, or names one (a
key file): never shown by /server_info or any other route. `token` only as the last word
(`hf_token`), since `bos_token_id` and `max_prefill_tokens` are not secrets."""


@dataclass(frozen=True)
class KeySource:
    """The three places one key may come from, and the flag that names it in errors."""

    field: str
    file_field: str
    env: str

    @property
    def flag(self) -> str:
        return flag_of(self.field)


KEY_SOURCES = (
    KeySource("api_key", "api_key_file", API_KEY_ENV),
    KeySource("admin_api_key", "admin_api_key_file", ADMIN_API_KEY_ENV),
)


def resolve_keys(
    config: ServerConfig, environ: MutableMapping[str, str] = os.environ
) -> ServerConfig:
    """`config` with api_key and admin_api_key taken from flag, file or environment (in that
    order); the key variables are removed from `environ`. ValueError names the bad source."""
    keys = {source.field: _resolve(config, source, environ) for source in KEY_SOURCES}
    if keys["api_key"] is not None and keys["api_key"] == keys["admin_api_key"]:
        raise ValueError("--admin-api-key must differ from --api-key (one key, one role)")
    return replace(config, **keys)


def _resolve(
    config: ServerConfig, source: KeySource, environ: MutableMapping[str, str]
) -> str | None:
    from_env = environ.pop(source.env, None) or None  # popped whatever wins: never inherited
    if (flag_value := getattr(config, source.field)) is not None:
        return check_key(flag_value, source.flag)
    if (path := getattr(config, source.file_field)) is not None:
        return read_key_file(path, flag_of(source.file_field))
    return None if from_env is None else check_key(from_env, "$" + source.env)


def read_key_file(path: str, flag: str) -> str:
    """The key in `path` (surrounding whitespace dropped); warns when group or others may
    read the file."""
    try:
        mode = os.stat(path).st_mode
        with open(path, encoding="utf-8") as file:
            text = file.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{flag} {path!r} cannot be read: {exc}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("%s %s can be read by group or others (chmod 600 it)", flag, path)
    return check_key(text.strip(), f"{flag} {path!r}")


def check_key(key: str, source: str) -> str:
    """The key, if a Bearer header can carry it: printable ASCII without spaces."""
    if not key:
        raise ValueError(f"the key from {source} is empty")
    if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
        raise ValueError(f"the key from {source} must be printable ASCII without spaces")
    return key


def is_secret_field(name: str) -> bool:
    """Whether a setting called `name` holds (or names the file of) a key or secret."""
    words = name.lower().split("_")
    return bool(SECRET_WORDS.intersection(words)) or words[-1] == "token"


def redact_secrets(values: dict[str, Any]) -> dict[str, Any]:
    """`values` without its secret settings, nested dicts included."""
    return {
        name: redact_secrets(value) if isinstance(value, dict) else value
        for name, value in values.items()
        if not is_secret_field(str(name))
    }
