"""Isolation from the host and between sandboxes: the syscall filter, the uid, the keyring.

Issue #22 item 10: a bwrap sandbox had no seccomp filter (add_key worked, and the user
keyring was shared with every host process and every sandbox of uid 1000, a real host
account). Each test runs on both backends: the bwrap filter (sandbox/seccomp.py) must
refuse what Docker's default profile refuses.
"""

from __future__ import annotations

import ctypes
import json
import pwd
import secrets
import subprocess
import sys
from collections.abc import Callable

import pytest

from sandbox import Sandbox, SandboxConfig, SandboxError, open_sandbox
from sandbox.common import SANDBOX_UID

# Each call is one the kernel answers without a capability when no filter stands in the
# way (success, or an error other than EPERM): so EPERM (ENOSYS for clone3) can only come
# from the filter. Arguments are harmless: a process keyring (gone with the process),
# a bad fd, flags 0, a NULL attribute pointer.
PROBE = r"""
import ctypes, errno, json, os, socket, sys
nr = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(name, *args):
    ctypes.set_errno(0)
    r = libc.syscall(ctypes.c_long(nr[name]), *[ctypes.c_long(a) if isinstance(a, int) else a for a in args])
    return "ok" if r >= 0 else errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
KEY_SPEC_PROCESS_KEYRING, KEY_SPEC_USER_KEYRING = -2, -4
out = {
    "add_key": call("add_key", b"user", b"sandflow-probe", b"v", 1, KEY_SPEC_PROCESS_KEYRING),
    "keyctl": call("keyctl", 0, KEY_SPEC_USER_KEYRING, 0),  # KEYCTL_GET_KEYRING_ID
    "request_key": call("request_key", b"user", b"sandflow-none", None, 0),
    "userfaultfd": call("userfaultfd", 1),  # UFFD_USER_MODE_ONLY: no privilege needed
    "perf_event_open": call("perf_event_open", None, 0, -1, -1, 0),
    "unshare": call("unshare", 0),
    "setns": call("setns", -1, 0),
    "pidfd_getfd": call("pidfd_getfd", -1, 0, 0),
    "clone3": call("clone3", None, 0),
    "personality": call("personality", 0x0400000),  # READ_IMPLIES_EXEC
}
try:
    socket.socket(40, socket.SOCK_STREAM).close()  # AF_VSOCK
    out["socket_vsock"] = "ok"
except OSError as e:
    out["socket_vsock"] = errno.errorcode.get(e.errno, str(e.errno))
print(json.dumps(out, sort_keys=True))
"""
REFUSED = {
    "add_key": "EPERM",
    "keyctl": "EPERM",
    "request_key": "EPERM",
    "userfaultfd": "EPERM",
    "perf_event_open": "EPERM",
    "unshare": "EPERM",
    "setns": "EPERM",
    "pidfd_getfd": "EPERM",
    "clone3": "ENOSYS",
    "personality": "EPERM",
    "socket_vsock": "EPERM",
}


def _numbers() -> dict[str, int]:
    import pyseccomp as sc

    return {n: sc.resolve_syscall(sc.Arch.NATIVE, n) for n in REFUSED if n != "socket_vsock"}


def _probe_in(sb: Sandbox) -> dict[str, str]:
    sb.write_file("/tmp/probe.py", PROBE)
    r = sb.exec(f"python3 /tmp/probe.py '{json.dumps(_numbers())}'", timeout=60)
    assert r.exit_code == 0, r.stderr
    return dict(json.loads(r.stdout))


def test_the_filter_refuses_what_dockers_default_profile_refuses(
    box: Sandbox, backend: str
) -> None:
    """add_key, keyctl, request_key, userfaultfd, perf_event_open, unshare, setns,
    pidfd_getfd, clone3, personality, AF_VSOCK: refused inside, on both backends."""
    seen = _probe_in(box)
    expected = dict(REFUSED)
    if backend == "docker":  # AF_VSOCK entered Docker's default profile after Docker 20.10
        expected["socket_vsock"] = seen["socket_vsock"]
    assert seen == expected, f"{backend}: not refused: " + ", ".join(
        f"{k}={v}" for k, v in seen.items() if expected[k] != v
    )
    r = box.exec("grep -E '^(Seccomp|NoNewPrivs):' /proc/self/status; unshare -U true; echo $?")
    assert "Seccomp:\t2" in r.stdout and "NoNewPrivs:\t1" in r.stdout
    assert r.stdout.strip().endswith("1") and "Operation not permitted" in r.stderr


def test_the_probe_tells_a_filter_from_no_filter() -> None:
    """The same probe on the host, as the sandbox's uid without capabilities and without a
    filter: none of its calls fails with the filter's answer (so the test above can fail)."""
    uid = str(SANDBOX_UID)
    r = subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--inh-caps=-all",
         "--", "/usr/bin/python3", "-c", PROBE, json.dumps(_numbers())],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    same = {k: v for k, v in seen.items() if REFUSED[k] == v and k != "perf_event_open"}
    # perf_event_open may be EPERM by the host's perf_event_paranoid; everything else must
    # differ from the filter's answer
    assert same == {}, f"without a filter these calls already fail like with one: {same}"


def test_the_sandbox_uid_is_no_host_account(box: Sandbox) -> None:
    with pytest.raises(KeyError):
        pwd.getpwuid(SANDBOX_UID)
    r = box.exec("id -u; id -g; id -un; touch /testbed/owned && stat -c '%u %U' /testbed/owned")
    assert r.stdout.split() == [
        str(SANDBOX_UID),
        str(SANDBOX_UID),
        "sandbox",
        str(SANDBOX_UID),
        "sandbox",
    ]
    assert SANDBOX_UID != 1000 and SANDBOX_UID < 2**31
    box.exec("rm -f /testbed/owned")


def _add_host_key(description: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    import pyseccomp as sc

    nr = sc.resolve_syscall(sc.Arch.NATIVE, "add_key")
    serial = libc.syscall(
        ctypes.c_long(nr), b"user", description.encode(), b"host-secret", ctypes.c_long(11),
        ctypes.c_long(-4),  # KEY_SPEC_USER_KEYRING: every process of this uid sees it
    )  # fmt: skip
    if serial < 0:
        pytest.skip(f"the host refuses add_key here (errno {ctypes.get_errno()})")
    return int(serial)


def _revoke(serial: int) -> None:
    import pyseccomp as sc

    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(
        ctypes.c_long(sc.resolve_syscall(sc.Arch.NATIVE, "keyctl")),
        ctypes.c_long(3),
        ctypes.c_long(serial),
    )  # fmt: skip  (KEYCTL_REVOKE)


def test_a_key_added_on_the_host_is_not_visible_inside(box: Sandbox) -> None:
    """A key in the host's user keyring (the test's uid): listed in the host's /proc/keys,
    neither listed nor reachable in the sandbox (/proc/keys masked, keyctl refused)."""
    token = f"sandflow-host-{secrets.token_hex(4)}"
    serial = _add_host_key(token)
    try:
        with open("/proc/keys") as f:
            assert token in f.read(), "the control failed: the host cannot list its own key"
        r = box.exec(f"cat /proc/keys /proc/key-users 2>&1; grep -rs {token} /proc/keys; echo end")
        assert token not in r.stdout and r.stdout.rstrip().endswith("end")
        assert _probe_in(box)["keyctl"] == "EPERM"
    finally:
        _revoke(serial)


def test_a_key_cannot_pass_from_one_sandbox_to_the_next(
    fresh: Callable[..., Sandbox],
) -> None:
    """The original attack: a key added in one episode, read back by the next sandbox."""
    first = fresh("keys-1")
    r = first.exec(
        'python3 -c "import ctypes; l = ctypes.CDLL(None, use_errno=True); '
        f"print(l.syscall({_numbers()['add_key']}, b'user', b'left', b'secret', 6, -4), ctypes.get_errno())\""
    )
    assert r.stdout.split() == ["-1", "1"], r.stdout + r.stderr  # EPERM
    second = fresh("keys-2")
    assert "left" not in second.exec("cat /proc/keys 2>&1").stdout


def test_a_bwrap_sandbox_without_its_filter_does_not_start(
    make_config: Callable[..., SandboxConfig], backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No libseccomp binding: the bwrap backend refuses to start, naming what is missing."""
    if backend != "bwrap":
        pytest.skip("the docker engine applies its own default profile")
    from sandbox import seccomp

    seccomp.program.cache_clear()
    monkeypatch.setitem(sys.modules, "pyseccomp", None)  # import fails
    try:
        with pytest.raises(SandboxError, match="seccomp filter.*pyseccomp.*libseccomp2"):
            open_sandbox(make_config("no-filter"))
    finally:
        monkeypatch.undo()
        seccomp.program.cache_clear()
    assert seccomp.unavailable() is None
