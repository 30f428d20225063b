#!/usr/bin/env bash
# `make remote-run`: run the example's remote step (`doit fit`) on the
# configured backend or, when no remote is configured, on a throwaway SSH
# host started here and stopped afterwards (even when the step fails).
#
# No remote is configured when SUBSTRAX_CONFIG is unset and either
#   - SUBSTRAX_BACKEND is unset and pyproject.toml's default_backend is "local", or
#   - the backend (SUBSTRAX_BACKEND, else default_backend) is "ssh" and
#     pyproject.toml has no [tool.substrax.compute.backends.ssh] table.
# Then tests/support/testbeds/sshd_host.py starts an sshd (as root: in a network
# namespace of its own, logging in as a user it creates and removes again;
# otherwise on 127.0.0.1 as you), a TOML overlay with its settings is
# written, and `SUBSTRAX_CONFIG=<overlay> SUBSTRAX_BACKEND=ssh doit fit` runs
# after `doit forget fit`, so the remote path really runs. Otherwise `doit
# fit` runs as configured (it reruns only what changed).
# Either way the run cache is off for that doit (SUBSTRAX_CACHE=off): a step
# another run made (`make demo`, locally) is run on the host, not restored.
#
# Environment: BIN (the venv's bin, default .venv/bin), REMOTE_RUN_TASK
# (default fit), REMOTE_RUN_USER (the login user as root, default sxdemo).
set -euo pipefail

BIN=${BIN:-.venv/bin}
TASK=${REMOTE_RUN_TASK:-fit}
LOGIN=${REMOTE_RUN_USER:-sxdemo}
TESTBED=tests/support/testbeds/sshd_host.py

mode=$("$BIN/python" - <<'EOF'
import os
import sys

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

with open("pyproject.toml", "rb") as f:
    table = tomllib.load(f).get("tool", {}).get("substrax", {}).get("compute", {})
chosen = os.environ.get("SUBSTRAX_BACKEND") or ""
backend = chosen or table.get("default_backend", "local")
has_ssh = isinstance(table.get("backends", {}).get("ssh"), dict)
if os.environ.get("SUBSTRAX_CONFIG"):
    print("configured")
elif (not chosen and backend == "local") or (backend == "ssh" and not has_ssh):
    print("throwaway")
else:
    print("configured")
EOF
)

# Neither restored from the cache nor kept in it: this shows the remote path.
export SUBSTRAX_CACHE=off
cache_note="==> the run cache is off for this run (SUBSTRAX_CACHE=off): $TASK runs on the host whatever the cache holds"

if [ "$mode" = configured ]; then
  echo "==> backend: ${SUBSTRAX_BACKEND:-as configured in pyproject.toml}${SUBSTRAX_CONFIG:+ (overlay $SUBSTRAX_CONFIG)}"
  echo "    (\`$BIN/doit forget $TASK\` first to force a rerun)"
  echo "$cache_note"
  exec "$BIN/doit" "$TASK"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/substrax-remote-run.XXXXXX")
started=no

# Stops the host whatever ends the script: success, failure, Ctrl-C,
# SIGTERM, a closed terminal (HUP) or a closed pipe (`| head`). It must not
# itself die on the broken pipe, or stop half-way on a failed echo.
finish() {
  local code=$?
  set +e
  trap '' PIPE HUP INT TERM
  trap - EXIT
  if [ "$started" = yes ] || [ -e "$work/host/host.json" ]; then
    echo "==> stopping the throwaway SSH host" >&2
    if ! "$BIN/python" "$TESTBED" stop --dir "$work/host"; then
      echo "remote-run: could not stop the throwaway SSH host; its record is in $work/host" >&2
      [ "$code" -ne 0 ] || code=1
      exit "$code"
    fi
  fi
  rm -rf "$work"
  exit "$code"
}
trap finish EXIT
trap 'exit 129' HUP
trap 'exit 130' INT
trap 'exit 141' PIPE
trap 'exit 143' TERM

if [ "$(id -u)" = 0 ]; then
  where="in a network namespace, logging in as $LOGIN"
  start_args=(--user "$LOGIN")
else
  where="on 127.0.0.1, logging in as $(id -un)"
  start_args=(--no-netns)
fi
echo "==> no remote configured: starting a throwaway SSH host ($where)"
started=yes
"$BIN/python" "$TESTBED" start --dir "$work/host" "${start_args[@]}" >/dev/null

# The example runs `python3` from the remote PATH inside the sandbox, which
# hides the login's home: if every python3 on that PATH lives in the home
# (pyenv shims, ~/.local/bin, a conda in it), the sandboxed command finds
# none. Then, on this throwaway host only, the step runs without the
# sandbox, and says so. (A python3 outside the home, such as
# /usr/bin/python3, is found inside the sandbox even when PATH lists a
# shim in the home first, as for root here.)
"$BIN/python" "$TESTBED" ssh-config --dir "$work/host" >"$work/ssh_config"
host_alias=$("$BIN/python" "$TESTBED" get --dir "$work/host" name)
# shellcheck disable=SC2016 # expanded on the host
probe='first=$(command -v python3); outside=
IFS=:; for d in $PATH; do case "$d" in "$HOME"|"$HOME"/*) continue;; esac
  if [ -x "$d/python3" ]; then outside=$d/python3; break; fi; done
printf "%s\n%s\n" "$first" "$outside"'
found=$(ssh -F "$work/ssh_config" "$host_alias" "$probe" </dev/null)
first_python3=$(printf '%s\n' "$found" | sed -n 1p)
outside_python3=$(printf '%s\n' "$found" | sed -n 2p)
sandbox=auto
if [ -n "$first_python3" ] && [ -z "$outside_python3" ]; then
  sandbox=none
  echo "==> note: the host's only python3 on PATH is $first_python3, in the login's home, which the" \
    "sandbox hides; running this throwaway step with sandbox = \"none\"" >&2
fi

overlay="$work/substrax-remote-run.toml"
SANDBOX=$sandbox "$BIN/python" - "$work/host/host.json" "$overlay" <<'EOF'
import json
import os
import sys

host = json.load(open(sys.argv[1]))
settings = {
    "host": host["address"],
    "port": host["port"],
    "user": host["user"],
    "identity_file": host["client_key"],
    "known_hosts": host["known_hosts"],
    "remote_root": host["scratch"] + "/remote",
    "python": "/usr/bin/python3",
    "lifetime_minutes": 30.0,
    "sandbox": os.environ["SANDBOX"],
}
lines = [
    "# written by scripts/remote_run.sh for a throwaway SSH host; removed with it",
    "[tool.substrax.compute]",
    'default_backend = "ssh"',
    "",
    "[tool.substrax.compute.backends.ssh]",
    # JSON strings and numbers are valid TOML values
    *(f"{key} = {json.dumps(value)}" for key, value in settings.items()),
]
with open(sys.argv[2], "w") as f:
    f.write("\n".join(lines) + "\n")
print(f"==> backend: ssh to {host['user']}@{host['address']} port {host['port']} (SUBSTRAX_CONFIG={sys.argv[2]})")
EOF

export SUBSTRAX_CONFIG="$overlay" SUBSTRAX_BACKEND=ssh
echo "$cache_note"
"$BIN/doit" forget "$TASK"
"$BIN/doit" "$TASK"
