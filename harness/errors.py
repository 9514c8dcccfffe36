"""User-facing errors.

Anything a user can cause (a bad flag, a malformed study file, an unknown variant, a
missing dataset) raises :class:`ModbenchError` with one line that names the problem and
the accepted values. The CLI prints that line and exits with code 2; programming errors
keep their tracebacks.
"""

from __future__ import annotations

import re

# scheme://user:password@host → scheme://user:***@host, wherever a URL appears in a text — also
# when a path normalisation has eaten a slash of it (a URL given where a file was expected).
_URL_PASSWORD = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]*:/{1,3}[^\s:/@]*:)[^\s@/]+@")


class ModbenchError(Exception):
    """A mistake in user input; its message is one line, shown without a traceback."""

    exit_code = 2


def accepted(values) -> str:
    """Render accepted values for an error message: ``'a', 'b' or 'c'``."""
    items = [repr(v) if isinstance(v, str) else str(v) for v in values]
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " or " + items[-1]


def redact(text: object) -> str:
    """``text`` with the password of every URL in it masked: for anything shown or stored
    (error lines, CLI output, reports, MLflow params and tags)."""
    return _URL_PASSWORD.sub(r"\1***@", str(text))
