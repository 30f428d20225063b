"""The bucket transport against a real S3 server (`rclone serve s3`, which
checks signatures): the run folder a worker leaves in the bucket, its
manifest, and what a fetch does when the bucket is not as the manifest says.
What every transport must do is in test_transport_contract.py.
"""

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


