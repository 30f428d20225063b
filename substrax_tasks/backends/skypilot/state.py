"""What the SkyPilot backend keeps in a run's handle."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from substrax_tasks.backends.state import RemoteState


class SkypilotState(RemoteState):
    cluster: str | None = None  # the cluster it runs on: set once launched (or given a warm one)
    lease_job: int | None = None  # the cluster's one SkyPilot job: its lease (remote/lease.py)
    remote_run: str | None = None  # the run's folder on the cluster
    bin_digest: str | None = None  # of the worker scripts the cluster was given
    job_home: str | None = None  # the home the lease's SkyPilot job runs in, once learnt
    env_dir: str | None = None  # the environment built there (env.py)
    left_out: list[str] = Field(default_factory=list)  # what the project's view left out
    outputs_root: str | None = None  # where its outputs are there, from its final status
    gpus: Any = None  # what the job is given of the cluster's GPUs (backends/gpus.py)
    cancel_requested: bool = False  # a cancel was asked (the cluster going then reads as cancelled)
    # This attempt's cluster is on demand though use_spot = true: the last
    # relaunch preemptions= allow, with on_demand_last_attempt = true.
    on_demand: bool = False
    hourly_cost: float | None = None  # the catalog's price of the cluster as launched (None: unknown)
    # A SkyPilot job per run, by releases before the lease: read in their
    # handles, never written now (launched_job reads either).
    job_id: int | None = None

    @property
    def launched_job(self) -> int | None:
        """The SkyPilot job the run's cluster was launched with: its lease,
        or, in a handle of a release before the lease, the run's own job
        (its worker's record is read the same way)."""
        return self.lease_job if self.lease_job is not None else self.job_id
