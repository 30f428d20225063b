"""`sky.server.common.RequestId`: what the request calls return."""

from __future__ import annotations


class RequestId(str):
    """A request's id; `sky.get(request_id)` waits for its result."""

    __slots__ = ()
