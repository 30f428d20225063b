"""The SkyPilot task every configuration shape becomes, checked by the real
SkyPilot (offline: a fixture catalog, no network).

Each case is a project with its own [tool.substrax.compute.backends.skypilot]
table; the config is the one SkypilotBackend.launch builds (captured where
launch hands it to `_validate`), and SkyPilot's verdict is skypilot/helper/sky_sdk.py's
`validate` answer. All cases go through one SkyPilot process (`import sky`
is ~3 s); two tests go through SkyClient and the backend end to end. The
provider lists in skypilot_settings.py are compared with SkyPilot's own.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sky_real import (
    AWS_IMAGE_TAG,
    SKY_VERSION,
    make_sky_home,
    needs_offline_sky,
    offline_python,
    run_driver,
    sky_env,
)

from substrax_tasks.backends.skypilot.backend import SkypilotBackend
from substrax_tasks.backends.skypilot.client import SkyClient
from substrax_tasks.backends.skypilot.settings import NO_AUTODOWN, NO_BUCKET_MOUNTS, TABLE, SkypilotSettings
from substrax_tasks.backends.skypilot.task import SkyConfigRefused, validate, worker_job
from substrax_tasks.step.spec import make_spec
from substrax_tasks.store.handle import RunHandle
from substrax_tasks.store.project import Project

pytestmark = needs_offline_sky

BUCKET = "s3://substrax-test-bucket"
AMI = "ami-0123456789abcdef0"
TAG = AWS_IMAGE_TAG  # an image SkyPilot knows from its catalog (an AMI it asks AWS about)
COPY = "[copy]\n"


@dataclass(frozen=True)
class Case:
    """A project's SkyPilot table (TOML; `[copy]`/`[bucket]` are its
    subtables), its files, the step's own resources, and what SkyPilot must
    say: accepted, or refused with `refused` in its message."""

    id: str
    table: str
    resources: dict[str, Any] = field(default_factory=dict)  # expected in the task's resources
    files: dict[str, str] = field(default_factory=dict)
    step_resources: dict[str, str | int | float] = field(default_factory=dict)
    step: str = "train"
    refused: str | None = None
    kind: str | None = None


GOOD = [
    Case(
        "copy-transport",
        'infra = "aws"\n[copy]\nsources = ["data", {path = "refs", mode = "COPY"}]\n'
        "network_isolation = true\ndisk_size = 64\n",
        {"infra": "aws", "disk_size": 64},
        files={"data/a.csv": "1,2\n", "refs/b.txt": "b\n"},
    ),
    Case(
        "bucket-transport",
        f'infra = "aws"\n[bucket]\noutputs_bucket = "{BUCKET}/runs"\n'
        f'buckets = {{"data" = "{BUCKET}/data"}}\n',
        {"infra": "aws"},
    ),
    Case("infra-region", 'infra = "aws/us-east-1"\n' + COPY, {"infra": "aws/us-east-1"}),
    Case("accelerators-str", 'infra = "aws"\naccelerators = "H100:1"\n' + COPY, {"accelerators": "H100:1"}),
    Case(
        "accelerators-dict",
        'infra = "aws"\naccelerators = {H100 = 8}\n' + COPY,
        {"accelerators": {"H100": 8}},
    ),
    Case("cpus", 'infra = "aws"\ncpus = "4+"\n' + COPY, {"cpus": "4+"}),
    Case("memory", 'infra = "aws"\nmemory = "16+"\n' + COPY, {"memory": "16+"}),
    Case(
        "instance-type",
        'infra = "aws"\ninstance_type = "m6i.2xlarge"\n' + COPY,
        {"instance_type": "m6i.2xlarge"},
    ),
    Case("use-spot", 'infra = "aws"\nuse_spot = true\n' + COPY, {"use_spot": True}),
    Case("disk-size", 'infra = "aws"\ndisk_size = 100\n' + COPY, {"disk_size": 100}),
    Case("disk-tier", 'infra = "aws"\ndisk_tier = "high"\n' + COPY, {"disk_tier": "high"}),
    Case(
        "image-id",
        f'infra = "aws/us-east-1"\nimage_id = "{TAG}"\n' + COPY,
        {"image_id": TAG, "infra": "aws/us-east-1"},
    ),
    Case(
        "labels",
        'infra = "aws"\nlabels = {team = "ml", project = "substrax"}\n' + COPY,
        {"labels": {"team": "ml", "project": "substrax"}},
    ),
    Case(
        "step-overrides-backend",
        'infra = "aws"\naccelerators = "H100:8"\ncpus = "4+"\nmemory = "16+"\ndisk_size = 50\n' + COPY,
        {"infra": "aws", "accelerators": "H100:1", "cpus": 16, "memory": 256, "disk_size": 200},
        step_resources={"accelerators": "H100:1", "cpus": 16, "memory": 256, "disk_size": 200},
    ),
    Case(
        "setup-commands",
        'infra = "aws"\nsetup_commands = ["sudo apt-get install -y jq", "echo \'ready\' > ready.txt"]\n'
        + COPY,
        {"infra": "aws"},
    ),
    Case("uv-lock", 'infra = "aws"\n' + COPY, {"infra": "aws"}, files={"uv.lock": "version = 1\n"}),
    Case(
        "requirements-lock",
        'infra = "aws"\npip_args = ["--no-cache-dir"]\n' + COPY,
        {"infra": "aws"},
        files={"requirements.lock": "numpy==2.0.0\n"},
    ),
    Case(
        "everything",
        f'infra = "aws/us-east-1"\naccelerators = "H100:1"\ncpus = "16+"\nmemory = "64+"\n'
        f'use_spot = true\ndisk_size = 200\ndisk_tier = "best"\nimage_id = "{TAG}"\n'
        'labels = {team = "ml"}\nsetup_commands = ["echo setup"]\n'
        '[copy]\nsources = ["data"]\nnetwork_isolation = true\n',
        {
            "infra": "aws/us-east-1",
            "accelerators": "H100:1",
            "cpus": "16+",
            "memory": "64+",
            "use_spot": True,
            "disk_size": 200,
            "disk_tier": "best",
            "image_id": TAG,
            "labels": {"team": "ml"},
        },
        files={"data/a.csv": "1\n", "uv.lock": "version = 1\n"},
    ),
]
BAD = [
    Case(
        "bad-infra",
        'infra = "nosuchcloud"\n' + COPY,
        refused="nosuchcloud",
        kind="InvalidSkyPilotConfigError",
    ),
    Case("bad-accelerator-count", 'infra = "aws"\naccelerators = "H100:x"\n' + COPY, refused="H100:x"),
    Case("bad-instance-type", 'infra = "aws"\ninstance_type = "nosuch.type"\n' + COPY, refused="nosuch.type"),
    Case("bad-region", 'infra = "aws/nowhere-1"\n' + COPY, refused="nowhere-1"),
    # SkyPilot's own rule, unknown to the settings: an AMI belongs to a region.
    Case("image-id-without-region", f'infra = "aws"\nimage_id = "{AMI}"\n' + COPY, refused="region"),
    Case(
        "unknown-image-tag",
        'infra = "aws/us-east-1"\nimage_id = "skypilot:no-such-image"\n' + COPY,
        refused="no-such-image",
    ),
]
# An AMI is looked up on AWS itself (describe_images: boto3, credentials).
AMI_CASE = Case("image-id-ami", f'infra = "aws/us-east-1"\nimage_id = "{AMI}"\n' + COPY)
# Step names become SkyPilot's task name ("substrax-<run id>", cut at 60).
STEP_NAMES = [
    Case("step-name-odd-characters", 'infra = "aws"\n' + COPY, step="Weird name!! (v2)"),
    Case("step-name-dots-and-case", 'infra = "aws"\n' + COPY, step="Train.Model_v2"),
    Case("step-name-trailing-underscores", 'infra = "aws"\n' + COPY, step="fit__"),
    Case("step-name-cut-on-a-dash-34", 'infra = "aws"\n' + COPY, step="s" * 34),
    Case("step-name-cut-on-a-dash-50", 'infra = "aws"\n' + COPY, step="s" * 50),
]
# The copy transport mounts each source from the project; SkyPilot checks
# local sources only when file mounts are validated.
MISSING_SOURCE = Case("copy-source-missing", 'infra = "aws"\n[copy]\nsources = ["nodata"]\n')
CASES = {case.id: case for case in [*GOOD, *BAD, AMI_CASE, *STEP_NAMES, MISSING_SOURCE]}
MOUNT_REFUSED = sorted(NO_BUCKET_MOUNTS)


@dataclass
class Generated:
    config: dict[str, Any]
    handle: RunHandle
    project: Project


class _Captured(Exception):
    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__("captured")
        self.config = config


class _CapturingBackend(SkypilotBackend):
    """The real launch, stopped where it hands the task to SkyPilot (its
    first call: validate)."""

    def sky(self) -> Any:
        return self

    def call(self, operation: str, request: dict[str, Any], **_: Any) -> None:
        raise _Captured(request["task"])


def _pyproject(case: Case, sky_python: Path) -> str:
    table = case.table.replace("[copy]", f"[{TABLE}.copy]").replace("[bucket]", f"[{TABLE}.bucket]")
    return (
        '[tool.substrax.compute]\ndefault_backend = "skypilot"\n\n'
        f'[{TABLE}]\nsky_python = "{sky_python}"\n{table}'
    )


def _generate(root: Path, case: Case, sky_python: Path) -> Generated:
    project_dir = root / case.id
    project_dir.mkdir(parents=True)
    (project_dir / "pyproject.toml").write_text(_pyproject(case, sky_python))
    (project_dir / "train.py").write_text("print('train')\n")
    for rel, text in case.files.items():
        (project_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (project_dir / rel).write_text(text)
    project = Project.open(project_dir)
    spec = make_spec(
        case.step, ["python", "train.py"], project_dir, inputs=["train.py"], outputs=["model/"],
        resources=case.step_resources,
    )  # fmt: skip
    handle = project.new_run(spec, "skypilot")
    backend = _CapturingBackend.from_handle(handle, project.store)
    with pytest.raises(_Captured) as captured:
        backend.launch(handle)
    return Generated(captured.value.config, handle, project)


@pytest.fixture(scope="module")
def sky_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str], Path]]:
    root = tmp_path_factory.mktemp("sky-validation")
    home = make_sky_home(root)
    yield home, sky_env(home), offline_python(root)


@pytest.fixture(scope="module")
def generated(
    tmp_path_factory: pytest.TempPathFactory, sky_home: tuple[Path, dict[str, str], Path]
) -> dict[str, Generated]:
    root = tmp_path_factory.mktemp("sky-projects")
    return {case.id: _generate(root, case, sky_home[2]) for case in CASES.values()}


def _with_infra(config: dict[str, Any], infra: str) -> dict[str, Any]:
    changed = copy.deepcopy(config)
    changed["resources"]["infra"] = infra
    return changed


@pytest.fixture(scope="module")
def verdicts(
    tmp_path_factory: pytest.TempPathFactory,
    sky_home: tuple[Path, dict[str, str], Path],
    generated: dict[str, Generated],
) -> dict[str, Any]:
    """SkyPilot's answer to every case, and its clouds' features: one process."""
    home, env, python = sky_home
    requests = {
        case_id: {
            "task": g.config,
            "needs_storage_mounting": "[bucket]" in CASES[case_id].table,
            "check_file_mounts": True,  # as the backend asks: its snapshot exists by then
        }
        for case_id, g in generated.items()
    }
    bucket = generated["bucket-transport"].config
    for cloud in MOUNT_REFUSED:
        requests[f"mount-on-{cloud}"] = {"task": _with_infra(bucket, cloud), "needs_storage_mounting": True}
    return run_driver(python, env, home.parent / "driver", requests, features=True)


# ------------------------------------------------------------------ the shapes


@pytest.mark.parametrize("case_id", [c.id for c in GOOD])
def test_skypilot_accepts_the_generated_task(
    case_id: str, generated: dict[str, Generated], verdicts: dict[str, Any]
) -> None:
    case, config = CASES[case_id], generated[case_id].config
    answer = verdicts["validate"][case_id]
    assert answer["ok"], (
        f"SkyPilot refused {case_id}: {answer.get('error')}\nresources: {config['resources']}"
    )
    assert answer["result"] == {"valid": True}
    for key, value in case.resources.items():
        assert config["resources"].get(key) == value, (key, config["resources"])


def _mounts(config: dict[str, Any]) -> dict[str, Any]:
    mounts: dict[str, Any] = config["file_mounts"]
    return mounts


def test_copy_transport_mounts_the_sources(generated: dict[str, Generated]) -> None:
    g = generated["copy-transport"]
    project = g.project.root
    mounts = _mounts(g.config)
    sources = {dest.rsplit("/project/", 1)[-1]: src for dest, src in mounts.items() if "/project/" in dest}
    assert sources == {"data": str(project / "data"), "refs": str(project / "refs")}
    assert all(isinstance(src, str) for src in mounts.values()), "the copy transport mounts no bucket"
    assert all(dest.startswith("~/") for dest in mounts)
    # the job each step's worker gets on the cluster (written at start, over ssh)
    backend = SkypilotBackend(SkypilotSettings.model_validate(g.handle.settings), g.project.store)
    job = worker_job(backend.settings, g.handle, backend.layout(g.handle), None)
    assert job["network_isolation"] is True


def test_bucket_transport_mounts_the_buckets(generated: dict[str, Generated]) -> None:
    mounts = _mounts(generated["bucket-transport"].config)
    buckets = {dest: src for dest, src in mounts.items() if isinstance(src, dict)}
    assert sorted(m["source"] for m in buckets.values()) == [f"{BUCKET}/data", f"{BUCKET}/runs"]
    assert {m["mode"] for m in buckets.values()} == {"MOUNT"}


def test_setup_runs_the_commands_and_builds_the_locked_env(generated: dict[str, Generated]) -> None:
    setup = generated["setup-commands"].config["setup"]
    assert "sudo apt-get install -y jq\necho 'ready' > ready.txt\n" in setup
    assert setup.index("watchdog") < setup.index("apt-get")
    # remote/env.py, the recipe of every backend, with the project's pip arguments
    assert " env.py " in generated["uv-lock"].config["setup"]
    pip = generated["requirements-lock"].config["setup"]
    assert " env.py " in pip and pip.rstrip().endswith("python3 --no-cache-dir >/dev/null")
    assert " env.py " not in generated["infra-region"].config["setup"]


@pytest.mark.parametrize("case_id", [c.id for c in BAD])
def test_skypilot_refuses_a_bad_task(case_id: str, verdicts: dict[str, Any]) -> None:
    case = CASES[case_id]
    answer = verdicts["validate"][case_id]
    assert not answer["ok"], f"SkyPilot accepted {case_id}"
    assert answer["exit_code"] == 1
    assert case.refused is not None
    assert case.refused in answer["error"]["message"], answer["error"]
    if case.kind:
        assert answer["error"]["type"] == case.kind


def test_an_ami_is_checked_against_aws_itself(verdicts: dict[str, Any]) -> None:
    """SkyPilot asks AWS for an AMI's size while validating (no credentials:
    it assumes a default size). Without boto3 (SkyPilot installed without its
    [aws] extra, as here) it refuses the task, so _validate refuses it too."""
    answer = verdicts["validate"]["image-id-ami"]
    assert not answer["ok"], "make sky-venv installs skypilot without [aws]: the AMI cannot be looked up"
    assert answer["error"]["type"] == "ImportError", answer["error"]
    assert "skypilot[aws]" in answer["error"]["message"]


@pytest.mark.parametrize("case_id", [c.id for c in STEP_NAMES])
def test_every_step_name_makes_a_valid_task_name(
    case_id: str, generated: dict[str, Generated], verdicts: dict[str, Any]
) -> None:
    answer = verdicts["validate"][case_id]
    assert answer["ok"], f"{generated[case_id].config['name']!r}: {answer['error']['message'][:200]}"


def test_a_missing_copy_source_is_refused_before_launch(verdicts: dict[str, Any]) -> None:
    answer = verdicts["validate"]["copy-source-missing"]
    assert not answer["ok"]
    assert "nodata" in answer["error"]["message"]


# ------------------------------------------------------------------- providers


@pytest.mark.parametrize("cloud", MOUNT_REFUSED)
def test_a_bucket_mount_is_refused_where_skypilot_cannot_mount(cloud: str, verdicts: dict[str, Any]) -> None:
    answer = verdicts["validate"][f"mount-on-{cloud}"]
    assert not answer["ok"], f"SkyPilot would mount a bucket on {cloud}"
    assert answer["error"]["type"] == "NotSupportedError", answer["error"]
    assert "storage_mounting" in answer["error"]["message"]
    assert verdicts["validate"]["bucket-transport"]["ok"], "the same task on aws must be accepted"


def _lacking(verdicts: dict[str, Any], feature: str) -> set[str]:
    return {name for name, features in verdicts["features"].items() if feature in features}


def test_no_bucket_mounts_matches_skypilot(verdicts: dict[str, Any]) -> None:
    """Slurm lacks mounting only without /dev/fuse (checked per cluster at
    launch), so it is not refused up front."""
    lacking = _lacking(verdicts, "STORAGE_MOUNTING")
    assert set(NO_BUCKET_MOUNTS) == lacking - {"slurm"}, verdicts["features"]
    assert "slurm" in lacking
    assert "aws" in verdicts["features"], "SkyPilot's cloud registry was not read"


def test_no_autodown_matches_skypilot(verdicts: dict[str, Any]) -> None:
    assert set(NO_AUTODOWN) == _lacking(verdicts, "AUTODOWN"), verdicts["features"]


def test_the_lists_were_checked_against_the_pinned_skypilot(verdicts: dict[str, Any]) -> None:
    assert verdicts["version"] == SKY_VERSION, (
        f"SkyPilot {verdicts['version']} is installed; NO_BUCKET_MOUNTS and NO_AUTODOWN follow "
        f"{SKY_VERSION}: check them (and this test's catalogs) against the new release"
    )


def test_the_provider_lists_use_skypilots_names(verdicts: dict[str, Any]) -> None:
    known = set(verdicts["features"])
    assert set(NO_BUCKET_MOUNTS) | set(NO_AUTODOWN) <= known


# --------------------------------------------------------------- end to end


def test_sky_client_validates_a_task(
    sky_home: tuple[Path, dict[str, str], Path], generated: dict[str, Generated]
) -> None:
    """skypilot/helper/sky_sdk.py as SkyClient runs it: its own process and answer."""
    _, env, python = sky_home
    client = SkyClient(str(python), env)
    task = generated["everything"].config
    assert client.call("validate", {"task": task, "needs_storage_mounting": False}) == {"valid": True}


def test_the_backend_refuses_a_task_skypilot_refuses(
    sky_home: tuple[Path, dict[str, str], Path],
    generated: dict[str, Generated],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """sky_task.validate (SkyClient with this process's environment)
    turns SkyPilot's refusal into SkyConfigRefused naming the problem."""
    home, _, _ = sky_home
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("SKYPILOT_DISABLE_USAGE_COLLECTION", "1")
    monkeypatch.delenv("SKYPILOT_API_SERVER_ENDPOINT", raising=False)
    g = generated["bad-infra"]
    backend = SkypilotBackend.from_handle(g.handle, g.project.store)
    assert isinstance(backend, SkypilotBackend)
    with pytest.raises(SkyConfigRefused) as refused:
        validate(backend.sky(), backend.settings, g.config)
    message = str(refused.value)
    assert "nosuchcloud" in message
    assert "InvalidSkyPilotConfigError" in message
    assert "[tool.substrax.compute.backends.skypilot]" in message
