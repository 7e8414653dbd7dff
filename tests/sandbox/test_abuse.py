"""What a model may do to its computer: each is contained, typed, and nobody else suffers."""

from __future__ import annotations

import ast
import os
import time
from collections.abc import Callable

import pytest

from sandbox import Sandbox


def test_fork_bomb_is_contained(fresh: Callable[..., Sandbox], box: Sandbox) -> None:
    sb = fresh("forkbomb", pids=64)
    r = sb.exec(":(){ :|:& };:", timeout=5)
    assert r.exit_code is not None  # a typed result, not an exception
    r = sb.exec("echo alive; ps -e --no-headers | wc -l", timeout=10)
    assert r.stdout.startswith("alive\n")
    assert int(r.stdout.split()[1]) < 10, "the bomb's processes must be gone"
    assert box.exec("echo neighbour ok").stdout == "neighbour ok\n"


def test_a_fork_bomb_that_starts_late_is_ended_before_the_next_command(
    fresh: Callable[..., Sandbox],
) -> None:
    sb = fresh("forkbomb-late", pids=64)
    # two quiet processes when the command ends (not multiplying yet): left alone
    assert sb.exec("(sleep 0.5; b() { b | b & }; b) & true").exit_code == 0
    time.sleep(1.5)  # it has multiplied up to the pids limit since
    r = sb.exec("echo alive", timeout=10)
    assert r.stdout == "alive\n"
    assert "runaway processes" in r.stderr, r.stderr
    assert int(sb.exec("ps -e --no-headers | wc -l").stdout) < 10


def test_background_processes_that_do_not_multiply_are_left_alone(box: Sandbox) -> None:
    box.exec("sleep 1000 & sleep 1001 & sleep 1002 & true")
    for _ in range(5):
        r = box.exec("true")
        assert r.exit_code == 0 and r.stderr == ""
    assert box.exec("pgrep -c -f 'sleep 100[012]'").stdout == "3\n"
    box.exec("pkill -f 'sleep 100[012]'")


def test_foreground_fork_bomb_times_out(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh("forkbomb-fg", pids=64)
    r = sb.exec("bomb() { bomb | bomb; }; bomb", timeout=3)
    assert r.timed_out or r.exit_code != 0
    assert sb.exec("echo alive", timeout=10).stdout == "alive\n"


def test_memory_hog_is_oom_killed_and_flagged(box: Sandbox) -> None:
    limit = box.config.limits.memory_mb
    r = box.exec(
        f"python3 -c 'x = bytearray({limit * 2} * 1024 * 1024); print(len(x))'", timeout=60
    )
    assert r.oom_killed and r.exit_code == 137 and not r.ok
    assert box.exec("echo after oom").stdout == "after oom\n"


def test_writing_outside_the_workdir_is_refused(box: Sandbox) -> None:
    r = box.exec(
        "touch /etc/sandflow-x; echo $?; touch /sandflow-x; echo $?; touch /usr/bin/x; echo $?"
    )
    assert r.stdout.split() == ["1", "1", "1"]
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr
    r = box.exec("touch /testbed/ok /tmp/ok ~/ok && echo writable")
    assert r.stdout == "writable\n"


def test_scratch_space_is_bounded(fresh: Callable[..., Sandbox]) -> None:
    sb = fresh("disk", tmp_size_mb=32, memory_mb=256)
    r = sb.exec(
        "head -c 100M /dev/zero > /testbed/fill; echo rc=$?; du -sm /testbed | cut -f1", timeout=30
    )
    assert "No space left on device" in r.stderr
    assert int(r.stdout.split()[-1]) <= 32
    # A full /tmp must not break the session, not even for a big command.
    sb.exec("head -c 100M /dev/zero > /tmp/fill", timeout=30)
    big = "echo " + "y" * 40_000 + " | wc -c"
    assert sb.exec(big).stdout == "40001\n"


def test_no_network_under_policy_none(box: Sandbox) -> None:
    assert box.config.limits.network == "none"
    r = box.exec(
        "python3 -c \"import socket; s=socket.socket(); s.settimeout(3); s.connect(('10.0.0.1', 80))\"",
        timeout=20,
    )
    assert r.exit_code != 0 and "unreachable" in r.stderr.lower()
    r = box.exec('python3 -c "import socket; print(sorted(n for _, n in socket.if_nameindex()))"')
    assert r.stdout.strip() == "['lo']"


def test_kill_the_session_shell(box: Sandbox) -> None:
    box.exec("cd /tmp && export GONE=1")
    r = box.exec("echo before; kill -9 $$")
    assert r.shell_restarted and r.exit_code == 137 and r.stdout == "before\n"
    assert "new shell" in r.stderr
    r = box.exec('pwd; echo "[$GONE]"')
    assert r.stdout == f"{box.config.workdir}\n[]\n" and not r.shell_restarted


def test_exit_the_session_shell(box: Sandbox) -> None:
    r = box.exec("exit 7")
    assert r.shell_restarted and r.exit_code == 7
    assert box.exec("echo fine").stdout == "fine\n"


def test_cannot_kill_pid_1(box: Sandbox) -> None:
    r = box.exec("kill -9 1; kill -TERM 1; kill -INT 1; echo tried")
    assert "tried" in r.stdout
    assert box.exec("echo still here").stdout == "still here\n"


def test_host_environment_is_invisible(
    make_config: Callable[..., object], monkeypatch: pytest.MonkeyPatch
) -> None:
    from sandbox import open_sandbox

    secret = "sk-sandflow-test-" + os.urandom(6).hex()
    monkeypatch.setenv("SANDFLOW_API_KEY", secret)
    monkeypatch.setenv("OPENAI_API_KEY", secret)
    with open_sandbox(make_config("env")) as sb:  # type: ignore[arg-type]
        r = sb.exec("env; cat /proc/1/environ; grep -rs sk-sandflow /proc/*/environ; echo end")
        assert secret not in r.stdout + r.stderr
        assert "SANDFLOW_API_KEY" not in r.stdout
        assert r.stdout.endswith("end\n")


def test_config_env_reaches_the_shell(make_config: Callable[..., object]) -> None:
    from sandbox import open_sandbox

    config = make_config("env2")
    config.env = {"TASK_ID": "t-42"}  # type: ignore[attr-defined]
    with open_sandbox(config) as sb:  # type: ignore[arg-type]
        assert sb.exec("echo $TASK_ID").stdout == "t-42\n"


def test_pip_install_user_works(box: Sandbox) -> None:
    box.write_file("/testbed/pkg/sfdemo/__init__.py", "VALUE = 42\n")
    box.write_file(
        "/testbed/pkg/pyproject.toml",
        '[project]\nname = "sfdemo"\nversion = "0.1"\n'
        '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n',
    )
    r = box.exec(
        "cd /testbed/pkg && pip install --user --no-index --no-build-isolation -q . && "
        "cd / && python3 -c 'import sfdemo; print(sfdemo.VALUE)'",
        timeout=120,
    )
    assert r.stdout.strip().endswith("42"), r.stderr


def test_network_policy_host_is_honoured(fresh: Callable[..., Sandbox]) -> None:
    # (`bridge` needs the engine's docker0 bridge, which this test machine's engine lacks.)
    sb = fresh("net-host", network="host")
    r = sb.exec('python3 -c "import socket; print(sorted(n for _, n in socket.if_nameindex()))"')
    names = ast.literal_eval(r.stdout)
    assert "lo" in names and len(names) > 1


def test_shell_killed_between_commands(box: Sandbox) -> None:
    box.exec("export LOST=1; (sleep 0.3; kill -9 $$) >/dev/null 2>&1 &")
    import time

    time.sleep(1.0)
    r = box.exec('echo "[$LOST]"')
    assert r.shell_restarted and r.stdout == "[]\n" and "between commands" in r.stderr
    assert not box.exec("true").shell_restarted


def test_broken_end_marker_is_detected_without_waiting_for_the_timeout(box: Sandbox) -> None:
    r = box.exec("printf() { :; }; echo visible", timeout=60)
    assert r.shell_restarted and not r.timed_out  # detected long before the 60 s timeout
    assert r.stdout.startswith("visible") and "end-of-command marker" in r.stderr
    assert box.exec("printf 'ok'").stdout == "ok"
