"""Where a run executes: the contract (base.py, settings.py), the registry of
backends by name (registry.py), what they share (job.py, scripts.py,
remote_run.py, gpus.py), and one package per backend (local/, ssh/, skypilot/)."""
