"""The skypilot backend end to end, on the real one-node Slurm cluster of
the test bed: the real `doit` with a dodo.py that uses remote_step, the real
`substrax-compute`, SkyPilot 0.14 behind them (its local API server, its
Slurm provisioner, its ssh proxy into the job), the copy transport, and
bubblewrap on the cluster.

Each test's clusters carry its own prefix (`cluster_prefix`); whatever the
test's outcome, its finalizer stops the processes it started (by pid),
cancels a launch request still in flight and takes down, through
SkyClient, every cluster named with that prefix. The cluster runs on this
machine, as the bed's user: Slurm's queue (squeue) and /proc show what is
left on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import signal
import subprocess
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dodo_helpers import (
    BIN,
    COMPUTE,
    DOIT,
    HEADER,
    REPO,
    clean_env,
    handles,
    run_count,
    show,
    step_ran,
    step_skipped,
)
from local_runs import marked_pids

from e2e.conftest import SlurmBedInfo
from substrax_tasks.backends.skypilot.client import SkyClient
from substrax_tasks.errors import SubstraxError

# A launch is ~1 min on this machine (several on a fresh bed: the cluster's
# first runtime install), a lifetime test ~5; the session's bed set-up
# counts towards the first test.
pytestmark = pytest.mark.timeout(1200)
LAUNCH_TIMEOUT = 900.0  # from `doit` to the command running (or the whole chain)
CALL_TIMEOUT = 600.0  # one SkyPilot call, a `down` included
GONE_TIMEOUT = 420.0  # lifetime_minutes = 3 and idle_minutes = 1: each wait ends within ~3 min
SETTLE_TIMEOUT = 60.0  # a Slurm job cancelled, or its processes killed, a moment ago
POLL = 2.0


# ------------------------------------------------------------------ helpers


def wait_for(condition: Callable[[], object], what: str, timeout: float, every: float = POLL) -> float:
    """Seconds until `condition` held; fails the test after `timeout`."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout:
            pytest.fail(f"waited {timeout:.0f} s for {what}", pytrace=False)
        time.sleep(every)
    return time.monotonic() - started


def slurm_jobs(bed: SlurmBedInfo) -> list[tuple[str, str, str]]:
    """The cluster user's Slurm jobs: (id, name, state). SkyPilot's cluster
    `c` is the job `c-<user hash>`."""
    done = subprocess.run(
        ["squeue", "-h", f"--user={bed.user.name}", "-o", "%i|%j|%T"],
        env={"PATH": "/usr/bin:/bin", "SLURM_CONF": str(bed.slurm_conf)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [tuple(line.split("|", 2)) for line in done.stdout.split()]  # type: ignore[misc]


def jobs_named(bed: SlurmBedInfo, prefix: str) -> list[tuple[str, str, str]]:
    return [job for job in slurm_jobs(bed) if job[1].startswith(f"{prefix}-")]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def api_requests(bed: SlurmBedInfo) -> list[str]:
    """Ids of every request users made to the bed's API server (its own
    daemons, user `skypilot-system`, left out)."""
    script = (
        "import json, sky\n"
        "rs = [r.model_dump() if hasattr(r, 'model_dump') else dict(r) "
        "for r in sky.api_status(all_status=True)]\n"
        "print(json.dumps([r['request_id'] for r in rs if r.get('user_name') != 'skypilot-system']))\n"
    )
    done = subprocess.run(
        [str(bed.sky_python), "-c", script], env=bed.env, capture_output=True, text=True,
        timeout=CALL_TIMEOUT, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    ids: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return ids


def report(request: pytest.FixtureRequest, name: str, timings: dict[str, float]) -> None:
    rounded = {k: round(v, 1) for k, v in timings.items()}
    reporter: Any = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"\n[e2e] {name} timings (s): {json.dumps(rounded)}")


# ------------------------------------------------------------------ projects

ONE_STEP = """
COMMAND = {command!r}


def task_step():
    yield from remote_step("step", shell=COMMAND, inputs=["data/in.txt"], outputs=["out/"])
"""


class SkyProject:
    """A project on the skypilot backend (copy transport) pointed at the
    bed, run with the bed's SkyPilot environment; its clusters are named
    `<prefix>-<step>-<6 hex>`."""

    def __init__(self, bed: SlurmBedInfo, root: Path, prefix: str) -> None:
        self.bed = bed
        self.root = root
        self.prefix = prefix
        self.sky = SkyClient(str(bed.sky_python), env=bed.env)
        # As a user with the project's venv active: HOME is SkyPilot's (its
        # ~/.sky, the API server's port), `doit` and python3 come first.
        self.env = clean_env(bed.env)
        self.env["PATH"] = f"{BIN}:{bed.env['PATH']}"
        # The setup commands leave their mark in the cluster user's own home
        # (outside the cluster's, which `down` removes), seen here.
        self.setup_marks = bed.user.home / f"setup-{prefix}.txt"
        self.procs: list[subprocess.Popen[str]] = []

    def configure(self, *, lifetime_minutes: float = 15, idle_minutes: int = 2, **settings: Any) -> None:
        values: dict[str, Any] = {
            "infra": self.bed.infra,
            "cpus": 1,  # 2 CPUs here: room for a second cluster
            "sky_python": str(self.bed.sky_python),
            "cluster_prefix": self.prefix,
            "sandbox": "bwrap",
            "idle_minutes": idle_minutes,
            "poll_seconds": 3,
            "setup_commands": [
                "echo setting up the node",
                f"command -v bwrap >> {self.setup_marks}",
                f'echo "setup ran in $HOME" >> {self.setup_marks}',
            ],
        }
        values.update(settings)
        lines = ["[tool.substrax.compute]", 'default_backend = "skypilot"', "",
                 "[tool.substrax.compute.backends.skypilot]"]  # fmt: skip
        lines += [f"{key} = {json.dumps(value)}" for key, value in values.items()]
        lines += ["", "[tool.substrax.compute.backends.skypilot.copy]",
                  f"lifetime_minutes = {lifetime_minutes}", "network_isolation = true"]  # fmt: skip
        (self.root / "pyproject.toml").write_text("\n".join(lines) + "\n")

    def one_step(self, command: str, **settings: Any) -> None:
        self.configure(**settings)
        config = 'DOIT_CONFIG = doit_config(default_tasks=["step"])\n'
        body = textwrap.dedent(ONE_STEP.format(command=command))
        (self.root / "dodo.py").write_text(HEADER + config + body)
        (self.root / "data").mkdir(exist_ok=True)
        (self.root / "data" / "in.txt").write_text("hello\n")

    # -- running it
    def doit(self, *args: str, timeout: float = LAUNCH_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(DOIT), *args], cwd=self.root, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def popen_doit(self) -> subprocess.Popen[str]:
        with (self.root.parent / "doit.out").open("w") as out:
            proc = subprocess.Popen(
                [str(DOIT)], cwd=self.root, env=self.env, stdout=out, stderr=subprocess.STDOUT, text=True
            )
        self.procs.append(proc)
        return proc

    def output(self) -> str:
        path = self.root.parent / "doit.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def compute(self, *args: str, timeout: float = CALL_TIMEOUT) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(COMPUTE), "--project", str(self.root), *args], cwd=self.root, env=self.env,
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def status(self, run_id: str) -> dict[str, Any]:
        done = self.compute("status", run_id, "--json")
        assert done.returncode == 0, show(done)
        record: dict[str, Any] = json.loads(done.stdout)["runs"][0]
        return record

    def handle(self) -> dict[str, Any]:
        found = handles(self.root)
        assert len(found) == 1, [h["run_id"] for h in found]
        return found[0]

    def run_file(self, handle: dict[str, Any], name: str) -> Path:
        return self.root / ".substrax" / "runs" / str(handle["run_id"]) / name

    # -- SkyPilot, through substrax's own helper
    def clusters(self) -> list[str]:
        """This project's clusters SkyPilot knows of, in any state."""
        records = self.sky.call("cluster_status", {}, timeout=CALL_TIMEOUT)
        return sorted(str(r["name"]) for r in records if str(r["name"]).startswith(f"{self.prefix}-"))

    def cluster_gone(self, cluster: str) -> bool:
        """SkyPilot knows no such cluster, and Slurm runs no job of it."""
        records = self.sky.call("cluster_status", {"cluster_names": [cluster]}, timeout=CALL_TIMEOUT)
        return records == [] and not [job for job in slurm_jobs(self.bed) if job[1].startswith(f"{cluster}-")]

    def assert_gone(self, cluster: str) -> None:
        """Taken down: SkyPilot's record is gone as soon as its `down` is
        done; Slurm may list the cancelled job (COMPLETING) while slurmd
        kills its processes."""
        records = self.sky.call("cluster_status", {"cluster_names": [cluster]}, timeout=CALL_TIMEOUT)
        assert records == [], records
        wait_for(lambda: self.cluster_gone(cluster), f"Slurm to end the job of {cluster}", SETTLE_TIMEOUT)

    def assert_nothing_runs(self, marker: str | None = None) -> None:
        """No Slurm job of the cluster user's at all, and no process of the
        command (its argv carries `marker`) left on the node."""
        wait_for(lambda: slurm_jobs(self.bed) == [], "the cluster user's Slurm jobs to end", SETTLE_TIMEOUT)
        if marker is not None:
            wait_for(lambda: marked_pids(marker) == [], "the command's processes to end", SETTLE_TIMEOUT)

    def request_state(self, request_id: str) -> str | None:
        records = self.sky.call("request_status", {"request_ids": [request_id]}, timeout=CALL_TIMEOUT)
        return next((str(r["status"]) for r in records if r["request_id"] == request_id), None)

    def cleanup(self) -> list[str]:
        """Stop what this project started; returns what could not be stopped."""
        problems: list[str] = []
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        for path in (self.root / ".substrax" / "runs").glob("*/launch-request.json"):
            with contextlib.suppress(Exception):
                rid = json.loads(path.read_text())["request_id"]
                if self.request_state(rid) in ("PENDING", "WAITING", "RUNNING"):
                    self.sky.call("api_cancel", {"request_ids": [rid]}, timeout=CALL_TIMEOUT)
        try:
            for cluster in self.clusters():
                self.sky.call("down", {"cluster_name": cluster}, timeout=CALL_TIMEOUT)
            left = self.clusters()
        except SubstraxError as exc:
            left = [f"? ({exc})"]
        if left:
            problems.append(f"clusters left: {left}")
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while (jobs := jobs_named(self.bed, self.prefix)) and time.monotonic() < deadline:
            time.sleep(1)
        if jobs:  # an allocation SkyPilot lost track of: ended here, by its id, and reported
            problems.append(f"Slurm jobs left: {jobs}")
            subprocess.run(["scancel", *(job[0] for job in jobs)], env=self.bed.bed.slurm_env(),
                           capture_output=True, timeout=60, check=False)  # fmt: skip
        self.setup_marks.unlink(missing_ok=True)
        return problems


@contextlib.contextmanager
def sky_project(bed: SlurmBedInfo, base: Path, prefix: str) -> Iterator[SkyProject]:
    """A project whose clusters are all taken down at the end, whatever happened."""
    root = base / "proj"
    root.mkdir(parents=True)
    project = SkyProject(bed, root, f"{prefix}{secrets.token_hex(2)}")
    try:
        yield project
    finally:
        problems = project.cleanup()
    assert not problems, f"{prefix}: left behind: {problems}"


@pytest.fixture
def project_factory(slurm_bed: SlurmBedInfo, tmp_path: Path) -> Iterator[Callable[[str], SkyProject]]:
    with contextlib.ExitStack() as stack:
        counter = iter(range(100))

        def make(prefix: str) -> SkyProject:
            return stack.enter_context(sky_project(slurm_bed, tmp_path / f"p{next(counter)}", prefix))

        yield make


# ------------------------------------------------------ the example pipeline


class ExampleRun:
    def __init__(self, project: SkyProject, done: subprocess.CompletedProcess[str], seconds: float) -> None:
        self.project = project
        self.done = done
        self.seconds = seconds


@pytest.fixture(scope="module")
def example(slurm_bed: SlurmBedInfo, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExampleRun]:
    """The repository's example (dodo.py: data here -> fit on the backend ->
    report here, with scripts/) as a project of its own on the skypilot
    backend, run once: shared by the tests that look at that run."""
    with sky_project(slurm_bed, tmp_path_factory.mktemp("example"), "sxe-ex") as project:
        root = project.root
        (root / "dodo.py").write_text((REPO / "dodo.py").read_text())
        for script in sorted((REPO / "scripts").glob("*.py")):
            (root / "scripts").mkdir(exist_ok=True)
            (root / "scripts" / script.name).write_text(script.read_text())
        project.configure()
        started = time.monotonic()
        done = project.doit()
        yield ExampleRun(project, done, time.monotonic() - started)


def test_the_example_runs_its_remote_step_on_the_cluster_then_the_cluster_is_gone(
    example: ExampleRun, request: pytest.FixtureRequest
) -> None:
    project, done = example.project, example.done
    root = project.root
    assert done.returncode == 0, show(done)
    for task in ("data", "fit", "report"):
        assert step_ran(done, task), show(done)
    handle = project.handle()
    cluster = handle["backend_state"]["cluster"]
    assert cluster.startswith(f"{project.prefix}-fit-")
    assert f"launching cluster {cluster}" in done.stdout
    # setup_commands ran on the node, in the cluster's own home, bubblewrap there
    marks = project.setup_marks.read_text().splitlines()
    assert marks[0].endswith("/bwrap"), marks
    assert marks[1].startswith(f"setup ran in {project.bed.user.home}/.sky_clusters/{cluster}-"), marks
    # the command's log, streamed over ssh into the job; it ran under
    # bubblewrap (sandbox = "bwrap" runs nothing without it; the failing
    # test below shows the sandbox from inside)
    assert "fitted y = " in done.stdout, show(done)
    # fetched and verified against the cluster's manifest, then promoted
    manifest = json.loads(project.run_file(handle, "manifest.json").read_text())
    entries = {e["path"]: e for e in manifest["entries"]}
    assert sorted(entries) == ["demo-data/model/coef.json", "demo-data/model/metrics.json"]
    for path, entry in entries.items():
        assert sha256(root / path) == entry["sha256"], path
    assert manifest["missing"] == []
    coef = json.loads((root / "demo-data" / "model" / "coef.json").read_text())
    assert abs(coef["slope"] - 3) < 0.1 and abs(coef["intercept"] - 2) < 0.1
    assert "points: 2000" in (root / "demo-data" / "report.md").read_text()
    assert handle["state"]["phase"] == "promoted" and handle["backend_state"]["torn_down"] is True
    # the intent and SkyPilot's request id beside the handle
    task = json.loads(project.run_file(handle, "task.json").read_text())
    assert task["resources"] == {"cpus": 1, "infra": project.bed.infra}
    launch = json.loads(project.run_file(handle, "launch-request.json").read_text())
    assert project.request_state(launch["request_id"]) == "SUCCEEDED"
    # torn down: SkyPilot knows no such cluster, Slurm runs no job of it
    project.assert_gone(cluster)
    project.assert_nothing_runs()
    assert not (project.bed.client_home / ".sky" / "generated" / "ssh" / cluster).exists()
    status = project.status(handle["run_id"])
    assert (status["state"], status["exit_code"]) == ("succeeded", 0)
    logs = project.compute("logs", handle["run_id"])
    assert logs.returncode == 0 and "fitted y = " in logs.stdout, show(logs)
    report(request, "example", {"doit": example.seconds})


def test_a_noop_rerun_asks_skypilot_nothing(example: ExampleRun, request: pytest.FixtureRequest) -> None:
    project = example.project
    assert example.done.returncode == 0, "the first run failed: see the test above"
    asked = api_requests(project.bed)
    runs = run_count(project.root)
    started = time.monotonic()
    again = project.doit(timeout=120)
    seconds = time.monotonic() - started
    assert again.returncode == 0, show(again)
    for task in ("data", "fit", "report"):
        assert step_skipped(again, task), show(again)
    assert not any(line.startswith(".  ") for line in again.stdout.splitlines()), show(again)
    assert run_count(project.root) == runs
    assert api_requests(project.bed) == asked  # not even a status request
    assert project.clusters() == []
    # a loose bound (the request list above is the proof): one SkyPilot call
    # imports sky, ~3 s here, and a look at the cluster would need several
    assert seconds < 20, f"a no-op took {seconds:.1f} s"
    report(request, "noop", {"doit": seconds})


# ---------------------------------------------------------------- one step


def test_a_failing_command_reads_as_failed_with_its_log_and_the_cluster_goes(
    project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    """The command's log also shows the sandbox it ran in: only `lo` (no
    network), the project read-only."""
    project = project_factory("sxe-fail")
    project.one_step(
        "echo net: $(tail -n +3 /proc/net/dev | cut -d: -f1); "  # this namespace's interfaces
        "if touch data/in.txt 2>/dev/null; then echo project writable; else echo project read-only; fi; "
        "echo about to fail; exit 7"
    )
    started = time.monotonic()
    done = project.doit()
    seconds = time.monotonic() - started
    assert done.returncode != 0, show(done)
    said = done.stdout + done.stderr
    assert "about to fail" in said and "failed" in said, show(done)
    handle = project.handle()
    record = project.status(handle["run_id"])
    assert (record["state"], record["exit_code"]) == ("failed", 7), record
    logs = project.compute("logs", handle["run_id"])
    assert logs.returncode == 0, show(logs)
    assert "net: lo\n" in logs.stdout and "project read-only\n" in logs.stdout, logs.stdout
    assert "about to fail\n" in logs.stdout
    assert not (project.root / "out").exists()
    project.assert_gone(handle["backend_state"]["cluster"])
    project.assert_nothing_runs()
    report(request, "failing", {"doit": seconds})


def test_cancel_mid_run_stops_the_job_and_takes_the_cluster_down(
    project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    project = project_factory("sxe-cancel")
    marker = f"899.{secrets.randbelow(10**6):06d}"  # `sleep` sums its arguments: a unique argv
    project.one_step(f"echo started; exec sleep 600 {marker}")
    proc = project.popen_doit()
    started = time.monotonic()
    launch = wait_for(lambda: marked_pids(marker) or proc.poll() is not None, "the command to run",
                      LAUNCH_TIMEOUT, every=0.5)  # fmt: skip
    assert proc.poll() is None, project.output()
    handle = project.handle()
    cluster = handle["backend_state"]["cluster"]
    assert [job[2] for job in jobs_named(project.bed, project.prefix)] == ["RUNNING"]
    begun = time.monotonic()
    done = project.compute("cancel", handle["run_id"])
    cancel = time.monotonic() - begun
    assert done.returncode == 0, show(done)
    assert "cancelled" in done.stdout, show(done)
    # nothing runs any more: no cluster, no job of the cluster user, no command
    project.assert_gone(cluster)
    project.assert_nothing_runs(marker)
    proc.wait(timeout=CALL_TIMEOUT)
    assert proc.returncode != 0, project.output()
    assert f"run {handle['run_id']} cancelled" in project.output(), project.output()
    assert project.status(handle["run_id"])["state"] == "cancelled"
    assert not (project.root / "out").exists()
    report(request, "cancel", {"launch": launch, "cancel": cancel, "total": time.monotonic() - started})


def test_the_client_killed_mid_launch_then_cancel_finds_the_request_and_leaves_nothing(
    project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    project = project_factory("sxe-kill")
    project.one_step("echo started; exec sleep 600")
    proc = project.popen_doit()
    started = time.monotonic()
    # Mid-launch: SkyPilot has submitted the cluster's Slurm job (the
    # allocation a cancelled launch request alone would leave behind, as in
    # SkyPilot issue #4410) and goes on provisioning it.
    wait_for(lambda: jobs_named(project.bed, project.prefix) or proc.poll() is not None,
             "SkyPilot to submit the cluster's Slurm job", LAUNCH_TIMEOUT, every=0.2)  # fmt: skip
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    # At once, while SkyPilot provisions (its runtime install takes half a
    # minute at least): every look before it would narrow that window.
    begun = time.monotonic()
    done = project.compute("cancel", project.handle()["run_id"])
    cancel = time.monotonic() - begun
    assert proc.returncode == -signal.SIGKILL, project.output()
    assert done.returncode == 0, show(done)
    assert "cancelled" in done.stdout, show(done)
    handle = project.handle()
    assert project.run_file(handle, "task.json").is_file()  # the intent, written before waiting
    assert handle["backend_state"].get("job_id") is None, "the launch had ended before the client was killed"
    rid = json.loads(project.run_file(handle, "launch-request.json").read_text())["request_id"]
    # CANCELLED: it was still in flight when cancel found it (a request that
    # had ended would keep its SUCCEEDED or FAILED)
    assert project.request_state(rid) == "CANCELLED"
    project.assert_gone(handle["backend_state"]["cluster"])
    assert project.clusters() == []
    project.assert_nothing_runs()
    assert project.status(handle["run_id"])["state"] == "cancelled"
    again = project.compute("cancel", handle["run_id"])
    assert again.returncode == 0 and "nothing to cancel" in again.stdout, show(again)
    report(request, "killed-mid-launch", {"to_slurm_job": begun - started, "cancel": cancel})


def test_the_lifetime_takes_the_cluster_down_with_no_client_present(
    project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    """lifetime_minutes = 3, idle_minutes = 1: the node's watchdog stops the
    run two minutes after setup began, SkyPilot's autodown takes the idle
    cluster down a minute later. Nobody calls anything meanwhile. (Two
    minutes, not one: since the lease, a cold step's command starts over
    ssh after setup, which took more than a minute on the loaded bed.)"""
    project = project_factory("sxe-life")
    marker = f"898.{secrets.randbelow(10**6):06d}"
    project.one_step(f"echo started; exec sleep 900 {marker}", lifetime_minutes=3, idle_minutes=1)
    proc = project.popen_doit()
    started = time.monotonic()
    wait_for(lambda: marked_pids(marker) or proc.poll() is not None, "the command to run",
             LAUNCH_TIMEOUT, every=0.5)  # fmt: skip
    assert proc.poll() is None, project.output()
    proc.send_signal(signal.SIGKILL)  # the client is gone for good
    proc.wait(timeout=30)
    killed = time.monotonic()
    assert marked_pids(marker), "the command did not run on after its client died"
    handle = project.handle()
    cluster = handle["backend_state"]["cluster"]
    # First the watchdog stops the run (a minute after setup began) while
    # the cluster stays up; only then does the idle cluster go.
    stopped = wait_for(lambda: marked_pids(marker) == [], "the watchdog to stop the command",
                       GONE_TIMEOUT, every=0.5)  # fmt: skip
    # the timer fires (3 - 1) minutes after setup began, which was before the kill
    assert stopped < 150, f"the command ran on {stopped:.0f} s after the kill, past the lifetime's timer"
    running = [job[2] for job in jobs_named(project.bed, project.prefix)]
    assert running == ["RUNNING"], "the cluster went before the run was stopped"
    gone = wait_for(lambda: project.cluster_gone(cluster), f"the autodown to take {cluster} down",
                    GONE_TIMEOUT, every=10)  # fmt: skip
    project.assert_nothing_runs()
    assert project.status(handle["run_id"])["state"] == "lost"  # its cluster went by itself
    report(request, "lifetime", {"launch": killed - started, "run_stopped_after_kill": stopped,
                                 "gone_after_kill": stopped + gone})  # fmt: skip


def test_a_site_whose_sshd_drops_skypilots_env_runs_the_step_in_the_jobs_home(
    project_factory: Callable[[str], SkyProject], request: pytest.FixtureRequest
) -> None:
    """The bed's stock login (`substrax-e2e-stock`): its sshd accepts only
    LANG and LC_*, SkyPilot's runtime lives in the site's `tmpdir`, and the
    login's ~/.bashrc returns early for a command (Debian's stock shape), so
    SkyPilot's ~/.sky_ssh_rc never moves a shell over ssh into the cluster's
    home. The job runs in that home all the same; the backend finds the
    run's folder where the job printed it, fetches, verifies, promotes, and
    leaves nothing behind."""
    project = project_factory("sxe-stock")
    project.one_step(
        "mkdir -p out && cp data/in.txt out/copy.txt && echo made > out/made.txt && echo home: $HOME",
        infra=project.bed.stock_infra,
    )
    started = time.monotonic()
    done = project.doit()
    seconds = time.monotonic() - started
    assert done.returncode == 0, show(done)
    assert step_ran(done, "step"), show(done)
    handle = project.handle()
    cluster = handle["backend_state"]["cluster"]
    job_home = handle["backend_state"]["job_home"]
    assert job_home.startswith(f"{project.bed.user.home}/.sky_clusters/{cluster}-"), job_home
    manifest = json.loads(project.run_file(handle, "manifest.json").read_text())
    files = {e["path"]: e["sha256"] for e in manifest["entries"] if e["type"] == "file"}
    assert sorted(files) == ["out/copy.txt", "out/made.txt"], manifest
    for path, digest in files.items():
        assert sha256(project.root / path) == digest, path
    assert (project.root / "out" / "copy.txt").read_text() == "hello\n"
    assert handle["state"]["phase"] == "promoted" and handle["backend_state"]["torn_down"] is True
    project.assert_gone(cluster)
    project.assert_nothing_runs()
    logs = project.compute("logs", handle["run_id"])  # the sandbox's home is bound at the job's
    assert logs.returncode == 0 and f"home: {job_home}\n" in logs.stdout, show(logs)
    report(request, "stock-login", {"doit": seconds})
