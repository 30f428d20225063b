"""`[tool.substrax.compute.backends.skypilot]`: judged when the configuration
is read, before SkyPilot is started or anything is launched."""

from __future__ import annotations

from pathlib import Path

import pytest
from local_runs import cli
from skypilot_config_parts import COPY, TABLE, write

from substrax_tasks.config.pyproject import load_config
from substrax_tasks.errors import ConfigError

BUCKET = "[tool.substrax.compute.backends.skypilot.bucket]"

# (id, the skypilot tables, fragments the message must hold)
BAD = [
    ("no-transport", f'{TABLE}\ninfra = "aws"\n', ["no transport", COPY, BUCKET]),
    (
        "both-transports",
        f'{TABLE}\ninfra = "aws"\n{COPY}\n{BUCKET}\noutputs_bucket = "s3://b"\n',
        ["both", COPY, BUCKET, "keep exactly one"],
    ),
    (
        "writable-copy-mount",
        f'{TABLE}\ninfra = "aws"\n{COPY}\nsources = [{{path = "data", mode = "MOUNT"}}]\n',
        ["'MOUNT' is a writable mount", "read-only", "bucket"],
    ),
    (
        "bucket-as-copy-source",
        f'{TABLE}\n{COPY}\nsources = ["s3://data"]\n',
        ["is a bucket", "buckets = {"],
    ),
    (
        "source-outside-project",
        f'{TABLE}\n{COPY}\nsources = ["../elsewhere"]\n',
        ["inside the project"],
    ),
    (
        "reuse-with-bucket",
        f'{TABLE}\nreuse = true\n{BUCKET}\noutputs_bucket = "s3://b"\n',
        ["reuse = true needs the copy transport", COPY, "set reuse = false"],
    ),
    (
        "reuse-without-autodown",
        f'{TABLE}\ninfra = "hyperbolic"\nreuse = true\n{COPY}\n',
        ["reuse = true needs", "down when idle", "hyperbolic"],
    ),
    (
        "max-parallel-zero",
        f"{TABLE}\nmax_parallel = 0\n{COPY}\n",
        ["skypilot.max_parallel = 0", "greater than or equal to 1"],
    ),
    (
        "bucket-on-runpod",
        f'{TABLE}\ninfra = "runpod"\n{BUCKET}\noutputs_bucket = "s3://b"\n',
        ["infra = 'runpod' cannot mount buckets", "copy transport", COPY],
    ),
    (
        "bucket-on-vast",
        f'{TABLE}\ninfra = "vast/us"\n{BUCKET}\noutputs_bucket = "s3://b"\n',
        ["infra = 'vast/us' cannot mount buckets", "copy transport"],
    ),
    (
        "bucket-not-a-uri",
        f'{TABLE}\n{BUCKET}\noutputs_bucket = "my-bucket"\n',
        ["not a bucket URI", "s3://bucket"],
    ),
    ("two-disk-sizes", f"{TABLE}\ndisk_size = 100\n{COPY}\ndisk_size = 50\n", ["disk_size", "give one"]),
    (
        "unknown-key",
        f"{TABLE}\naccelerator = 'H100:1'\n{COPY}\n",
        ["unknown key 'accelerator'", "valid keys:", "accelerators"],
    ),
    ("unknown-copy-key", f"{TABLE}\n{COPY}\nsource = []\n", ["unknown key 'source'", "sources"]),
    (
        "lifetime-within-autodown",
        f"{TABLE}\n{COPY}\nlifetime_minutes = 1\n",
        ["lifetime_minutes = 1 must be more than 1", "SkyPilot's autodown"],
    ),
    ("bad-prefix", f'{TABLE}\ncluster_prefix = "My_Runs"\n{COPY}\n', ["cluster_prefix", "lower-case"]),
    (
        "isolation-without-sandbox",
        f'{TABLE}\nsandbox = "none"\n{COPY}\nnetwork_isolation = true\n',
        ["network_isolation = true needs the sandbox"],
    ),
]


@pytest.mark.parametrize(("tables", "fragments"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_a_bad_skypilot_table_is_refused_with_a_message_naming_it(
    tmp_path: Path, tables: str, fragments: list[str]
) -> None:
    root = write(tmp_path / "p", tables)
    with pytest.raises(ConfigError) as caught:
        load_config(root)
    for fragment in fragments:
        assert fragment in str(caught.value), str(caught.value)
    # The CLI says the same and exits 1 (status reports on the configuration too).
    result = cli(root, "status")
    assert result.returncode == 1
    assert fragments[0] in result.stderr


