"""The fake SkyPilot (tests/support/fakesky/sky) against the real one (SkyPilot
0.14.1 in its own virtualenv): the same public API, read off both.

One script runs in each python: first in the fake's (this interpreter, the
fake on PYTHONPATH), which lists the fake's public functions and classes
(the `sky` package's __all__, and what sky.exceptions, sky.clouds,
sky.server.common and sky.server.requests.requests define), then in the
real one's (a fresh HOME: `import sky` writes ~/.sky), which describes the
same names. Compared: parameter names, kinds and defaults of the public
parameters, in order (private `_x` ones left out); enum members and values;
exception classes and their bases; which clouds refuse bucket mounting,
autodown, autostop and stop; the record fields the fake returns. Nothing
imports `sky` into this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fakesky_cleanup import cleanup, fakesky_env, leftovers
from sky_real import sky_env, sky_python

FEATURES = ("STORAGE_MOUNTING", "AUTODOWN", "AUTOSTOP", "STOP")

# Runs in either python: argv[1] the names to describe (a JSON file; "-" to
# list the fake's own public API first), argv[2] where the answer goes.
DUMP = r"""
import enum, inspect, json, sys
import sky
import sky.clouds, sky.exceptions, sky.server.common, sky.server.requests.requests

MODULES = ["sky", "sky.exceptions", "sky.clouds", "sky.server.common", "sky.server.requests.requests"]
FEATURES = %(features)r


def params(fn):
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as exc:
        return "no signature: " + str(exc)
    return [[p.name, p.kind.name, None if p.default is p.empty else repr(p.default)]
            for p in sig.parameters.values() if not p.name.startswith("_")]


def own_members(cls):
    # __init__ and the public methods and properties the class defines itself
    names = []
    for name, value in vars(cls).items():
        method = inspect.isfunction(value) or isinstance(value, (classmethod, staticmethod, property))
        if method and (name == "__init__" or not name.startswith("_")):
            names.append(name)
    return names


def describe(obj, members):
    if isinstance(obj, type) and issubclass(obj, enum.Enum):
        return {"enum": [[m.name, repr(m.value)] for m in obj]}
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return {"bases": [b.__name__ for b in obj.__bases__]}
    if isinstance(obj, type):
        found = {"<str subclass>": issubclass(obj, str)}
        for name in members:
            raw = inspect.getattr_static(obj, name, None)
            found[name] = (None if raw is None else "property" if isinstance(raw, property)
                           else params(getattr(obj, name)))
        return {"class": found}
    if callable(obj):
        return {"function": params(obj)}
    return {"value": type(obj).__name__}


def public_api():
    wanted = {}
    for module in MODULES:
        mod = sys.modules[module]
        names = getattr(mod, "__all__", None) or [n for n in vars(mod) if not n.startswith("_")]
        for name in names:
            obj = getattr(mod, name)
            if name.startswith("_") or inspect.ismodule(obj):
                continue
            if module != "sky" and getattr(obj, "__module__", None) != module:
                continue
            wanted[module + ":" + name] = own_members(obj) if isinstance(obj, type) else []
    return wanted


def clouds():
    try:
        from sky.utils import registry
        table, aliases = dict(registry.CLOUD_REGISTRY), dict(registry.CLOUD_REGISTRY._aliases)
    except ImportError:  # the fake
        table, aliases = dict(sky.clouds.CLOUD_REGISTRY), dict(sky.clouds.CLOUD_ALIASES)
    features = sky.clouds.CloudImplementationFeatures
    found = {}
    for name, cloud in sorted(table.items()):
        static = getattr(type(cloud), "_CLOUD_UNSUPPORTED_FEATURES", {}) or {}
        checks = {}
        for feature in FEATURES:
            try:
                type(cloud).check_features_are_supported(sky.Resources(cloud=cloud), {features[feature]})
                checks[feature] = "ok"
            except sky.exceptions.NotSupportedError:
                checks[feature] = "refused"
            except Exception as exc:
                checks[feature] = "error " + type(exc).__name__
        found[name] = {"class": type(cloud).__name__, "checks": checks,
                       "static": sorted(f.name for f in static if f.name in FEATURES)}
    return {"clouds": found, "aliases": aliases}


def models():
    try:
        from sky.schemas.api import responses
        from sky.server.requests import payloads
    except ImportError:
        return None
    return {"status": sorted(responses.StatusResponse.model_fields),
            "queue": sorted(responses.ClusterJobRecord.model_fields),
            "api_status": sorted(payloads.RequestPayload.model_fields)}


wanted = public_api() if sys.argv[1] == "-" else json.load(open(sys.argv[1]))
answer = {"wanted": wanted, "models": models(), **clouds()}
answer["api"] = {}
for key, members in wanted.items():
    module, _, name = key.partition(":")
    obj = getattr(sys.modules[module], name, None)
    answer["api"][key] = None if obj is None else describe(obj, members)
json.dump(answer, open(sys.argv[2], "w"))
""".replace("%(features)r", repr(FEATURES))

# Run in the fake: the records it returns for a tiny launch, by request name.
RECORDS = r"""
import json, sys
import sky
task = sky.Task.from_yaml_config({"name": "contract", "run": "true"})
job_id, _ = sky.get(sky.launch(task, cluster_name="contract"))
assert job_id == 1, job_id
queued, _ = sky.get(sky.exec(sky.Task.from_yaml_config({"name": "again", "run": "true"}), "contract"))
assert queued == 2, queued
records = {
    "status": sky.get(sky.status(["contract"])),
    "queue": sky.get(sky.queue("contract")),
    "api_status": sky.api_status(all_status=True),
}
answer = {k: sorted(set().union(*(r.model_dump() for r in v))) for k, v in records.items()}
sky.get(sky.down("contract"))
json.dump(answer, open(sys.argv[1], "w"))
"""


def _run(argv: list[str], env: dict[str, str], what: str) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240, check=False)
    if done.returncode != 0:
        pytest.fail(f"{what} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fake, real): each side's description of the fake's public API."""
    real_python = sky_python()  # skips loudly when SkyPilot's virtualenv is missing
    root = tmp_path_factory.mktemp("fakesky-contract")
    script = root / "dump.py"
    script.write_text(DUMP)
    fake_home, real_home = root / "fake-home", root / "real-home"
    fake_home.mkdir()
    real_home.mkdir()
    fake_argv = [sys.executable, str(script), "-", str(root / "fake.json")]
    _run(fake_argv, fakesky_env(fake_home), "the fake's dump")
    fake = json.loads((root / "fake.json").read_text())
    (root / "wanted.json").write_text(json.dumps(fake["wanted"]))
    _run(
        [str(real_python), str(script), str(root / "wanted.json"), str(root / "real.json")],
        sky_env(real_home, SKYPILOT_DISABLE_USAGE_COLLECTION="1"),
        "the real SkyPilot's dump",
    )
    return fake, json.loads((root / "real.json").read_text())


def _mismatches(fake: dict[str, Any], real: dict[str, Any], kind: str) -> list[str]:
    problems = []
    for key, mine in sorted(fake["api"].items()):
        if kind not in mine:
            continue
        theirs = real["api"].get(key)
        if theirs is None:
            problems.append(f"{key}: the real SkyPilot has no such name")
        elif theirs != mine:
            problems.append(f"{key}:\n  fake: {mine[kind]}\n  real: {theirs.get(kind, theirs)}")
    return problems


def test_the_fake_has_a_public_api_to_compare(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    fake, _ = dumps
    names = set(fake["api"])
    for key in ("sky:launch", "sky:exec", "sky:get", "sky:stream_and_get", "sky:api_cancel", "sky:api_status",
                "sky:job_status", "sky:queue", "sky:cancel", "sky:down", "sky:status", "sky:autostop",
                "sky:tail_logs", "sky:Task", "sky:JobStatus", "sky.exceptions:ClusterDoesNotExist",
                "sky.exceptions:RequestCancelled", "sky.exceptions:NotSupportedError",
                "sky.clouds:CloudImplementationFeatures", "sky.server.common:RequestId",
                "sky.server.requests.requests:RequestStatus"):  # fmt: skip
        assert key in names, f"the fake lacks {key}"


def test_functions_have_the_real_signatures(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    problems = _mismatches(*dumps, "function")
    assert not problems, "signatures differ from SkyPilot's:\n" + "\n".join(problems)


def test_classes_have_the_real_methods(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """Task, Resources, Cloud and each cloud class, RequestId (a str):
    every method and property the fake defines, with the real signature."""
    problems = _mismatches(*dumps, "class")
    assert not problems, "classes differ from SkyPilot's:\n" + "\n".join(problems)


def test_enums_have_the_real_members(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """JobStatus, ClusterStatus, RequestStatus, CloudImplementationFeatures,
    OptimizeTarget, StatusRefreshMode, JobExitCode: names, order, values."""
    fake, _ = dumps
    enums = {k for k, v in fake["api"].items() if "enum" in v}
    assert {"sky:JobStatus", "sky.server.requests.requests:RequestStatus",
            "sky.exceptions:JobExitCode"} <= enums  # fmt: skip
    problems = _mismatches(*dumps, "enum")
    assert not problems, "enums differ from SkyPilot's:\n" + "\n".join(problems)


def test_exceptions_exist_with_the_real_bases(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    problems = _mismatches(*dumps, "bases")
    assert not problems, "exceptions differ from SkyPilot's:\n" + "\n".join(problems)


def test_clouds_refuse_what_the_real_ones_refuse(dumps: tuple[dict[str, Any], dict[str, Any]]) -> None:
    """The same registry and aliases; the same static tables of unsupported
    features (bucket mounting, autodown, autostop, stop); and the same
    verdict of check_features_are_supported, where the real one can answer
    offline (its Kubernetes and SSH need extra packages)."""
    fake, real = dumps
    assert sorted(fake["clouds"]) == sorted(real["clouds"])
    assert fake["aliases"] == real["aliases"]
    problems = []
    for name, theirs in real["clouds"].items():
        mine = fake["clouds"][name]
        if mine["class"] != theirs["class"] or mine["static"] != theirs["static"]:
            problems.append(
                f"{name}: fake {mine['class']} {mine['static']}, real {theirs['class']} {theirs['static']}"
            )
        for feature, verdict in theirs["checks"].items():
            if not verdict.startswith("error") and mine["checks"][feature] != verdict:
                problems.append(f"{name} {feature}: fake {mine['checks'][feature]}, real {verdict}")
    assert not problems, "\n".join(problems)
    for name in ("runpod", "vast"):
        assert real["clouds"][name]["checks"]["STORAGE_MOUNTING"] == "refused"
        assert fake["clouds"][name]["checks"]["STORAGE_MOUNTING"] == "refused"
    assert fake["clouds"]["aws"]["checks"]["STORAGE_MOUNTING"] == "ok"


def test_records_carry_the_real_fields(dumps: tuple[dict[str, Any], dict[str, Any]], tmp_path: Path) -> None:
    """What the fake's status, queue and api_status return: only fields of
    SkyPilot's StatusResponse, ClusterJobRecord and RequestPayload."""
    _, real = dumps
    assert real["models"] is not None
    home = tmp_path / "home"
    home.mkdir()
    script = tmp_path / "records.py"
    script.write_text(RECORDS)
    try:
        argv = [sys.executable, str(script), str(tmp_path / "records.json")]
        _run(argv, fakesky_env(home), "the fake's launch")
    finally:
        cleanup(home)
    assert leftovers(home) == []
    records = json.loads((tmp_path / "records.json").read_text())
    for name, fields in records.items():
        unknown = sorted(set(fields) - set(real["models"][name]))
        assert not unknown, f"{name} records carry fields SkyPilot's have not: {unknown}"
        assert {"name", "status"} <= set(fields) or name != "status"
        assert {"job_id", "job_name", "status"} <= set(fields) or name != "queue"
        assert {"request_id", "name", "status"} <= set(fields) or name != "api_status"


# The price of a launched cluster (sky_sdk.py's hourly_price): its status
# record's handle, whose launched resources are priced by `get_cost`.
# Run in the real SkyPilot: the fields its handle is made of.
REAL_HANDLE = r"""
import inspect, json, sys
from sky.backends.cloud_vm_ray_backend import CloudVmRayResourceHandle
init = inspect.signature(CloudVmRayResourceHandle.__init__).parameters
json.dump({"init": sorted(init)}, open(sys.argv[1], "w"))
"""
# Run in the fake: what a launched cluster's handle holds, and its price.
FAKE_HANDLE = r"""
import json, sys
import sky
task = sky.Task.from_yaml_config({"name": "priced", "run": "true",
                                  "resources": {"infra": "aws", "instance_type": "m6i.large"}})
sky.get(sky.launch(task, cluster_name="priced"))
[record] = sky.get(sky.status(["priced"]))
handle = record.handle
launched = handle.launched_resources
answer = {"fields": sorted(vars(handle)), "resources": type(launched).__name__,
          "launchable": launched.is_launchable(), "hour": launched.get_cost(3600),
          "nodes": handle.launched_nodes}
sky.get(sky.down("priced"))
json.dump(answer, open(sys.argv[1], "w"))
"""


def test_a_launched_clusters_handle_is_priced_as_the_real_ones(tmp_path: Path) -> None:
    real_python = sky_python()
    real_home, fake_home = tmp_path / "real-home", tmp_path / "fake-home"
    real_home.mkdir()
    fake_home.mkdir()
    (tmp_path / "real.py").write_text(REAL_HANDLE)
    (tmp_path / "fake.py").write_text(FAKE_HANDLE)
    _run([str(real_python), str(tmp_path / "real.py"), str(tmp_path / "real.json")], sky_env(real_home),
         "the real SkyPilot's handle")  # fmt: skip
    try:
        _run([sys.executable, str(tmp_path / "fake.py"), str(tmp_path / "fake.json")], fakesky_env(fake_home),
             "the fake's priced launch")  # fmt: skip
    finally:
        cleanup(fake_home)
    assert leftovers(fake_home) == []
    real = json.loads((tmp_path / "real.json").read_text())
    fake = json.loads((tmp_path / "fake.json").read_text())
    assert set(fake["fields"]) <= set(real["init"]), (fake["fields"], real["init"])
    assert fake["resources"] == "Resources" and fake["launchable"] is True
    assert fake["hour"] == 0.096 and fake["nodes"] == 1
