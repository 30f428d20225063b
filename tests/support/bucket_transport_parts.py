"""What the two halves of one set of tests share: the integration tests
(tests/integration/transports/test_bucket_transport.py)
and the unit tests (tests/unit/test_bucket_transport_unit.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from substrax_tasks.transports.bucket import BucketTransport

OUTPUTS = ["model.bin", "reports/", "logs/", "never.txt"]


def fetch(transport: BucketTransport, run: str, staging: Path) -> dict[str, Any]:
    """What the SkyPilot backend's bucket fetch does."""
    return transport.fetch_run(run, OUTPUTS, staging)
