"""Shared, session-wide test fixtures: one engine, one image, one Prefect harness.

Prefect reads its settings at import, so its environment is set here, before any
test module imports prefect: a throwaway PREFECT_HOME, no API URL (ephemeral
mode), no analytics, and a startup timeout that suits a 2-core machine.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_PREFECT_HOME = tempfile.mkdtemp(prefix="sandflow-test-prefect-")
os.environ["PREFECT_HOME"] = _PREFECT_HOME
os.environ.pop("PREFECT_API_URL", None)
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The Prefect defaults the CLI sets first thing (flows/prefect_env.py): importing `flows`
# no longer sets them, so the suite does it before anything imports prefect.
from flows import prefect_env  # noqa: E402

prefect_env.apply()
# Tests never use a developer's personal config file or keys.
os.environ["SANDFLOW_CONFIG"] = os.path.join(_PREFECT_HOME, "no-such-sandflow.toml")
for _k in ("SANDFLOW_API_KEY", "OPENAI_API_KEY", "SANDFLOW_BASE_URL", "SANDFLOW_MODEL"):
    os.environ.pop(_k, None)

# Ctrl+C is part of what the suite tests: its children get SIGINT and must stop cleanly.
# A suite started as a background job of a non-interactive shell (`cmd &`, nohup, some CI
# runners) inherits SIGINT *ignored*, and an ignored signal stays ignored in every child
# it starts (sandflow keeps it so on purpose: tests/sandbox/test_signal_dispositions.py).
# Python's usual handler here gives each child SIGINT's default disposition at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

TEST_RUN_PREFIX = "pytest-"


# ------------------------------------------------------------------------ pytest-xdist
# scripts/test.sh runs the suite on a few worker processes (`-n 3 --dist loadgroup`): each
# worker is a session of its own (its own PREFECT_HOME, Prefect harness, run ids and
# sandbox labels), like two sessions on one machine. Tests that share an expensive or
# machine-wide thing run on ONE worker, one after another (an xdist_group):
# - a session fixture that starts a big thing (a second dockerd, a recorded run, Chromium);
# - a module whose fixtures are module-scoped (built once, not once per worker);
# - the `serial` marker: a test that owns something of the machine (a fixed bridge name,
#   the PostgreSQL server) or that must not share the CPU with others.
SHARED_FIXTURES = (
    "second_engine", "real_run", "browser", "private_engine", "gvisor", "bwrap_volumes", "embedded_policy",
)


# Modules that drive the host's one recording egress proxy (squid, its logger, the egress
# networks): test_egress.py restarts squid on a new network (its MTU test), which loses the
# log line another worker's firewall test waits for (seen in CI). One worker runs them all.
EGRESS_MODULES = ("tests/sandbox/test_egress", "tests/sandbox/test_network_cli.py")


def _xdist_group(item: pytest.Item) -> str | None:
    if item.get_closest_marker("serial"):
        return "serial"
    if item.nodeid.startswith(EGRESS_MODULES):
        return "egress"
    names = getattr(item, "fixturenames", ())
    for name in SHARED_FIXTURES:
        if name in names:
            return name
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    if any(d.scope == "module" for fdefs in defs.values() for d in fdefs):
        return item.nodeid.split("::")[0]
    return None


@pytest.hookimpl(wrapper=True)  # around xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> Iterator[None]:
    xdist = config.pluginmanager.hasplugin("xdist")
    for item in items if xdist else ():
        group = _xdist_group(item)
        if group and not item.get_closest_marker("xdist_group"):
            item.add_marker(pytest.mark.xdist_group(group))
    yield
    # A grouping that silently does nothing splits shared fixtures and machine-wide tests
    # across workers (seen with pytest 9.2, whose node ids pytest-xdist 3.8 cannot suffix).
    if xdist and config.getoption("loadgroup", default=False) and getattr(config, "workerinput", None) is not None:
        lost = [i.nodeid for i in items if i.get_closest_marker("xdist_group") and "@" not in i.nodeid]
        if lost:
            raise pytest.UsageError(
                f"pytest-xdist did not group {len(lost)} tests (e.g. {lost[0]}): this pytest and "
                "pytest-xdist do not work together; install the versions pyproject.toml's dev extra pins"
            )


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


@pytest.fixture(autouse=True)
def _no_event_loop_left_running(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test that leaves an asyncio loop marked running in the main thread breaks every
    later `asyncio.run` on that worker (seen in CI: tests/rl/test_batch_run.py, after the
    viewer's browser tests on the same worker). This names the test that started it, not
    the ones that trip on it. Playwright's sync API runs its loop in the main thread while
    `browser` (tests/viewer/conftest.py, package scope) lives: its tests are exempt."""
    before = _running_loop()
    yield
    after = _running_loop()
    if after is not None and after is not before and "browser" not in request.fixturenames:
        pytest.fail(f"this test left an event loop running in the main thread: {after!r}")


@pytest.fixture(scope="session")
def short_tmp() -> Iterator[Path]:
    """A folder with a short path (/tmp/sf-XXXXXXXX), removed after the session.

    Why: a unix socket's path holds 107 bytes, and TMPDIR and tmp_path can be long (a
    cluster's /scratch/slurm/job-123456/..., a CI's 70-char folder). What a test binds
    itself, or a tool binds under TMPDIR (Chromium's singleton socket), goes here, so the
    suite passes under a long TMPDIR; sandflow's own sockets cope with any length."""
    import shutil

    path = tempfile.mkdtemp(prefix="sf-", dir="/tmp")
    yield Path(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def prefect_harness() -> Iterator[None]:
    """One ephemeral Prefect API for the whole session (never nest harnesses)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield


@pytest.fixture
def host_settings() -> Iterator[object]:
    """`host_settings(netns_reuse=False, ...)`: the sandbox library's host settings for one
    test, handed in as the application does (sandbox.settings.configure); put back after."""
    from sandbox import settings

    previous = settings.current()
    yield settings.configure
    settings.configure(previous)


@pytest.fixture
def scripted_model() -> Iterator[object]:
    """A started ScriptedModel (tests/scripted_model.py): push replies/faults, read .requests."""
    from tests.scripted_model import ScriptedModel

    with ScriptedModel() as server:
        yield server


# ----------------------------------------------------------------------------- sandbox room
# The engine, the image and the rootfs are session-wide: each test that needs one fails
# with a message saying what to do when it is missing (never a silent skip).


@pytest.fixture(scope="session")
def docker_engine() -> object:
    """A pinged docker client for the engine sandflow uses (DOCKER_HOST or the local socket)."""
    from sandbox.base import SandboxError
    from sandbox.engine import docker_client

    try:
        return docker_client()
    except SandboxError as e:
        pytest.fail(f"Docker engine needed: {e}", pytrace=False)


@pytest.fixture(scope="session")
def sandbox_image(docker_engine: object) -> str:
    """The content-hashed sandbox image tag, checked to exist on the engine."""
    from sandbox.base import SandboxError
    from sandbox.engine import ensure_image
    from sandbox.image import DEFAULT_SPEC

    try:
        ensure_image(docker_engine, DEFAULT_SPEC.tag)
    except SandboxError as e:
        pytest.fail(str(e), pytrace=False)
    return DEFAULT_SPEC.tag


@pytest.fixture(scope="session")
def bwrap_volumes(sandbox_rootfs: str) -> Iterator[Path]:
    """A btrfs filesystem of this session's own for bwrap's copy-on-write places
    (sandbox/volumes.py: what `scripts/setup.sh --volumes` makes), in a sparse file on
    /dev/shm; unmounted and deleted at the end of the session."""
    import shutil
    import subprocess

    from sandbox import volumes

    if os.geteuid() != 0 or shutil.which("mkfs.btrfs") is None:
        pytest.fail("bwrap volumes need root and mkfs.btrfs: bash scripts/setup.sh --test", pytrace=False)
    try:
        with volumes.scratch_filesystem(4, prefix="sandflow-test-volumes") as mount:
            yield mount
    except (subprocess.CalledProcessError, volumes.VolumesUnavailable) as e:
        pytest.fail(f"cannot make the test's btrfs volumes: {e}", pytrace=False)


@pytest.fixture(scope="session")
def second_engine(sandbox_image: str) -> Iterator[str]:
    """A second Docker engine for this session (scripts/engine2.sh, with a directory,
    bridge and subnet of this session's own), the sandbox image loaded into it from the
    first; yields its DOCKER_HOST; stopped and removed at the end of the session."""
    import shutil

    from tests.two_engines import engine2, session_engine2_env

    if shutil.which("dockerd") is None or os.geteuid() != 0:
        pytest.fail("the two-engine tests start a second dockerd: they need dockerd and root", pytrace=False)
    env = session_engine2_env(str(os.getpid()))
    os.environ.update(env)  # the tests' halt/start of this engine find it by these
    docker0 = Path("/sys/class/net/docker0")
    had_docker0 = docker0.exists()
    try:
        host = engine2("start", env)
        yield host
    finally:
        engine2("stop", env)
    # Docker 20.10 restarted with a stale default network deleted the host's docker0
    # (scripts/engine2.sh says why): the first engine must keep its bridge.
    assert docker0.exists() or not had_docker0, "the second engine deleted the host's docker0"


@pytest.fixture(scope="session")
def sandbox_rootfs() -> str:
    """The bubblewrap root filesystem (the offline image build's rootfs) and bwrap itself."""
    from sandbox.bwrap_backend import bwrap_available
    from sandbox.image import DEFAULT_SPEC, rootfs_path

    why = bwrap_available()
    if why:
        pytest.fail(why, pytrace=False)
    root = rootfs_path(DEFAULT_SPEC)
    if not (root / ".sandflow-complete").exists():
        pytest.fail(f"sandbox rootfs missing at {root}: run `sandflow image build`", pytrace=False)
    return str(root)


@pytest.fixture(scope="session")
def test_run_id() -> str:
    """A run id with the test prefix, unique to this pytest session."""
    import secrets

    return f"{TEST_RUN_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"


def _leaked_sandboxes() -> list[str]:
    """Sandboxes this pytest process opened (label sandflow.pid) under a test run id."""
    leaked: list[str] = []
    try:
        from sandbox import gc as sandbox_gc
        from sandbox import netns
        from sandbox.engine import docker_client
    except ImportError:
        return leaked
    netns.shutdown()  # idle netns holders go at exit anyway; now, so that any left is a leak
    try:
        client = docker_client()
    except Exception:  # noqa: BLE001 - no engine: nothing of ours can be in it
        client = None
    found = sandbox_gc.list_all(client, TEST_RUN_PREFIX)
    found += sandbox_gc.docker_sandboxes(client, netns.HOLDER_RUN_ID) if client is not None else []
    for info in found:
        if info.labels.get("sandflow.pid") == str(os.getpid()):
            leaked.append(f"{info.backend}:{info.id[:12]} run={info.run_id} ep={info.episode_id}")
            if info.backend == "docker":
                sandbox_gc.remove_docker(client, info)
            else:
                sandbox_gc.remove_bwrap(info)
    for vol in sandbox_gc.orphan_volumes(client, TEST_RUN_PREFIX) if client is not None else []:
        if vol.labels.get("sandflow.pid") == str(os.getpid()):
            leaked.append(f"volume:{vol.id[:12]} run={vol.run_id} ep={vol.episode_id}")
            sandbox_gc.remove_volume(client, vol)
    return leaked


_LEAKED = pytest.StashKey[list[str]]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if any sandbox opened by this session under a test run id survived it.
    Under pytest-xdist each worker looks for its own (the label sandflow.pid is the
    worker's) and hands what it found to the controller, which fails the run."""
    config = session.config
    no_leaks: list[str] = []
    leaked = list(config.stash.get(_LEAKED, no_leaks))  # the controller: what its workers found
    if "sandbox" in sys.modules:  # a test of this process opened a sandbox
        leaked += _leaked_sandboxes()
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller reports
        config.workeroutput["sandflow_leaked"] = leaked
        return
    if leaked:
        sys.stderr.write(
            "\nFAILED: sandboxes leaked by this test session (removed now): " + ", ".join(leaked) + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist: a worker ended; keep the leaks it found for pytest_sessionfinish."""
    found = getattr(node, "workeroutput", {}).get("sandflow_leaked") or []
    config = node.config  # type: ignore[attr-defined]
    config.stash[_LEAKED] = [*config.stash.get(_LEAKED, []), *found]
