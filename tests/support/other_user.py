"""A user without root running the real `doit` and `substrax-compute`, as a
new user on a shared machine does: a uid with no account (reached with
setpriv, as the sandbox's escape tests reach theirs), a Python that uid can
run with this checkout's packages, and a folder it owns under one every uid
can reach. Run as a user without root already, the tests' own user is it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from dodo_helpers import REPO, clean_env
from sandbox_beds import SYSTEM_PATH, SYSTEM_PYTHON, chown_tree, free_uid

Done = subprocess.CompletedProcess[str]
COMPUTE_MAIN = "import sys; from substrax_tasks.cli.main import main; sys.exit(main())"


@dataclass
class OtherUser:
    uid: int
    base: Path  # the user's own folder, under one every uid can reach
    python: str  # a Python the user can run that imports this checkout
    prefix: list[str]  # what runs a program as the user

    @property
    def home(self) -> Path:
        return self.base / "home"

    def own(self, path: Path) -> None:
        """Give `path` (a tree the test made as root) to the user."""
        chown_tree(path, self.uid)

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The tests' environment, with the user's own home and cache."""
        return clean_env({"HOME": str(self.home), "XDG_CACHE_HOME": str(self.base / "xdg-cache"),
                          "PATH": f"{Path(self.python).parent}:{SYSTEM_PATH}", **(extra or {})})  # fmt: skip

    def run(self, root: Path, argv: list[str], env: Mapping[str, str] | None) -> Done:
        return subprocess.run([*self.prefix, self.python, *argv], cwd=root, env=self.env(env),
                              capture_output=True, text=True, timeout=120, check=False)  # fmt: skip

    def doit(self, root: Path, *args: str, env: Mapping[str, str] | None = None) -> Done:
        return self.run(root, ["-m", "doit", *args], env)

    def compute(self, root: Path, *args: str, env: Mapping[str, str] | None = None) -> Done:
        return self.run(root, ["-c", COMPUTE_MAIN, *args], env)


def _python_for(uid: int, base: Path, prefix: list[str]) -> str:
    """A venv of the system's Python whose path holds this interpreter's
    packages and the checkout (an editable install's), for a uid that cannot
    run this interpreter (pyenv's lives in root's closed home)."""
    if SYSTEM_PYTHON is None:
        pytest.skip("DOIT AS A USER WITHOUT ROOT NOT TESTED: no python3 in /usr/bin for that user to run")
    ask = "import sys; print(*sys.version_info[:2])"
    version = subprocess.run([SYSTEM_PYTHON, "-c", ask], capture_output=True, text=True, check=True,
                             timeout=30).stdout.split()  # fmt: skip
    ours = [str(n) for n in sys.version_info[:2]]
    if version != ours:
        pytest.skip(f"DOIT AS A USER WITHOUT ROOT NOT TESTED: {SYSTEM_PYTHON} is Python {'.'.join(version)}, "
                    f"the tests' Python {'.'.join(ours)}: its packages cannot be shared")  # fmt: skip
    venv = base / "venv"
    subprocess.run([SYSTEM_PYTHON, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    paths = dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], str(REPO)])
    ask = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = subprocess.run([str(venv / "bin" / "python"), "-c", ask], capture_output=True, text=True,
                          check=True, timeout=30).stdout.strip()  # fmt: skip
    Path(site, "substrax-tests.pth").write_text("".join(f"{p}\n" for p in paths))
    chown_tree(base, uid)
    probe = subprocess.run([*prefix, str(venv / "bin" / "python"), "-c", "import doit, substrax_tasks"],
                           capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    if probe.returncode != 0:
        pytest.skip(f"DOIT AS A USER WITHOUT ROOT NOT TESTED: uid {uid} cannot import this checkout's "
                    f"packages (a checkout in a closed folder such as /root?): "
                    f"{probe.stderr.strip()[-300:]}")  # fmt: skip
    return str(venv / "bin" / "python")


@pytest.fixture
def other_user() -> Iterator[OtherUser]:
    base = Path(tempfile.mkdtemp(prefix="substrax-user-"))
    base.chmod(0o755)
    try:
        if os.geteuid() != 0:
            made = OtherUser(os.geteuid(), base, sys.executable, [])
        else:
            if shutil.which("setpriv") is None:
                pytest.skip("DOIT AS A USER WITHOUT ROOT NOT TESTED: setpriv (util-linux) is not installed")
            uid = free_uid()
            prefix = ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            made = OtherUser(uid, base, _python_for(uid, base, prefix), prefix)
        made.home.mkdir()
        (base / "xdg-cache").mkdir()
        made.own(base)
        yield made
    finally:
        shutil.rmtree(base)
