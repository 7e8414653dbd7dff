"""exec(): the persistent session, timeouts, output caps, binary output (both backends)."""

from __future__ import annotations

from sandbox import ExecResult, Sandbox
from sandbox.common import SANDBOX_UID


def test_exec_basics(box: Sandbox) -> None:
    r = box.exec("echo out; echo err >&2; true")
    assert isinstance(r, ExecResult)
    assert (r.stdout, r.stderr, r.exit_code) == ("out\n", "err\n", 0)
    assert r.ok and not r.timed_out and not r.truncated and r.duration_s > 0

    r = box.exec("printf 'no newline'; false")
    assert (r.stdout, r.exit_code, r.ok) == ("no newline", 1, False)


def test_runs_as_unprivileged_user(box: Sandbox) -> None:
    r = box.exec("id -u; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status")
    lines = r.stdout.split()
    assert lines[0] == str(SANDBOX_UID)  # no host account (tests/sandbox/test_isolation.py)
    status = dict(zip(lines[1::2], lines[2::2], strict=True))
    assert status == {
        "CapEff:": "0000000000000000",
        "CapBnd:": "0000000000000000",
        "NoNewPrivs:": "1",
    }


def test_cd_and_export_persist(box: Sandbox) -> None:
    box.exec("mkdir -p /tmp/persist && cd /tmp/persist && export SF_TEST_VAR='a b'")
    r = box.exec('pwd; echo "$SF_TEST_VAR"')
    assert r.stdout == "/tmp/persist\na b\n"
    box.exec("false")
    assert box.exec("echo $?").stdout == "1\n"  # like a terminal: the previous command's status
    box.exec("cd /testbed")


def test_command_cannot_read_the_protocol_stream(box: Sandbox) -> None:
    # A command reading stdin must get EOF, not the helper's next request.
    r = box.exec("cat; read x; echo done $?", timeout=10)
    assert r.stdout == "done 1\n" and not r.timed_out
    assert box.exec("echo next").stdout == "next\n"


def test_syntax_error_does_not_hang(box: Sandbox) -> None:
    r = box.exec("echo 'unclosed", timeout=10)
    assert r.exit_code == 2 and not r.timed_out and "unexpected EOF" in r.stderr
    assert box.exec("echo fine").stdout == "fine\n"


def test_nul_in_command_is_a_result(box: Sandbox) -> None:
    r = box.exec("echo a\0b")
    assert r.exit_code == 2 and "NUL" in r.stderr


def test_timeout_kills_tree_keeps_partial_output_and_session(box: Sandbox) -> None:
    box.exec("cd /tmp && export KEEP=me")
    r = box.exec(
        "echo started; (sleep 300 &) ; setsid sleep 301 & bash -c 'sleep 302' & sleep 303",
        timeout=1.5,
    )
    assert r.timed_out and r.exit_code is not None and r.exit_code >= 124
    assert r.stdout.startswith("started\n")
    left = box.exec("ps -eo args | grep -c '^sleep 30[0-3]' || true")
    assert left.stdout.strip() == "0", "the whole process tree must be gone, even setsid/orphans"
    # The shell itself was not stuck, so it survived: state is intact.
    r = box.exec("pwd; echo $KEEP")
    assert r.stdout == "/tmp\nme\n" and not r.shell_restarted
    box.exec("cd /testbed")


def test_timeout_in_a_shell_builtin_loop_restarts_the_shell(box: Sandbox) -> None:
    r = box.exec("echo spinning; while :; do :; done", timeout=1)
    assert r.timed_out and r.shell_restarted
    assert r.stdout == "spinning\n"
    assert "new shell" in r.stderr
    assert box.exec("echo back").stdout == "back\n"


def test_background_jobs_survive_between_commands(box: Sandbox) -> None:
    box.exec("sleep 30 & echo $! > /tmp/bgpid")
    r = box.exec("kill -0 $(cat /tmp/bgpid) && echo alive; kill $(cat /tmp/bgpid)")
    assert r.stdout == "alive\n"


def test_output_cap_keeps_head_and_tail_with_notice(box: Sandbox) -> None:
    cap = box.config.limits.output_cap_bytes
    body = 1_000_000
    r = box.exec(f"python3 -c \"import sys; sys.stdout.write('HEAD' + 'x' * {body} + 'TAIL')\"")
    total = body + 8
    assert r.truncated and r.dropped_bytes == total - cap
    assert r.stdout.startswith("HEAD") and r.stdout.endswith("TAIL")
    assert f"[... {total - cap} bytes dropped ...]" in r.stdout
    assert len(r.stdout) < cap + 100
    # stderr is capped on its own
    r = box.exec(f"python3 -c \"import sys; sys.stderr.write('e' * {body})\"; echo ok")
    assert r.stdout == "ok\n" and r.truncated and "bytes dropped" in r.stderr


def test_binary_output_never_crashes(box: Sandbox) -> None:
    r = box.exec("head -c 65536 /dev/urandom; printf '\\xff\\xfe\\x00tail'")
    assert r.exit_code == 0 and isinstance(r.stdout, str)
    assert r.stdout.endswith("\x00tail")
    assert "\ufffd" in r.stdout  # undecodable bytes become U+FFFD, never an exception


def test_print_forever_is_cut_by_timeout_and_cap(box: Sandbox) -> None:
    r = box.exec("yes sandflow", timeout=1.5)
    assert r.timed_out and r.truncated and r.dropped_bytes > 0
    assert r.stdout.startswith("sandflow\n")
    assert len(r.stdout) <= box.config.limits.output_cap_bytes + 100
    assert box.exec("echo ok").stdout == "ok\n"


def test_sleep_forever_times_out(box: Sandbox) -> None:
    r = box.exec("sleep infinity", timeout=1)
    assert r.timed_out and not r.ok
    assert box.exec("echo ok").stdout == "ok\n"


def test_exec_redirections_last_one_command(box: Sandbox) -> None:
    r = box.exec("exec > /tmp/redir.log 2>&1; echo hidden; echo err >&2")
    assert (r.stdout, r.stderr, r.exit_code) == ("", "", 0)
    assert box.exec("cat /tmp/redir.log").stdout == "hidden\nerr\n"
    r = box.exec("exec < /dev/zero; echo still reading commands")
    assert r.stdout == "still reading commands\n"
    assert box.exec("echo next").stdout == "next\n" and not box.exec("true").shell_restarted


def test_big_command_roundtrip(box: Sandbox) -> None:
    import hashlib

    body = "".join(f"line {i}: $HOME `x` 'q' \"d\" \\\\ {'é' * (i % 7)}\n" for i in range(4000))
    cmd = (
        f"cat > /tmp/heredoc.txt <<'SF_END'\n{body}SF_END\nsha256sum /tmp/heredoc.txt | cut -c1-64"
    )
    assert len(cmd.encode()) > 100_000
    r = box.exec(cmd, timeout=30)
    assert r.stdout.strip() == hashlib.sha256(body.encode()).hexdigest(), r.stderr
    small = box.exec("echo small after big")
    assert small.stdout == "small after big\n"
