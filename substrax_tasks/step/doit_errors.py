"""A pyproject.toml that is not valid TOML, told under `doit` as the CLI
tells it.

doit reads `[tool.doit]` from pyproject.toml before it loads the dodo file,
so such a file stops `doit` with a raw TOMLDecodeError traceback before any
code of ours runs. The one line of `substrax_tasks_doit_errors.pth`, which
the package installs beside itself, makes `report` the interpreter's last
word on an uncaught exception: that one exception, raised where doit reads
its configuration, becomes one line (exit status 1, as for any uncaught
exception); every other goes to the previous hook unchanged. The line
imports nothing: this module is imported only once an exception is
uncaught, so other programs of the environment pay nothing for it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import TracebackType

from substrax_tasks.errors import not_valid_toml

Hook = Callable[[type[BaseException], BaseException, TracebackType | None], object]
DOIT_CONFIG_READER = (os.path.join("doit", "doit_cmd.py"), "load_config_toml")  # noqa: PTH118 - a suffix


def report(previous: Hook, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    path = _doit_config_file(kind, tb)
    if path is None:
        previous(kind, exc, tb)
        return
    print(f"substrax: error: {not_valid_toml(os.path.abspath(path), exc)}", file=sys.stderr)  # noqa: PTH100


def _doit_config_file(kind: type[BaseException], tb: TracebackType | None) -> str | None:
    """The file doit was reading when it raised this TOML error, if it was."""
    if kind.__name__ != "TOMLDecodeError":  # tomllib's and tomli's, the parsers doit tries first
        return None
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename.endswith(DOIT_CONFIG_READER[0]) and code.co_name == DOIT_CONFIG_READER[1]:
            filename = tb.tb_frame.f_locals.get("filename")
            return str(filename) if filename else None
        tb = tb.tb_next
    return None
