"""Version-2 run handles, as the release before handle version 3 wrote them.

v2_handles/*.json are real handles written by that release (commit c276b79)
for a local, an ssh and a skypilot run (and a skypilot run cancelled on a
shared cluster): the shapes a version-3 release must still read.
`write_as_version_2` turns the handle of a run made by this release into
that shape, so that the CLI can be pointed at a v2 handle of a live run; it
checks the result against the fixture of the same backend.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

V2_HANDLES = Path(__file__).parent / "v2_handles"
# The files and the backend each is of.
V2_FIXTURES = {
    "local.json": "local",
    "ssh.json": "ssh",
    "skypilot.json": "skypilot",
    "skypilot-cancelled-on-a-shared-cluster.json": "skypilot",
}
UNSET: tuple[object, ...] = (None, 0, False, {}, [])
# Keys of the core's state a later release records for every run that the
# release before never wrote: a command's attempts (`preemptions`), the client id that launched it.
CORE_SINCE_VERSION_2 = ("attempts", "client_id")
# Keys a later release records that the release before did not, per backend,
# and what it recorded instead (None: nothing): the skypilot backend's lease
# job stands where its run's own SkyPilot job was.
# The machine a run held and its price (the core's `machine`, SkyPilot's
# `hourly_cost`) came later still, on every backend.
SINCE_VERSION_2: dict[str, dict[str, str | None]] = {
    "local": {"machine": None},
    "ssh": {"machine": None},
    "skypilot": {"lease_job": "job_id", "left_out": None, "outputs_root": None, "env_dir": None,
                 "machine": None, "hourly_cost": None},
}


def v2_fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((V2_HANDLES / name).read_text())
    assert data["version"] == 2
    return data


def write_as_version_2(path: Path) -> dict[str, Any]:
    """Rewrite the version-3 handle at `path` as the release before wrote it:
    one `state` holding the core's keys and the backend's, and only the keys
    that were set (that release wrote a key when it recorded it)."""
    data = json.loads(path.read_text())
    assert data["version"] == 3, data["version"]
    mixed = {**data.pop("state"), **data.pop("backend_state")}
    state = {
        key: value for key, value in mixed.items()
        if (value not in UNSET or key == "fetch_refusals") and key not in CORE_SINCE_VERSION_2
    }  # fmt: skip
    for key, then in SINCE_VERSION_2.get(data["backend"], {}).items():
        value = state.pop(key, None)
        if then is not None and value is not None:
            state[then] = value
    old = {**data, "version": 2, "state": state}
    # Only keys that release wrote for a run of this backend.
    written = v2_fixture(f"{data['backend']}.json")["state"]
    assert set(state) <= set(written), set(state) - set(written)
    path.write_text(json.dumps(old))
    return old
