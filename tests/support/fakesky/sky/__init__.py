"""A fake `sky` (SkyPilot 0.14.1's public SDK) for tests: what
skypilot/helper/sky_sdk.py uses, with the real signatures, run on this machine.

Clusters are folders under $HOME/.fakesky/clusters/, jobs real local
processes (`bash -c` of setup then run), requests detached processes that
outlive their client. Nothing leaves the machine. Settings, from the
environment of the process that makes the call:

    FAKESKY_LAUNCH_DELAY     seconds a fresh cluster takes to provision (0)
    FAKESKY_MINUTE_SECONDS   how long an autostop "minute" lasts (60)
    FAKESKY_CANCEL_GRACE     seconds between SIGTERM and SIGKILL on cancel (3)
    FAKESKY_JOB_END_DELAY    seconds a job still reads RUNNING after its run exited (0)
    FAKESKY_JOB_END_GATE     a path: a job reads RUNNING after its run exited until it exists
    FAKESKY_QUEUE_JOBS       1: a job waits PENDING until the cluster's earlier jobs ended
                             (as one that takes the whole cluster); 0: jobs run at once (0)
    FAKESKY_BUCKET_DIR       folder standing in for buckets (<dir>/<bucket>/<path>);
                             without it, MOUNT / MOUNT_CACHED / COPY of buckets
                             fail with NotSupportedError
    FAKESKY_SSH_HOST, FAKESKY_SSH_PORT, FAKESKY_SSH_USER, FAKESKY_SSH_IDENTITY
                             the host written to ~/.sky/generated/ssh/<cluster>
                             (none written without FAKESKY_SSH_HOST)

`sky._fake_cleanup(home)` stops, by pid, every process the fake started
under that HOME (tests call it from a fixture finalizer).
"""

from sky import clouds, exceptions
from sky._client import (
    api_cancel,
    api_status,
    autostop,
    cancel,
    down,
    exec,
    get,
    job_status,
    launch,
    queue,
    status,
    stream_and_get,
    tail_logs,
)
from sky._state import cleanup as _fake_cleanup
from sky._types import ClusterStatus, JobStatus, OptimizeTarget, StatusRefreshMode
from sky.clouds import (
    AWS,
    GCP,
    IBM,
    OCI,
    SCP,
    SSH,
    Azure,
    Cudo,
    Fluidstack,
    Hyperbolic,
    Kubernetes,
    Lambda,
    Mithril,
    Nebius,
    Paperspace,
    PrimeIntellect,
    RunPod,
    Seeweb,
    Shadeform,
    Slurm,
    Vast,
    Verda,
    Vsphere,
    Yotta,
)
from sky.task import Resources, Task

__version__ = "0.14.1+fakesky"

__all__ = [
    "AWS", "GCP", "IBM", "OCI", "SCP", "SSH", "Azure", "ClusterStatus", "Cudo", "Fluidstack",
    "Hyperbolic", "JobStatus", "Kubernetes", "Lambda", "Mithril", "Nebius", "OptimizeTarget",
    "Paperspace", "PrimeIntellect", "Resources", "RunPod", "Seeweb", "Shadeform", "Slurm",
    "StatusRefreshMode", "Task", "Vast", "Verda", "Vsphere", "Yotta", "_fake_cleanup", "api_cancel",
    "api_status", "autostop", "cancel", "clouds", "down", "exceptions", "exec", "get", "job_status", "launch",
    "queue", "status", "stream_and_get", "tail_logs",
]  # fmt: skip
