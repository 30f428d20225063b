"""What the SkyPilot backend keeps in a run's handle."""

from __future__ import annotations

from substrax_tasks.backends.state import RemoteState


class SkypilotState(RemoteState):
    cluster: str | None = None  # the cluster it runs on: set once launched (or queued on a warm one)
    remote_run: str | None = None  # the run's folder on the cluster
    bin_digest: str | None = None  # of the worker scripts the cluster was given
    job_home: str | None = None  # the home its SkyPilot job runs in, once learnt
    job_id: int | None = None  # its SkyPilot job
    cancel_requested: bool = False  # a cancel was asked (the job's end then reads as cancelled)
