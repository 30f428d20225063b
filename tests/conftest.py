"""The tests' shared parts are plugins of tests/support/ (on sys.path through pytest's `pythonpath`):
progress (deadlines that follow a run's progress; first, as local_runs imports it), local_runs (real
processes and runs of this machine), unit_tier (the unit tier's guard), s3_server (a real S3 server),
ssh_helpers (a real sshd), sandbox_beds (a second uid, escape probes), sky_beds (the fake SkyPilot's
project and its cluster host), file_order (the longest test files first)."""

pytest_plugins = (
    "progress", "local_runs", "unit_tier", "s3_server", "ssh_helpers", "sandbox_beds", "sky_beds",
    "other_user", "file_order",
)  # fmt: skip
