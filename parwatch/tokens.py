"""The shared bearer token: read from a file or $PARWATCH_TOKEN by the sidecar, its CLI clients and the
collector alike (each names its own flag in the error). Below both the sidecar and the collector."""

from __future__ import annotations

import os
import stat
from pathlib import Path

TOKEN_ENV = "PARWATCH_TOKEN"


class TokenError(ValueError):
    """The token file cannot be used; the message names the flag and the fix."""


def check_private(path: str | os.PathLike, flag: str = "--token-file") -> None:
    """TokenError unless the token file is readable by its owner only (a shared secret must not be)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        raise TokenError(f"{flag} {path}: cannot read it ({err.strerror})") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"{flag} {path} is readable by group or others (mode {stat.filemode(mode)}); fix: chmod 600 {path}"
        )


def read_token(
    token_file: str | os.PathLike | None, environ=os.environ, flag: str = "--token-file", private: bool = False
) -> str | None:
    """The token from the file (stripped) or else PARWATCH_TOKEN; None when neither is set.

    The one token reader of the sidecar, the CLI clients and the collector; `flag` names
    the caller's option in the error. private: refuse a file readable by group or others
    (the sidecar's own token file)."""
    if token_file:
        if private:
            check_private(token_file, flag)
        try:
            token = Path(token_file).read_text().strip()
        except OSError as err:
            raise TokenError(
                f"{flag} {token_file}: cannot read it ({err.strerror}); "
                "point it at a readable file holding the sidecar's token"
            ) from err
        if not token:
            raise TokenError(f"{flag} {token_file} is empty; write the sidecar's token into it")
        return token
    return environ.get(TOKEN_ENV) or None
