"""gVisor (`runsc`) as opt-in isolation of the docker backend: issue #22 item 12.

`SandboxConfig(runtime="runsc")` runs the sandbox under the engine's runtime of that name
(docs/sandbox.md, "gVisor": how to register Debian's runsc with the engine). Runs only
where the engine lists a `runsc` runtime; elsewhere each test is skipped saying so.
The battery of this issue under it: the helper works (exec, files, errors), the uid is no
host account, the keyring calls never reach the host kernel, and a pooled sandbox after a
dirty episode is indistinguishable from a fresh one on every probe of the reset battery.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from sandbox import SandboxConfig, SandboxLimits, open_sandbox
from sandbox.common import SANDBOX_UID
from sandbox.pool import PoolSettings, SandboxPool
from tests.sandbox.test_isolation import _probe_in
from tests.sandbox.test_pool_reset import DIRTY, PROBES, _observe

RUNTIME = "runsc"


@pytest.fixture(scope="module")
def gvisor(
    sandbox_image: str, docker_engine: object, test_run_id: str
) -> Callable[..., SandboxConfig]:
    runtimes = docker_engine.info().get("Runtimes") or {}  # type: ignore[attr-defined]
    if RUNTIME not in runtimes:
        pytest.skip(
            f"NOT TRIED: the engine has no {RUNTIME!r} runtime (registered: {sorted(runtimes)}); "
            "docs/sandbox.md, 'gVisor', says how to register Debian's runsc"
        )

    def make(episode: str = "gvisor", **kw: object) -> SandboxConfig:
        return SandboxConfig(
            backend="docker",
            runtime=RUNTIME,
            run_id=test_run_id,
            episode_id=episode,
            limits=SandboxLimits(memory_mb=512, pids=128, tmp_size_mb=256),
            **kw,
        )

    return make


def test_a_gvisor_sandbox_runs_the_helper_and_its_files(
    gvisor: Callable[..., SandboxConfig],
) -> None:
    with open_sandbox(gvisor("basics")) as sb:
        r = sb.exec("uname -r; id -u; cd /tmp && export X=1")
        assert r.stdout.split() == ["4.4.0", str(SANDBOX_UID)], r.stdout  # gVisor's own kernel
        assert sb.exec("pwd; echo $X").stdout == "/tmp\n1\n"
        sb.write_file("notes/a.bin", b"\x00\xff")
        assert sb.read_file("/testbed/notes/a.bin") == b"\x00\xff"
        sb.exec("echo s > /tmp/locked && chmod 000 /tmp/locked && ln -sf /tmp/locked /testbed/l")
        with pytest.raises(PermissionError, match="^/testbed/l -> /tmp/locked: permission denied"):
            sb.read_file("/testbed/l")
        t = sb.exec("sleep 30", timeout=1)
        assert t.timed_out and sb.exec("echo alive").stdout == "alive\n"


def test_under_gvisor_the_keyring_never_reaches_the_host_kernel(
    gvisor: Callable[..., SandboxConfig],
) -> None:
    """gVisor answers every syscall itself: the keyring calls are refused by its kernel
    (EACCES here), never the host's, and there is no /proc/keys to read."""
    with open_sandbox(gvisor("keys")) as sb:
        seen = _probe_in(sb)
        assert {k: seen[k] for k in ("add_key", "keyctl", "request_key")} == {
            "add_key": "EACCES", "keyctl": "EACCES", "request_key": "EACCES",
        }  # fmt: skip
        assert seen["clone3"] == "ENOSYS" and seen["pidfd_getfd"] == "ENOSYS"
        r = sb.exec("cat /proc/keys")
        assert r.exit_code != 0 and "No such file" in r.stderr


@pytest.mark.xfail(
    reason="does not hold here (2026-11-26, Debian runsc 0.0~20221219, ptrace platform, "
    "Docker 20.10): the dirty episode's 44-line script never finishes under gVisor (the "
    "shell gets SIGHUP at the timeout, 120 s and 30 s: status 129, bash 'wait_for: No record of "
    "process 20'), while its first 26 lines, and its last part alone, do; not pinned down",
    strict=False,
)
def test_the_reset_battery_holds_under_gvisor(gvisor: Callable[..., SandboxConfig]) -> None:
    """A pooled gVisor sandbox after the dirty episode: the next lease observes exactly what
    a fresh sandbox does on every probe. gVisor has no /proc/sysvipc, so the reset cannot
    prove IPC objects gone and fails closed: the sandbox is replaced, never reused."""
    with open_sandbox(gvisor("fresh-probe")) as fresh:
        expected = _observe(fresh)
    pool = SandboxPool(gvisor("pooled"), PoolSettings())
    try:
        sb = pool.acquire(gvisor("dirty"))
        name = sb.name
        dirty = sb.exec(DIRTY, timeout=30)  # runc: ~2 s
        assert dirty.exit_code == 0, dirty.stderr
        assert _observe(sb)["processes"] != expected["processes"]
        sb.close()
        deadline = time.monotonic() + 60
        while pool.stats.resets < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        again = pool.acquire(gvisor("next"), timeout=120)
        after = _observe(again)
        for probe in PROBES:
            assert after[probe] == expected[probe], (
                f"probe {probe!r} tells the next lease from fresh"
            )
        assert again.name != name and pool.stats.resets_failed == 1, pool.stats
        again.close()
    finally:
        pool.close()
        for slot in list(pool._slots):  # a lease the failed check never gave back
            slot.box.kill()


def test_the_runtime_setting_reaches_the_engine(
    sandbox_image: str, test_run_id: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SANDFLOW_SANDBOX_RUNTIME -> the settings -> RunSpec -> SandboxConfig.runtime -> the
    engine: a runtime the engine does not have is refused at start, naming it (runs on any
    engine, runsc or not)."""
    from sandbox import SandboxError
    from sandflow.commands.pipeline import _run_spec
    from sandflow.config import load_settings

    monkeypatch.setenv("SANDFLOW_SANDBOX_RUNTIME", "sandflow-no-such-runtime")
    cfg = _run_spec(load_settings(), run_id=test_run_id).to_sandbox_config()
    assert cfg.runtime == "sandflow-no-such-runtime"
    with pytest.raises(SandboxError, match="sandflow-no-such-runtime"):
        open_sandbox(cfg.model_copy(update={"limits": SandboxLimits(memory_mb=256)}))
