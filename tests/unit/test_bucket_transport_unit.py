"""The unit half of tests/integration/transports/test_bucket_transport.py: the same subject, the
tests that start no process and open no connection (see its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest

from substrax_tasks.errors import BackendError
from substrax_tasks.transports.bucket import BucketTransport

# --------------------------------------------------------------- the fetch


# ----------------------------------------------------------- the manifest


# ------------------------------------------------------------------ errors


@pytest.mark.unit
def test_a_protocol_whose_package_is_missing_names_the_package() -> None:
    try:
        import gcsfs  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("gcsfs is installed here")
    with pytest.raises(BackendError, match=r"needs gcsfs, which is not installed: pip install gcsfs"):
        BucketTransport().read_manifest("gs://bucket/run/manifest.json")


@pytest.mark.parametrize(
    ("uri", "why"),
    [
        ("nosuch://bucket/run", "unknown protocol 'nosuch'"),
        ("bucket/run", "is not a bucket URI"),
    ],
)
@pytest.mark.unit
def test_not_a_bucket_uri(uri: str, why: str, tmp_path: Path) -> None:
    with pytest.raises(BackendError, match=why):
        BucketTransport().download(uri, ["out.txt"], tmp_path)


# ------------------------------------------------- broken copies, progress


