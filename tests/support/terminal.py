"""A terminal as a user has one, to test what a person sees: a tmux server
of the test's own (its own socket name, stopped by name), one window of 200
columns, colours on."""

from __future__ import annotations

import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
from dodo_helpers import clean_env

TMUX = shutil.which("tmux")
needs_tmux = pytest.mark.skipif(
    TMUX is None, reason="TERMINAL VIEW NOT TESTED: tmux is missing (make installs it)"
)


class Terminal:
    """One tmux session `name` in `cwd`, on a server of its own."""

    def __init__(self, cwd: Path, name: str) -> None:
        self.socket = f"substrax-{name}-{uuid.uuid4().hex[:8]}"
        self.name = name
        env = clean_env()
        env.pop("NO_COLOR", None)
        env["TERM"] = "xterm-256color"
        self.tmux("new-session", "-d", "-x", "200", "-y", "100", "-c", str(cwd), "-s", name, env=env)

    def tmux(self, *args: str, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(
            [str(TMUX), "-L", self.socket, *args], capture_output=True, text=True, timeout=30, check=True,
            env=env,
        )  # fmt: skip
        return done.stdout

    def type(self, line: str) -> None:
        self.tmux("send-keys", "-t", self.name, line, "Enter")

    def screen(self) -> str:
        """What the window shows and has scrolled past, with its colours."""
        return self.tmux("capture-pane", "-t", self.name, "-p", "-e", "-J", "-S", "-2000")

    def close(self) -> None:
        subprocess.run([str(TMUX), "-L", self.socket, "kill-server"], capture_output=True, timeout=30,
                       check=False)  # fmt: skip
