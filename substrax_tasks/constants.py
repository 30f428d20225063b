"""Names the whole package agrees on: the configuration table, the
environment variables it reads, what an environment's lock file needs.
A leaf: it imports nothing, so any layer may read it without importing the
layer that uses the name most (configuration, the key, the backends)."""

TABLE = "tool.substrax.compute"
SUBSTRAX_TABLES = ("compute",)  # what [tool.substrax] may hold
BACKEND_ENV = "SUBSTRAX_BACKEND"  # names the default backend
# A TOML file whose [tool.substrax.compute] is laid over the project's: for
# machine-specific settings (hosts, keys) kept out of the repository.
CONFIG_ENV = "SUBSTRAX_CONFIG"
# `off` turns the run cache off for one doit (nothing restored, nothing kept),
# whatever [tool.substrax.compute.cache] says: `make remote-run` uses it.
CACHE_ENV = "SUBSTRAX_CACHE"
# The lock files themselves are remote/env.py's LOCK_FILES (that recipe
# builds the environment on every machine). What a lock is read with:
# `uv sync --frozen` reads uv.lock only beside the project's pyproject.toml,
# so a run's view holds it too, and the key covers it.
LOCK_COMPANIONS = {"uv.lock": ("pyproject.toml",)}
CACHE_FOLDER = "substrax"  # the private folder of the cached resolutions
# What a no-op's check knows of a backend without importing anything of
# the backends (a no-op imports none: tests/integration/chain/test_proofs.py):
# the backends whose command runs on
# this machine, its program found on this process's PATH
# (backends/local/program.py), so that the Python it names is part of the
# step's key (uptodate/interpreter.py). Elsewhere the host's PATH decides.
PROGRAM_FOUND_HERE = frozenset({"local"})
