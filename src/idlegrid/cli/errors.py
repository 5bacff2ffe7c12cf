"""Expected failures, said in one line for a person: the CLI prints these, not tracebacks.

An expected failure is one the user can fix: the coordinator is not where the URL says,
a token is wrong, a file is missing, the disk is full. Anything else is a bug and keeps
its traceback; `idlegrid --debug` keeps it for every failure.
"""

from __future__ import annotations

import errno

import httpx

from idlegrid.client import IdlegridError, Unreachable
from idlegrid.training.hf_folder import ModelError

_HINTS = {
    401: "check the token (IDLEGRID_TOKEN or --token): it may be mistyped or revoked",
    403: "this token may not do that (a node token, or not an admin)",
}


def explain(exc: BaseException, *, server: str = "") -> str | None:
    """One line saying what went wrong and what to do, or None for an unexpected error."""
    if isinstance(exc, Unreachable):
        return f"{exc.message} (is `idlegrid serve` running there? --server or IDLEGRID_SERVER)"
    if isinstance(exc, IdlegridError):
        hint = _HINTS.get(exc.status)
        where = f" at {server}" if server and exc.status else ""
        said = f"the coordinator{where} answered {exc.status} {exc.code}: {exc.message}"
        return f"{said}; {hint}" if hint else (said if exc.status else exc.message)
    if isinstance(exc, httpx.TransportError):
        url = _url_of(exc) or server or "the coordinator"
        return f"cannot reach {url}: {exc or type(exc).__name__}"
    if isinstance(exc, OSError):
        return _os_error(exc)
    if isinstance(exc, ModelError):
        return str(exc)
    return None


def _url_of(exc: httpx.TransportError) -> str:
    try:
        return str(exc.request.url)
    except RuntimeError:  # no request attached
        return ""


def _os_error(exc: OSError) -> str:
    name = f" {exc.filename}" if exc.filename else ""
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device to write{name}: free some space and try again"
    if exc.errno == errno.ENOENT:
        return f"no such file or directory:{name}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"permission denied:{name}"
    if exc.errno == errno.EISDIR:
        return f"{name.strip()} is a directory, not a file"
    reason = exc.strerror or str(exc)
    return f"{reason}:{name}" if name else reason
