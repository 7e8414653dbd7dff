"""The in-sandbox helper: PID 1 of every sandbox, speaking a framed protocol on stdin/stdout.

This file is *sent into* the sandbox and run by the image's own python3 (`-I -S`, stdlib
only, Python >= 3.9; as host-compiled bytecode when the versions match, see
sandbox/protocol.py); it is never imported on the host. Why a helper instead of one
`docker exec` per command: a persistent bash session costs a few milliseconds per
command instead of a ~60 ms exec round trip, `cd`/`export` carry over like in a real
terminal, and one small process can enforce what the engine cannot see per command
(timeouts that kill the whole process tree, output caps, OOM evidence).

Why PID 1: the kernel ignores signals to a namespace's init unless it installed a handler,
so a model running `kill -9 1` cannot take the sandbox down; when the host disconnects
(stdin EOF) the helper exits and the engine removes the container (auto-remove).

The channel is out of the sandbox user's reach, by two independent layers:
- privilege separation: the backends start the helper as uid 0 with only CAP_SETUID,
  CAP_SETGID, CAP_KILL and CAP_SETPCAP (no-new-privileges); every process it spawns drops
  to the sandbox user (SANDFLOW_UID, its bounding set emptied, so no capability at all)
  before it runs anything. The helper's own file access runs with that user's fs ids, so
  files it writes belong to the sandbox user and it reads nothing that user could not.
  A process of another uid cannot signal, ptrace or open /proc/1/* of the helper.
- non-dumpable: the helper marks itself PR_SET_DUMPABLE 0, so /proc/1/fd, fdinfo, mem,
  environ, root, cwd belong to root and ptrace/pidfd_getfd are refused, even to the same
  uid (the only layer where the sandbox has a single uid: unprivileged bubblewrap).
Children inherit no fd of the helper (all closed before exec).

Protocol. Every message is one JSON header line, optionally followed by `len` raw bytes.
Host -> helper: {"op": "exec"|"put"|"get"|"reset"|"lifetime"|"ping"|"exit", "id": n, ...}.
Helper -> host: {"id": n, ...}; the very first line is {"ready": true, ...}. A `get`
answers with data frames {"id": n, "data": 1, "len": k} (k <= its `chunk`), then one
final {"id": n, "ok": ..., "summary": {...}}: the archive is streamed, never held.
"""

import contextlib
import io
import json
import os
import select
import signal
import stat
import sys
import time

STDIN = 0
STDOUT = 1
WORKDIR = os.environ.get("SANDFLOW_WORKDIR", "/testbed")
OOM_FILES = (
    os.environ.get("SANDFLOW_OOM_FILE", ""),
    "/sys/fs/cgroup/memory/memory.oom_control",
    "/sys/fs/cgroup/memory.events",
)
PIDS_LIMIT = int(os.environ.get("SANDFLOW_PIDS_LIMIT", "0") or 0)
LIFETIME_S = float(os.environ.get("SANDFLOW_LIFETIME_S", "0") or 0)
# places on a filesystem other sandboxes share (bwrap's btrfs volumes): its free space
# says nothing of this sandbox, so a reset does not compare it
SHARED_FS_PLACES = tuple(p for p in os.environ.get("SANDFLOW_SHARED_FS_PLACES", "").split(":") if p)
KILL_GRACE_S = 2.0
READ_SYSCALL = {"x86_64": "0", "aarch64": "63"}.get(os.uname().machine)
T_START = time.monotonic()
SANDBOX_UID = int(os.environ.get("SANDFLOW_UID") or 2100000000)  # the backends always set it
SANDBOX_GID = int(os.environ.get("SANDFLOW_GID") or SANDBOX_UID)
PRIVSEP = os.getuid() == 0  # started as root (with a few capabilities): children drop to the user
MAXFD = 1 << 20


# ----------------------------------------------------------------------------- privileges

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
LIBC = None


def protect_self():
    """Make PID 1 unreachable for the sandbox user; returns what holds (for the ready line).

    Non-dumpable: /proc/1/* becomes root's and ptrace access is refused even to the same
    uid. With privilege separation, file system ids become the sandbox user's (the helper
    touches files exactly as that user would) and supplementary groups are dropped.
    """
    global LIBC
    import ctypes

    LIBC = ctypes.CDLL(None, use_errno=True)
    if PRIVSEP:
        os.setgroups([])
        LIBC.setfsgid(SANDBOX_GID)
        LIBC.setfsuid(SANDBOX_UID)
        # setfs*id never fail visibly: an invalid id (-1) returns the current one
        if LIBC.setfsuid(-1) != SANDBOX_UID or LIBC.setfsgid(-1) != SANDBOX_GID:
            raise OSError("setfsuid/setfsgid to the sandbox user failed")
    LIBC.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    dumpable = LIBC.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0)
    if dumpable != 0:
        raise OSError(f"cannot mark the helper non-dumpable (PR_GET_DUMPABLE={dumpable})")
    return {"privsep": PRIVSEP, "dumpable": dumpable, "uid": os.getuid()}


def become_sandbox_user():
    """In a forked child, before it runs anything: no capability, the sandbox user's ids.

    Fails closed (the child exits) when the identity cannot be reached.
    """
    if not PRIVSEP:
        return
    if LIBC is None:  # protect_self() did not run: never hand out our capabilities
        os._exit(126)
    for cap in range(64):  # the bounding set, while CAP_SETPCAP is still ours
        if LIBC.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break  # EINVAL past the last capability this kernel knows
    os.setresgid(SANDBOX_GID, SANDBOX_GID, SANDBOX_GID)
    os.setresuid(SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)  # from uid 0: the kernel clears all caps
    if os.getresuid() != (SANDBOX_UID,) * 3 or os.getresgid() != (SANDBOX_GID,) * 3:
        os._exit(126)


def as_sandbox_user(stdin, stdout, stderr):
    """In a forked child about to exec: these std fds and no other, default signals, the
    fallback rlimits, the sandbox user's identity (no capability)."""
    os.dup2(stdin, 0)
    os.dup2(stdout, 1)
    os.dup2(stderr, 2)
    close_inherited_fds()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGPIPE, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    apply_rlimits()
    become_sandbox_user()


def close_inherited_fds():
    """Everything above stdin/stdout/stderr: no child holds a descriptor of the helper's."""
    os.closerange(3, MAXFD)


# ----------------------------------------------------------------------------- framing


class Channel:
    """Buffered reads from the host: header lines, and payloads through PayloadReader.
    `fd`: stdin, or a fork's bulk connection (bulk_connect)."""

    def __init__(self, fd=STDIN) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.eof = False

    def fill(self, timeout):
        """Read what is available within `timeout`; False when nothing arrived."""
        if self.eof:
            return False
        r, _, _ = select.select([self.fd], [], [], timeout)
        if not r:
            return False
        chunk = os.read(self.fd, 1 << 20)
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def line(self):
        """A complete header line if one is buffered, else None."""
        i = self.buf.find(b"\n")
        if i < 0:
            return None
        out = bytes(self.buf[:i])
        del self.buf[: i + 1]
        return out


def send(msg, payload=b"", fd=STDOUT):
    """One message to the host: a JSON header line, then `len` payload bytes (on stdout, or
    on a fork's bulk connection)."""
    if payload:
        msg["len"] = len(payload)
    head = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    if len(payload) > 65536:  # a data frame: no copy of it just to prepend the header
        write_all(head, fd)
        write_all(payload, fd)
    else:
        write_all(head + payload, fd)


def write_all(data, fd=STDOUT):
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


# ----------------------------------------------------------------------------- processes


def proc_table():
    """{pid: starttime} for every process visible in this pid namespace."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        rest = stat[stat.rfind(b")") + 2 :].split()
        out[int(name)] = int(rest[19])
    return out


def kill_new(before, keep):
    """SIGKILL every process not in the `before` snapshot (pid + start time) nor in `keep`.

    Stop-then-kill in rounds so a forking tree cannot outrun us; returns False when it
    would not converge (a fork bomb at the pids limit), so the caller escalates.
    """
    for _ in range(40):
        victims = [
            pid for pid, st in proc_table().items() if pid not in keep and before.get(pid) != st
        ]
        if not victims:
            return True
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in victims:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
        reap()
        time.sleep(0.005)
    return False


def kill_all():
    """kill(-1): every process we may signal except ourselves; atomic against fork bombs."""
    if os.getpid() != 1:  # only ever inside our own pid namespace
        return
    for _ in range(5):
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
        reap()
        time.sleep(0.01)


DEAD: dict = {}  # pid -> wait status of children we reaped


def reap():
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        DEAD[pid] = status


BIG_COMMAND = 16384


def runaway(count, recount):
    """Near the pids limit, or still multiplying shortly after (a fork bomb in the background).

    Costs a 30-80 ms look only when a command left at least two processes behind.
    """
    if count >= 0.5 * PIDS_LIMIT:
        return True
    if count < 2:
        return False
    for pause in (0.03, 0.05):
        time.sleep(pause)
        again = recount()
        if again >= 0.5 * PIDS_LIMIT or (again >= 6 and again >= 2 * count):
            return True
        if again <= count:
            return False
        count = again
    return False


def oom_count():
    for path in OOM_FILES:
        if not path:
            continue
        try:
            with open(path) as f:
                for line in f:
                    key, _, val = line.partition(" ")
                    if key == "oom_kill":
                        return int(val)
        except (OSError, ValueError):
            continue
    return -1


# ----------------------------------------------------------------------------- shell


def apply_rlimits():
    """Fallback limits when no cgroup bounds the sandbox (bubblewrap without root)."""
    spec = os.environ.get("SANDFLOW_RLIMITS", "")
    if not spec:
        return
    import resource

    for item in spec.split(","):
        name, _, value = item.partition("=")
        which = getattr(resource, "RLIMIT_" + name, None)
        if which is not None and value.isdigit():
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(which, (int(value), int(value)))


class Shell:
    """One long-lived `bash --noprofile --norc` with separate stdout/stderr pipes."""

    def __init__(self):
        self.pid = 0
        self.start()

    def start(self):
        r_in, w_in = os.pipe()
        r_out, w_out = os.pipe()
        r_err, w_err = os.pipe()
        pid = os.fork()
        if pid == 0:  # child
            try:
                os.setsid()
                as_sandbox_user(r_in, w_out, w_err)
                try:
                    os.chdir(WORKDIR)
                except OSError:
                    os.chdir("/")
                env = {k: v for k, v in os.environ.items() if not k.startswith("SANDFLOW_")}
                os.execve("/bin/bash", ["bash", "--noprofile", "--norc"], env)
            finally:
                os._exit(127)
        for fd in (r_in, w_out, w_err):
            os.close(fd)
        self.pid, self.stdin, self.out, self.err = pid, w_in, r_out, r_err
        try:
            link = os.readlink(f"/proc/self/fd/{w_in}")
        except OSError:
            link = ""
        self.stdin_link = link
        # A no-op function restores `$?` so `echo $?` reports the model's previous command.
        # Keep the protocol's own output fds (198, 199) so a command's `exec >log` lasts for
        # that command only. (stdin needs nothing: eval's own `</dev/null` is undone after it.)
        self.write(b"__sf_rc() { return $1; }; exec 198>&1 199>&2\n")

    def write(self, data):
        view = memoryview(data)
        while view:
            n = os.write(self.stdin, view)
            view = view[n:]

    def alive(self):
        reap()
        return self.pid not in DEAD

    def kill(self):
        with contextlib.suppress(OSError):
            os.kill(self.pid, signal.SIGKILL)
        for fd in (self.stdin, self.out, self.err):
            with contextlib.suppress(OSError):
                os.close(fd)
        pause = 0.0002  # a killed bash is gone in well under a millisecond
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            reap()
            if self.pid in DEAD:
                break
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    def waiting_for_input(self):
        """Is the shell blocked reading its next command from us (syscall read on fd 0)?"""
        if READ_SYSCALL is None or not self.stdin_link:
            return False
        try:
            with open(f"/proc/{self.pid}/syscall") as f:
                fields = f.read().split()
            if len(fields) < 2 or fields[0] != READ_SYSCALL or int(fields[1], 16) != 0:
                return False
            return os.readlink(f"/proc/{self.pid}/fd/0") == self.stdin_link
        except (OSError, ValueError):
            return False

    def exit_status(self):
        status = DEAD.get(self.pid)
        if status is None:
            return None
        if os.WIFSIGNALED(status):
            return 128 + os.WTERMSIG(status)
        return os.WEXITSTATUS(status)


class Capture:
    """One stream of one command: head and tail kept, the middle counted, marker found."""

    def __init__(self, cap, mark):
        self.head_cap = cap // 2
        self.tail_cap = cap - self.head_cap
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0
        self.mark = mark
        self.pending = b""
        self.done = False
        self.after = b""

    def _commit(self, data):
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data
            if len(self.tail) > 2 * self.tail_cap:
                cut = len(self.tail) - self.tail_cap
                del self.tail[:cut]
                self.dropped += cut

    def feed(self, data):
        buf = self.pending + data
        i = buf.find(self.mark)
        if i >= 0:
            self._commit(buf[:i])
            self.pending = b""
            self.after = buf[i + len(self.mark) :]
            self.done = True
            return
        keep = len(self.mark) - 1
        self._commit(buf[:-keep] if len(buf) > keep else b"")
        self.pending = buf[-keep:] if len(buf) > keep else buf

    def finish(self):
        if self.pending:
            self._commit(self.pending)
            self.pending = b""
        if len(self.tail) > self.tail_cap:
            cut = len(self.tail) - self.tail_cap
            del self.tail[:cut]
            self.dropped += cut
        text = self.head.decode("utf-8", "replace")
        if self.dropped:
            text += f"\n[... {self.dropped} bytes dropped ...]\n"
        return text + self.tail.decode("utf-8", "replace")


def read_ready(ready, captures):
    """Feed what each ready stream has to its Capture; False when one is at EOF."""
    for fd in ready:
        try:
            chunk = os.read(fd, 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            return False
        cap = captures[fd]
        if cap.done:
            cap.after += chunk
        else:
            cap.feed(chunk)
    return True


class Job:
    """One command's state while Session.run steps through it."""

    def __init__(self, cmd, cap):
        self.cmd = cmd
        self.mark = (f"__sandflow_{os.urandom(12).hex()}__").encode()
        self.out, self.err = Capture(cap, self.mark), Capture(cap, self.mark)
        self.guard = ""  # notices before the output (a revived shell, a runaway ended)
        self.notice = ""  # a notice after it (a replaced shell, runaways left behind)
        self.restarted = False
        self.before = None  # the process table when the command started
        self.oom0 = -1
        self.t0 = time.monotonic()
        self.duration = 0.0
        self.shell_died = False
        self.timed_out = False
        self.escalated = False  # the timeout's kill had to take every process
        self.lost_marker = False
        self.exit_code = None

    def script(self):
        """The bytes the shell reads: the command, then printing its status and the marker.

        The command travels as data (`read -d ''` of a NUL-terminated string, or `head -c`
        for a big one) and runs through `eval` with stdin at /dev/null."""
        m = self.mark.decode()
        tail = (
            '__sf_rc "${__sf_st:-0}"; eval "$__sf_c" </dev/null; '
            "__sf_st=$?; exec 1>&198 2>&199; unset __sf_c; "
            "printf '%s%d\\n' '" + m + '\' "$__sf_st"; '
            "printf '%s' '" + m + "' >&2\n"
        ).encode()
        raw = self.cmd.encode("utf-8", "surrogateescape")
        if len(raw) > BIG_COMMAND:
            # bash reads a pipe one byte at a time: a big command (a long heredoc) is much
            # faster read by `head` in blocks, straight from the same pipe (no file, nothing
            # the helper would have to create as the sandbox user).
            return b"__sf_c=$(/usr/bin/head -c %d); " % len(raw) + tail + raw
        return b"IFS= read -r -d '' __sf_c; " + tail + raw + b"\0"

    def complete(self):
        """Both end markers seen, and the status line after stdout's."""
        return self.out.done and self.err.done and b"\n" in self.out.after


class Session:
    def __init__(self):
        self.shell = Shell()
        self.idle = {1: bytearray(), 2: bytearray()}  # background output between commands
        self.idle_cap = 65536
        self.died_idle = False
        self.settled = 0  # others() when the last command ended: what is not new since

    def drain_idle(self):
        """Keep background jobs from blocking on a full pipe between commands."""
        for fd, key in ((self.shell.out, 1), (self.shell.err, 2)):
            while True:
                r, _, _ = select.select([fd], [], [], 0)
                if not r:
                    break
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                buf = self.idle[key]
                buf += chunk
                if len(buf) > self.idle_cap:
                    del buf[: len(buf) - self.idle_cap]

    def run(self, chan, cmd, timeout, cap):
        """Run one command in the session shell; every outcome is a result (see _result).

        In named steps: revive a shell that died between commands, end a runaway left from
        before, send the command with its end marker, pump its output until the marker or
        the timeout, conclude (the exit code, or a replaced shell and why), end what the
        command left running away, and build the result.
        """
        job = Job(cmd, cap)
        self._revive(job)
        job.before = self._end_runaway_before(job)
        self._begin(job)
        self._pump(chan, job, job.t0 + timeout)
        job.duration = time.monotonic() - job.t0
        self._conclude(job)
        self.settled = self._end_runaway_after(job)
        return self._result(job)

    def _revive(self, job):
        """A shell that died between commands is replaced, and the result says so."""
        if self.died_idle or not self.shell.alive():
            if not self.died_idle:
                self.restart()
            self.died_idle = False
            job.restarted = True
            job.guard = (
                f"[sandflow: the shell died between commands; a new shell was started in "
                f"{WORKDIR} - the working directory and exported variables were reset]\n"
            )

    def others(self, table):
        """The processes in `table` but us, the shell and a fork's tars (FORK_TOOLS)."""
        ours = {1, os.getpid(), self.shell.pid}
        for tools in FORK_TOOLS.values():
            ours.update(pid for pid, _, _ in tools.procs)
        return [pid for pid in table if pid not in ours]

    def _end_runaway_before(self, job):
        """Saturated by something left running (a background fork bomb): this command could
        not even fork. End everything but us and the shell, and say so. Background
        processes no more numerous than when the last command ended (a server and its
        workers) are not multiplying: no look (it costs 30-80 ms, on every command).
        Returns the process table when nothing was ended (the command's `before`)."""
        if not PIDS_LIMIT:
            return None
        table = proc_table()
        count = len(self.others(table))
        if count < 0.5 * PIDS_LIMIT and count <= self.settled:
            return table
        if not runaway(count, lambda: len(self.others(proc_table()))):
            return table
        if not kill_new({}, {1, os.getpid(), self.shell.pid}):
            kill_all()
        if not self.shell.alive():
            self.restart()
            job.restarted = True
        self.drain_idle()
        self.idle = {1: bytearray(), 2: bytearray()}
        job.guard += (
            f"[sandflow: runaway processes ({len(table)}, pids limit {PIDS_LIMIT}) "
            "were running; all background processes were killed before this command]\n"
        )

    def _begin(self, job):
        """Hand the shell the command and its end marker; background output so far is the
        start of this command's output."""
        self.drain_idle()
        job.out.feed(bytes(self.idle[1]))
        job.err.feed(bytes(self.idle[2]))
        self.idle = {1: bytearray(), 2: bytearray()}
        if job.before is None:
            job.before = proc_table()
        job.oom0 = oom_count()
        job.t0 = time.monotonic()
        try:
            self.shell.write(job.script())
        except OSError:
            job.shell_died = True

    def _pump(self, chan, job, deadline):
        """Read both streams until the end marker (and the exit status line) arrived, the
        shell died, lost the marker, or the timeout ran out (then kill the command's tree
        and wait KILL_GRACE_S more)."""
        out, err = job.out, job.err
        idle_polls = 0
        fds = {self.shell.out: out, self.shell.err: err}
        while not job.shell_died and not job.complete():
            now = time.monotonic()
            if now >= deadline:
                if not job.timed_out:
                    job.timed_out = True
                    if not kill_new(job.before, {1, os.getpid(), self.shell.pid}):
                        kill_all()
                        job.escalated = True
                    deadline = time.monotonic() + KILL_GRACE_S
                    continue
                break  # the shell itself is stuck (a builtin loop): restart it later
            waiting = [
                fd for fd, c in fds.items() if not c.done or (c is out and b"\n" not in out.after)
            ]
            r, _, _ = select.select(waiting + [STDIN], [], [], min(0.5, deadline - now))
            if not r and not job.timed_out:
                # Quiet for 0.5 s: if the shell is already waiting for its next command, the
                # end marker will never come (the command redefined printf/eval or closed
                # our fds). Twice in a row, to be sure; then replace the shell.
                idle_polls = idle_polls + 1 if self.shell.waiting_for_input() else 0
                if idle_polls >= 2:
                    job.lost_marker = True
                    break
            if STDIN in r and not chan.fill(0) and chan.eof:
                raise EOFError("host went away")
            job.shell_died = not read_ready([fd for fd in r if fd != STDIN], fds)

    def _conclude(self, job):
        """The exit code from the status line; else the shell is replaced, saying why."""
        if job.complete() and not job.escalated:
            line, _, rest = job.out.after.partition(b"\n")
            try:
                job.exit_code = int(line)
            except ValueError:
                job.exit_code = None
            self.idle[1] += rest
            self.idle[2] += job.err.after
        else:
            self._replace_shell(job)
        if job.timed_out and job.exit_code is not None and job.exit_code < 124:
            job.exit_code = 124

    def _replace_shell(self, job):
        """The shell exited (`exit`, `kill -9 $$`), got stuck in a builtin loop past the
        timeout, or we had to kill everything: start a fresh one, and say so."""
        for _ in range(100 if job.shell_died else 1):
            if not self.shell.alive():
                break
            time.sleep(0.005)
        status = self.shell.exit_status()
        if status is not None:
            job.exit_code = status
            why = f"the shell exited (status {status})"
        elif job.lost_marker:
            why = (
                "the command broke the session's end-of-command marker (it redefined "
                "printf/eval/exec or closed the session's file descriptors)"
            )
        else:
            why = "the shell did not respond after the timeout"
        if job.timed_out and not kill_new(job.before, {1, os.getpid(), self.shell.pid}):
            kill_all()
        # Drain the dead shell's pipes so no output it wrote is lost.
        for fd, c in ((self.shell.out, job.out), (self.shell.err, job.err)):
            while True:
                try:
                    r, _, _ = select.select([fd], [], [], 0.05)
                    chunk = os.read(fd, 1 << 16) if r else b""
                except OSError:
                    chunk = b""
                if not chunk:
                    break
                c.feed(chunk)
        self.restart()
        job.restarted = True
        if job.exit_code is None and not job.lost_marker:
            job.exit_code = 124 if job.timed_out else 137
        job.notice = (
            f"[sandflow: {why}; a new shell was started in {WORKDIR} - the working directory "
            "and exported variables were reset]"
        )

    def _end_runaway_after(self, job):
        """A fork bomb sent to the background returns at once and leaves a sandbox that
        cannot fork; when the command left us close to the pids limit, end what it left.
        Returns how many processes run besides ours now (Session.settled)."""
        if not PIDS_LIMIT:
            return 0
        after = proc_table()
        if job.restarted:
            return len(self.others(after))
        before = job.before

        def count():
            return sum(1 for p, st in proc_table().items() if before.get(p) != st)

        left = [p for p, st in after.items() if before.get(p) != st]
        if not runaway(len(left), count):
            return len(self.others(after))
        if not kill_new(before, {1, os.getpid(), self.shell.pid}):
            kill_all()
            self.restart()
            job.restarted = True
        time.sleep(0.02)
        self.drain_idle()  # what the killed processes still had in flight
        self.idle = {1: bytearray(), 2: bytearray()}
        job.notice = (
            f"[sandflow: the command left {len(left)} runaway processes running (pids "
            f"limit {PIDS_LIMIT}); they were killed and their pending output discarded]"
        )
        return len(self.others(proc_table()))

    def _result(self, job):
        """The exec answer (the host validates every field: sandbox/protocol.py)."""
        out, err = job.out, job.err
        oom1 = oom_count()
        stderr = job.guard + err.finish()
        if job.notice:
            sep = "\n" if stderr and not stderr.endswith("\n") else ""
            stderr = stderr + sep + job.notice + "\n"
        return {
            "stdout": out.finish(),
            "stderr": stderr,
            "exit_code": job.exit_code,
            "duration_s": job.duration,
            "timed_out": job.timed_out,
            "oom_killed": job.oom0 >= 0 and oom1 > job.oom0,
            "truncated": bool(out.dropped or err.dropped),
            "dropped_bytes": out.dropped + err.dropped,
            "shell_restarted": job.restarted,
        }

    def restart(self):
        self.shell.kill()
        self.shell = Shell()


# ----------------------------------------------------------------------------- files


CHUNK_MAX = 1 << 20  # the biggest data frame of a `get` (the host refuses bigger ones)
EXAMPLES = 5  # names kept per skip reason
EXAMPLE_CHARS = 200
COUNT_REST_S = 1.0  # past a cap, how long counting what was left out may take


class PayloadReader(io.RawIOBase):
    """The `len` bytes that follow a request header, read as they arrive (never all at once)."""

    def __init__(self, chan, n):
        self.chan = chan
        self.left = n

    def readable(self):
        return True

    def readinto(self, b):
        if self.left <= 0:
            return 0
        while not self.chan.buf:
            if not self.chan.fill(5.0) and self.chan.eof:
                raise EOFError("host closed the channel mid-payload")
        n = min(len(b), self.left, len(self.chan.buf))
        b[:n] = self.chan.buf[:n]
        del self.chan.buf[:n]
        self.left -= n
        return n

    def drain(self):
        """Consume what the archive reader left (trailing blocks, or all after an error)."""
        sink = bytearray(1 << 16)
        while self.left > 0:
            self.readinto(sink)


def op_put(chan, req):
    """Extract the tar that follows the header into `dest`, streaming (any size fits)."""
    import tarfile

    src = PayloadReader(chan, int(req.get("len") or 0))
    try:
        dest = req["dest"]
        os.makedirs(dest, exist_ok=True)
        with tarfile.open(fileobj=io.BufferedReader(src, 1 << 16), mode="r|") as tar:
            for member in tar:
                name = member.name
                if member.issym() or member.islnk() or member.isdev() or name.startswith("/"):
                    raise ValueError(f"refusing tar member {name!r}")
                if ".." in name.split("/"):
                    raise ValueError(f"refusing tar member {name!r}")
                target = os.path.join(dest, name)
                if member.isdir():
                    os.makedirs(target, exist_ok=True)
                    continue
                if not member.isfile():
                    continue
                os.makedirs(os.path.dirname(target), exist_ok=True)
                data = tar.extractfile(member)
                if data is None:
                    continue
                tmp = target + ".sandflow-tmp"
                with open(tmp, "wb") as f:
                    while True:
                        chunk = data.read(1 << 20)
                        if not chunk:
                            break
                        f.write(chunk)
                os.chmod(tmp, member.mode & 0o777)
                os.replace(tmp, target)
    finally:
        src.drain()
    send({"id": req["id"], "ok": True})


class FrameWriter:
    """Bytes out to the host as data frames of at most `chunk` bytes: nothing is held."""

    def __init__(self, rid, chunk, fd=STDOUT):
        self.rid = rid
        self.chunk = chunk
        self.fd = fd
        self.buf = bytearray()

    def write(self, data):
        self.buf += data
        while len(self.buf) >= self.chunk:
            self._frame(self.chunk)

    def _frame(self, n):
        if n <= 65536:
            send({"id": self.rid, "data": 1}, bytes(self.buf[:n]), self.fd)
        else:  # a big frame goes out of the buffer itself (no copy of a MiB per frame)
            with memoryview(self.buf) as view, view[:n] as part:
                send({"id": self.rid, "data": 1}, part, self.fd)
        del self.buf[:n]

    def flush(self):
        if self.buf:
            self._frame(len(self.buf))


USTAR_MAX = 8**11  # the largest size or mtime an 11-digit octal field holds


def ustar_block(name, mode, mtime, kind, size, linkname):
    """A plain ustar header (owner 0, no pax record) when everything fits one, else None.

    A fork's export sends thousands of entries; tarfile's PAX header costs ~30 us each
    (half the export's Python time), this a few."""
    if kind == b"5":
        name += "/"
    raw = name.encode("utf-8", "surrogateescape")
    link = linkname.encode("utf-8", "surrogateescape")
    if len(raw) > 100 or len(link) > 100 or not 0 <= size < USTAR_MAX:
        return None
    if not 0 <= mtime < USTAR_MAX:
        mtime = 0
    head = b"%s%s%s%s%s" % (
        raw.ljust(100, b"\0"),
        b"%07o\0" % mode,
        b"0000000\0" * 2,
        b"%011o\0" % size,
        b"%011o\0" % mtime,
    )
    tail = b"%s%s%s" % (kind, link.ljust(100, b"\0"), b"ustar\x0000")
    block = head + b"        " + tail
    block = block.ljust(512, b"\0")
    return b"%s%s%s" % (block[:148], b"%06o\0 " % sum(block), block[156:])


class LockedStat:
    """A stat result whose permission bits are the ones a path had before a fork opened it."""

    def __init__(self, st, mode):
        self.st_mode = stat.S_IFMT(st.st_mode) | mode
        self.st_uid, self.st_gid, self.st_mtime = st.st_uid, st.st_gid, st.st_mtime
        self.st_size, self.st_nlink = st.st_size, st.st_nlink
        self.st_dev, self.st_ino = st.st_dev, st.st_ino


class Exporter:
    """A tar of one path, streamed, bounded in entries (of every kind), bytes and time.

    Symlinks are sent as symlinks (never followed), a file's further hard links as hard
    links; fifos, sockets and devices are not sent. Every entry looked at counts against
    `max_entries`; past it (or past the deadline) the walk stops and only counts what it
    leaves out, for a short while. The summary says what was skipped, why, with examples.
    """

    def __init__(self, out, max_bytes, max_entries, deadline, single=False):
        import tarfile

        self.tarfile = tarfile
        # one file asked for (read_file): what would be skipped is the answer, an error
        self.single = single
        self.out = out
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.deadline = deadline
        self.looked_at = 0
        self.sent = 0
        self.bytes = 0
        self.skipped = {}
        self.examples = {}
        self.stopped = None
        self.count_exact = True
        self.links = {}
        self.modes = {}  # path -> the mode to send for it (op_fork_get, unlock_owned)
        self.owners = True

    def skip(self, reason, name, n=1):
        self.skipped[reason] = self.skipped.get(reason, 0) + n
        names = self.examples.setdefault(reason, [])
        if len(names) < EXAMPLES:
            names.append(name[:EXAMPLE_CHARS])

    def header(self, arc, st, kind, size=0, linkname=""):
        tarfile = self.tarfile
        if not self.owners:
            block = ustar_block(arc, st.st_mode & 0o7777, int(st.st_mtime), kind, size, linkname)
            if block is not None:
                self.out.write(block)
                self.sent += 1
                return
        info = tarfile.TarInfo(arc)
        info.type = kind
        info.mode = st.st_mode & 0o7777
        if self.owners:  # a fork's child writes everything as the sandbox user: no pax record
            info.uid, info.gid = st.st_uid, st.st_gid
        info.size = size
        info.linkname = linkname
        try:
            info.mtime = int(st.st_mtime)
            block = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        except (ValueError, OverflowError):
            info.mtime = 0
            block = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
        self.out.write(block)
        self.sent += 1

    def entry(self, full, arc, st):
        tarfile = self.tarfile
        if full in self.modes:  # a fork opened it for the owner: send the mode it had
            st = LockedStat(st, self.modes[full])
        mode = st.st_mode
        if stat.S_ISDIR(mode):
            self.header(arc, st, tarfile.DIRTYPE)
        elif stat.S_ISLNK(mode):
            try:
                target = os.readlink(full)
            except OSError:
                self.skip("unreadable", arc)
                return
            self.header(arc, st, tarfile.SYMTYPE, linkname=target)
        elif stat.S_ISREG(mode):
            self.regular(full, arc, st)
        elif self.single:
            raise ValueError("not a regular file (a fifo, socket or device)")
        else:
            self.skip("special", arc)

    def regular(self, full, arc, st):
        key = (st.st_dev, st.st_ino)
        if st.st_nlink > 1 and key in self.links:
            self.header(arc, st, self.tarfile.LNKTYPE, linkname=self.links[key])
            return
        if self.max_bytes and self.bytes + st.st_size > self.max_bytes:
            self.skip("over_size", arc)
            return
        try:  # O_NONBLOCK: a file swapped for a fifo since lstat must not block the helper
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            if self.single:  # e.g. PermissionError naming the file
                raise
            self.skip("unreadable", arc)
            return
        try:
            st = os.fstat(fd)
            if full in self.modes:
                st = LockedStat(st, self.modes[full])
            if not stat.S_ISREG(st.st_mode):
                self.skip("special", arc)
                return
            size = st.st_size
            if self.max_bytes and self.bytes + size > self.max_bytes:
                self.skip("over_size", arc)
                return
            self.header(arc, st, self.tarfile.REGTYPE, size=size)
            left = size
            while left > 0:
                try:
                    data = os.read(fd, min(left, CHUNK_MAX))
                except OSError:
                    data = b""
                if not data:  # shrank while we read it: keep the archive well-formed
                    self.skip("changed", arc)
                    self.out.write(b"\0" * left)
                    break
                self.out.write(data)
                left -= len(data)
            self.out.write(b"\0" * (-size % 512))
            self.bytes += size
            if st.st_nlink > 1:
                self.links[key] = arc
        finally:
            os.close(fd)

    def run(self, top, base, st, recursive):
        self.looked_at += 1
        self.entry(top, base, st)
        if not (recursive and stat.S_ISDIR(st.st_mode)):
            return
        stack = [(top, base, self.listing(top, base))]
        while stack:
            d, arc_d, names = stack[-1]
            if not names:
                stack.pop()
                continue
            name = names.pop()
            full = (d if d != "/" else "") + "/" + name
            arc = arc_d + "/" + name
            if self.looked_at >= self.max_entries > 0:
                self.stopped = "count"
            elif time.monotonic() > self.deadline:
                self.stopped = "time"
            if self.stopped:
                names.append(name)
                self.count_rest(stack, "over_count" if self.stopped == "count" else "time_limit")
                return
            self.looked_at += 1
            try:
                st = os.lstat(full)
            except OSError:
                self.skip("unreadable", arc)
                continue
            self.entry(full, arc, st)
            if stat.S_ISDIR(st.st_mode):
                stack.append((full, arc, self.listing(full, arc)))

    def listing(self, d, arc):
        try:
            return sorted(os.listdir(d), reverse=True)  # pop() from the end: ascending order
        except OSError:
            self.skip("unreadable", arc + "/")
            return []

    def count_rest(self, stack, reason):
        """Count (not send) what the walk leaves out, for at most COUNT_REST_S."""
        until = time.monotonic() + COUNT_REST_S
        dirs = []
        for d, arc_d, names in reversed(stack):
            pending = set(names)
            for name in reversed(names):
                if len(self.examples.get(reason, ())) >= EXAMPLES:
                    break
                self.skip(reason, arc_d + "/" + name, 0)
            self.skipped[reason] = self.skipped.get(reason, 0) + len(names)
            try:
                with os.scandir(d) as it:
                    for e in it:
                        if e.name in pending and e.is_dir(follow_symlinks=False):
                            dirs.append(e.path)
            except OSError:
                pass
        while dirs:
            if time.monotonic() > until:
                self.count_exact = False
                return
            d = dirs.pop()
            try:
                with os.scandir(d) as it:
                    for e in it:
                        self.skipped[reason] += 1
                        if e.is_dir(follow_symlinks=False):
                            dirs.append(e.path)
            except OSError:
                pass

    def summary(self, t0):
        return {
            "entries": self.sent,
            "looked_at": self.looked_at,
            "bytes": self.bytes,
            "skipped": self.skipped,
            "examples": self.examples,
            "stopped": self.stopped,
            "count_exact": self.count_exact,
            "seconds": round(time.monotonic() - t0, 3),
        }


def op_get(req):
    """Stream a tar of `path` (symlinks not followed) within the request's bounds."""
    t0 = time.monotonic()
    path = req["path"].rstrip("/") or "/"
    max_bytes = int(req.get("max_bytes") or 0)
    max_entries = int(req.get("max_entries") or 0)
    max_seconds = float(req.get("max_seconds") or 0)
    chunk = max(4096, min(int(req.get("chunk") or CHUNK_MAX), CHUNK_MAX))
    st = os.lstat(path)
    if max_bytes and stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
        raise ValueError(f"{path} is {st.st_size} bytes, over the limit of {max_bytes}")
    deadline = t0 + max_seconds if max_seconds > 0 else float("inf")
    out = FrameWriter(req["id"], chunk)
    single = bool(req.get("single"))
    exporter = Exporter(out, max_bytes, max_entries, deadline, single)
    exporter.run(path, os.path.basename(path) or "root", st, not single)
    out.write(b"\0" * 1024)  # end of archive
    out.flush()
    send({"id": req["id"], "ok": True, "summary": exporter.summary(t0)})


# ----------------------------------------------------------------------------- fork


def fork_processes(shell_pid, ours=()):
    """What a fork leaves behind: the command lines of every process but us, the shell and
    the fork's own (`ours`: its tars)."""
    out = []
    for pid in sorted(proc_table()):
        if pid in (1, shell_pid) or pid in ours:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read(400).replace(b"\0", b" ").strip()
        except OSError:
            continue
        out.append(f"{pid} {cmd.decode('utf-8', 'replace')}"[:200])
    return out


def unlock_owned(roots, deadline):
    """{path: mode} of the sandbox user's own folders it cannot list and files it cannot
    read (chmod 000), opened for the owner for the time of a fork's export: the user could
    do it itself, and a fork must carry them. Their modes are put back right after."""
    locked: dict = {}
    stack = list(roots)
    while stack and time.monotonic() < deadline:
        for e, st in listed(stack.pop()) or ():
            is_dir = stat.S_ISDIR(st.st_mode)
            need = 0o700 if is_dir else 0o400
            mine = st.st_uid == SANDBOX_UID and (is_dir or stat.S_ISREG(st.st_mode))
            if mine and st.st_mode & need != need:
                open_for_owner(e.path, st.st_mode, need, locked)
            if is_dir:
                stack.append(e.path)
    return locked


def listed(d):
    """[(entry, its lstat)] of folder `d` (entries that vanish are left out); None when
    it cannot be listed."""
    try:
        with os.scandir(d) as it:
            entries = list(it)
    except OSError:
        return None
    out = []
    for e in entries:
        try:
            out.append((e, e.stat(follow_symlinks=False)))
        except OSError:
            continue
    return out


def open_for_owner(path, mode, need, locked):
    """The sandbox user's own locked file or folder given the `need` bits for the time of a
    fork's export; its mode kept in `locked` (put back after)."""
    try:
        os.chmod(path, stat.S_IMODE(mode) | need, follow_symlinks=False)
        locked[path] = stat.S_IMODE(mode)
    except OSError:
        pass


FORK_FRAME = 1 << 20  # a fork's frames: few (each a handoff between threads on the host)


BULK_DIR = "/.sandflow-bulk"  # docker: a host folder bind-mounted for a fork's bulk bytes


def bulk_connect(name):
    """A fork's bulk connection to the host, or None (then the fork goes over stdin/stdout).

    Docker's attach stream crosses the engine twice per fork (parent -> host -> child):
    ~40 ms per 10 MB. So the host listens on a unix socket `name` in a folder of its own
    bind-mounted at BULK_DIR (sandbox/bulk.py), mode 0700 and owned by a uid the sandbox
    user is not: only the helper reaches it, connecting with that owner's fs ids for the
    time of the connect (it has CAP_SETUID; the sandbox user has no capability and is
    refused). Never without privilege separation (then the sandbox user is our uid)."""
    if not PRIVSEP or LIBC is None or not isinstance(name, str):
        return None
    stem = name[:-5] if name.endswith(".sock") else ""
    if len(stem) != 32 or stem.strip("0123456789abcdef"):
        return None
    try:
        st = os.lstat(BULK_DIR)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_mode & 0o077 or st.st_uid == SANDBOX_UID:
        return None
    import _socket

    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    LIBC.setfsgid(st.st_gid)
    LIBC.setfsuid(st.st_uid)
    try:
        sock.settimeout(5.0)
        sock.connect(BULK_DIR + "/" + name)
        sock.settimeout(None)
    except OSError:
        sock.close()
        return None
    finally:
        LIBC.setfsuid(SANDBOX_UID)
        LIBC.setfsgid(SANDBOX_GID)
        if LIBC.setfsuid(-1) != SANDBOX_UID or LIBC.setfsgid(-1) != SANDBOX_GID:
            os._exit(3)  # never go on with another uid's file access
    return sock


def op_fork_get(session, req):
    """fork_get over the bulk connection when the host offers one (`bulk`: the socket's
    name): the helper says so on stdout ({"bulk": 1}), then every frame and the final
    header (an error too) go over it. Else over stdout, as always."""
    sock = bulk_connect(req.get("bulk")) if req.get("bulk") else None
    if sock is None:
        fork_get(session, req, STDOUT)
        return
    try:
        send({"id": req["id"], "bulk": 1})
        try:
            fork_get(session, req, sock.fileno())
        except Exception as e:  # noqa: BLE001 - the host reads this answer on the bulk side
            send(
                {"id": req["id"], "ok": False, "error": f"{type(e).__name__}: {e}"},
                b"",
                sock.fileno(),
            )
    finally:
        sock.close()


def fork_get(session, req, fd):
    """Stream one tar of every writable place (arc names: the place's path without its
    leading '/'), bounded like `get`; the final header names the processes left behind.
    Frames of FORK_FRAME bytes: the host passes each on to the children while this walk
    goes on, so the export and the children's writes overlap."""
    t0 = time.monotonic()
    max_seconds = float(req.get("max_seconds") or 0)
    deadline = t0 + max_seconds if max_seconds > 0 else float("inf")
    out = FrameWriter(req["id"], FORK_FRAME, fd)
    exporter = Exporter(
        out, int(req.get("max_bytes") or 0), int(req.get("max_entries") or 0), deadline
    )
    roots = fork_roots()
    locked = unlock_owned(roots, deadline)
    exporter.modes = locked
    exporter.owners = False
    try:
        for root in roots:
            if exporter.stopped:
                break
            exporter.run(root, root.lstrip("/"), os.lstat(root), True)
    finally:
        for path in reversed(locked):  # files, then folders from the deepest
            with contextlib.suppress(OSError):
                os.chmod(path, locked[path], follow_symlinks=False)
    out.write(b"\0" * 1024)
    out.flush()
    procs = fork_processes(session.shell.pid)
    summary = exporter.summary(t0)
    if queues := message_queues():
        summary.setdefault("skipped", {})["message_queues"] = queues
    send(
        {
            "id": req["id"],
            "ok": True,
            "roots": roots,
            "summary": summary,
            "processes": procs[:20],
            "process_count": len(procs),
        },
        b"",
        fd,
    )


class ForkRefused(ValueError):
    """A member of a fork archive this sandbox will not write."""


def fork_target(name, roots):
    """The absolute path of archive member `name`, and whether it is a place itself."""
    name = name.rstrip("/")
    parts = name.split("/")
    if not name or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ForkRefused(f"refusing fork member {name[:200]!r}")
    best = ""
    for key in roots:
        if (name == key or name.startswith(key + "/")) and len(key) > len(best):
            best = key
    if not best:
        raise ForkRefused(f"fork member {name[:200]!r} is outside every writable place")
    return "/" + name, name == best


class ForkMember:
    """One member of a fork archive: what op_fork_put needs, its data read from the stream."""

    def __init__(self, reader, name, kind, mode, mtime, size, linkname):
        self.reader, self.name, self.type, self.mode = reader, name, kind, mode
        self.mtime, self.size, self.linkname, self.left = mtime, size, linkname, size

    def isdir(self):
        return self.type == b"5"

    def issym(self):
        return self.type == b"2"

    def islnk(self):
        return self.type == b"1"

    def isfile(self):
        return self.type in (b"0", b"\0", b"7")

    def read(self, n):
        data = self.reader.read(min(n, self.left))
        if n and self.left and not data:
            raise ForkRefused(f"fork member {self.name[:200]!r}: the archive ends in its data")
        self.left -= len(data)
        return data


def tar_number(field):
    """An octal tar header field; base-256 and garbage are refused (a fork never sends them)."""
    text = field.split(b"\0", 1)[0].strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        raise ForkRefused(f"a tar header field that is not a number ({field[:20]!r})") from None


def fork_members(reader):
    """The members of a ustar/pax stream (what op_fork_get writes), parsed by hand: tarfile's
    stream mode cost most of a fork's write. Pax records (long names) are bounded."""
    pax = {}
    while True:
        hdr = reader.read(512)
        if len(hdr) < 512:
            raise ForkRefused("the fork archive ends early")
        if not hdr.strip(b"\0"):
            return
        if sum(hdr[:148]) + 256 + sum(hdr[156:]) != tar_number(hdr[148:156]):
            raise ForkRefused("a fork archive header with a wrong checksum")
        kind, size = hdr[156:157], tar_number(hdr[124:136])
        pad = -size % 512
        if kind in (b"x", b"g"):
            if size > 1 << 16:
                raise ForkRefused(f"a tar metadata header of {size} bytes (limit 65536)")
            records = reader.read(size + pad)[:size]
            if kind == b"x":
                pax = pax_records(records)
            continue
        name = hdr[:100].split(b"\0", 1)[0]
        if hdr[257:262] == b"ustar" and hdr[345] != 0:
            name = hdr[345:500].split(b"\0", 1)[0] + b"/" + name
        link = hdr[157:257].split(b"\0", 1)[0]
        m = ForkMember(
            reader,
            pax.get("path") or name.decode("utf-8", "surrogateescape"),
            kind,
            tar_number(hdr[100:108]),
            tar_number(hdr[136:148]),
            int(pax["size"]) if pax.get("size", "").isdigit() else size,
            pax.get("linkpath") or link.decode("utf-8", "surrogateescape"),
        )
        if m.mtime >= 1 << 40:
            m.mtime = 0
        pax = {}
        yield m
        while m.left > 0:  # what the consumer did not read (a link, a folder, a fifo)
            m.read(1 << 20)
        reader.read(-m.size % 512)


def pax_records(data):
    """{key: value} of a pax extended header ("LEN key=value\n" records)."""
    out = {}
    at = 0
    while at < len(data):
        sp = data.find(b" ", at)
        if sp < 0:
            break
        try:
            n = int(data[at:sp])
        except ValueError:
            raise ForkRefused("a malformed pax record in a fork archive") from None
        if n <= 0 or at + n > len(data):
            raise ForkRefused("a malformed pax record in a fork archive")
        key, _, value = data[sp + 1 : at + n - 1].partition(b"=")
        out[key.decode("ascii", "replace")] = value.decode("utf-8", "surrogateescape")
        at += n
    return out


class ChunkedReader(PayloadReader):
    """A payload of unknown length (a fork archive forwarded as the parent sends it): chunks
    of a 4-byte big-endian length then the bytes; length 0 ends it, FORK_ABORT stops it (the
    parent's export failed: what was written is the host's to wipe)."""

    def __init__(self, chan):
        super().__init__(chan, 0)
        self.done = False

    def readinto(self, b):
        if self.left <= 0:
            if self.done:
                return 0
            while len(self.chan.buf) < 4:
                if not self.chan.fill(5.0) and self.chan.eof:
                    raise EOFError("host closed the channel mid-payload")
            n = int.from_bytes(self.chan.buf[:4], "big")
            del self.chan.buf[:4]
            if n == 0 or n == FORK_ABORT:
                self.done = True
                if n == FORK_ABORT:
                    raise ForkRefused("the host stopped the fork (the parent's export failed)")
                return 0
            self.left = n
        return super().readinto(b)

    def drain(self):
        sink = bytearray(1 << 16)
        while not self.done:
            try:
                self.readinto(sink)
            except ForkRefused:
                return


FORK_ABORT = 0xFFFFFFFF
NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


def op_fork_put(chan, req):
    """fork_put, its archive read from the bulk connection when the host offers one
    (`bulk`): the helper first says on stdout whether it connected ({"bulk": 1 or 0}); the
    answer goes on stdout."""
    if not req.get("bulk"):
        fork_put(chan, req)
        return
    sock = bulk_connect(req.get("bulk"))
    send({"id": req["id"], "bulk": 1 if sock else 0})
    if sock is None:
        fork_put(chan, req)
        return
    try:
        fork_put(Channel(sock.fileno()), req)
    except EOFError:  # the bulk side closed: an error of this fork, not the helper's end
        raise ForkRefused("the host closed the fork's bulk connection") from None
    finally:
        sock.close()


def fork_put(chan, req):
    """Write a fork archive (from op_fork_get of the parent, chunked: ChunkedReader) into
    this sandbox's writable places, as the sandbox user, never through a symlink: regular
    files, folders, symlinks and hard links to files of the same archive; modes and mtimes
    kept, folders' modes set last (a locked folder is filled first). Files are created with
    their mode (umask 0 for the time of the put): no chmod per file."""
    src = ChunkedReader(chan)
    roots = [r.lstrip("/") for r in fork_roots()]
    checked = {"/" + r for r in roots}
    dirs = []
    written = set()
    files = 0
    old_umask = os.umask(0)
    try:
        for m in fork_members(io.BufferedReader(src, 1 << 20)):
            path, is_root = fork_target(m.name, roots)
            if is_root:
                if m.isdir():
                    dirs.append((path, m.mode, m.mtime))
                continue
            parent = os.path.dirname(path)
            if parent not in checked:
                if os.path.realpath(parent) != parent or not os.path.isdir(parent):
                    raise ForkRefused(f"fork member {m.name[:200]!r}: its folder is not one")
                checked.add(parent)
            if m.isdir():
                try:
                    os.mkdir(path, 0o700)
                except FileExistsError:
                    if not stat.S_ISDIR(os.lstat(path).st_mode):
                        raise ForkRefused(f"fork member {m.name[:200]!r} exists") from None
                dirs.append((path, m.mode, m.mtime))
                continue
            if m.issym():
                fork_replace(path, m, lambda p, t=m.linkname: os.symlink(t, p))
            elif m.islnk():
                target = "/" + m.linkname
                if target not in written:
                    raise ForkRefused(f"fork member {m.name[:200]!r}: a link to nothing")
                fork_replace(path, m, lambda p, t=target: os.link(t, p, follow_symlinks=False))
            elif m.isfile():
                fd = fork_replace(path, m, lambda p, mode=m.mode & 0o777: os.open(p, NEW, mode))
                try:
                    put_keeping_holes(fd, m)
                    if m.mode & 0o1000:
                        os.fchmod(fd, m.mode & 0o1777)
                    os.utime(fd, (m.mtime, m.mtime))
                finally:
                    os.close(fd)
                written.add(path)
                files += 1
            # anything else (a forged device or fifo) is not written
        for path, mode, mtime in sorted(dirs, key=lambda d: -len(d[0])):
            with contextlib.suppress(OSError):  # a place the user does not own keeps its mode
                os.chmod(path, mode & 0o1777, follow_symlinks=False)
                os.utime(path, (mtime, mtime), follow_symlinks=False)
    finally:
        os.umask(old_umask)
        src.drain()
    send({"id": req["id"], "ok": True, "files": files})


def fork_replace(path, m, make):
    """make(path), first removing what is there (never a folder): a fork writes a member
    over the child's own file of that name. One syscall when nothing is there."""
    try:
        return make(path)
    except FileExistsError:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise ForkRefused(f"fork member {m.name[:200]!r} is a folder here") from None
        os.unlink(path)
        return make(path)


ZERO_CHUNK = bytes(1 << 20)


def put_keeping_holes(fd, m):
    """A fork member's data into `fd`; a chunk of zeros (the parent's holes, sent as zeros
    by the relay) is skipped over, not written, so the file stays sparse here too."""
    end = False
    while chunk := m.read(1 << 20):
        if chunk[0] == 0 and chunk[-1] == 0 and chunk == ZERO_CHUNK[: len(chunk)]:
            os.lseek(fd, len(chunk), os.SEEK_CUR)
            end = True
        else:
            write_fd(fd, chunk)
            end = False
    if end:  # the file ends in a hole: its size
        os.ftruncate(fd, m.size)


def write_fd(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


# ----------------------------------------------------------------------------- fork by pipes
#
# bwrap: the host gives the helper one end of a socketpair at start (SANDFLOW_CTL_FD), out of
# the sandbox user's reach like stdin/stdout (non-dumpable, closed in every child). For a
# fork it sends a pipe's write end to the parent's helper and its read end to the child's
# (SCM_RIGHTS): the image's GNU tar in the parent, as the sandbox user, writes the archive
# straight into GNU tar in the child, as the sandbox user. The bytes reach neither the host
# nor a helper: two copies by the kernel instead of a Python export, a host relay and a
# Python write (docs/sandbox.md, "Fork").

CTL_FD = int(os.environ.get("SANDFLOW_CTL_FD") or -1)
TAR = "/usr/bin/tar"
TAR_ENV = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}  # never a TAR_OPTIONS of anyone's
MAX_PIPES = 64
TAR_BLOCKING = "128"  # 64 KiB records: a 10 KB file is one write, not two (default 10 KiB)
LOCKED_CHARS = 256 << 10  # the locked paths a fork's answer names (the host's header bound)
ERR_KEEP = 2000


def recv_fds(token, n, req):
    """The n pipe ends the host sent for this request (its message carries `token`); a
    stale message (a request that failed before taking its fds) is closed and skipped.
    bwrap: over the control socket. Docker (no control socket): over the side channel the
    request names (`bulk`, sandbox/bulk.py), after saying whether it was reached."""
    import socket

    if req.get("bulk"):
        raw = bulk_connect(req.get("bulk"))
        send({"id": req["id"], "bulk": 0 if raw is None else 1})
        if raw is None:
            raise ValueError("the host's side channel could not be reached")
        sock = socket.socket(fileno=raw.detach())
        try:
            return take_fds(sock, token, n, side=True)
        finally:
            sock.close()
    if CTL_FD < 0:
        raise ValueError("this helper has no control socket")
    sock = socket.socket(fileno=CTL_FD)
    try:
        return take_fds(sock, token, n)
    finally:
        sock.detach()


def take_fds(sock, token, n, side=False):
    """Read messages on `sock` until the one naming `token` with its n descriptors (5 s).
    The control socket closing means the host is gone (EOFError); a side channel closing
    only fails this request."""
    import socket

    fd = sock.fileno()
    deadline = time.monotonic() + 5.0
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise ValueError("the host's descriptors did not arrive")
        data, fds, _, _ = socket.recv_fds(sock, 64, MAX_PIPES, socket.MSG_CMSG_CLOEXEC)
        if not data and side:
            raise ValueError("the host closed the side channel before sending the pipes")
        if not data:
            raise EOFError("the host closed the control socket")
        if data == token.encode() and len(fds) == n:
            break
        for one in fds:
            os.close(one)
    if not all(stat.S_ISFIFO(os.fstat(fd).st_mode) for fd in fds):
        for fd in fds:
            os.close(fd)
        raise ValueError("the host sent a descriptor that is not a pipe")
    return fds


def spawn_user(argv, stdin, stdout, stderr, umask=None):
    """Run argv as the sandbox user (no capability), its std fds given (None: /dev/null),
    nothing else open."""
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open("/dev/null", os.O_RDWR)
            as_sandbox_user(
                null if stdin is None else stdin, null if stdout is None else stdout, stderr
            )
            if umask is not None:
                os.umask(umask)
            os.execve(argv[0], argv, TAR_ENV)
        finally:
            os._exit(127)
    return pid


class Tools:
    """Processes started as the sandbox user for one fork (GNU tar), running while the
    helper answers other requests (the shell state's dump or replay); `wait` ends them."""

    def __init__(self, deadline):
        self.deadline = deadline
        self.procs = []  # (pid, pidfd, the head of its stderr)
        self.errs = {}  # stderr read end -> the head of what it said
        self.locked = {}
        self.skipped = {}

    def start(self, argv, fd_in, fd_out, umask=None):
        r, w = os.pipe2(os.O_CLOEXEC)
        try:
            pid = spawn_user(argv, fd_in, fd_out, w, umask)
        except OSError:
            os.close(r)
            raise
        finally:
            os.close(w)
        head = bytearray()
        self.procs.append((pid, os.pidfd_open(pid), head))
        self.errs[r] = head

    def _drain(self, fd):
        chunk = b""
        with contextlib.suppress(OSError):
            chunk = os.read(fd, 65536)
        if chunk:
            head = self.errs[fd]
            head += chunk[: max(0, ERR_KEEP - len(head))]
        else:
            os.close(fd)
            del self.errs[fd]

    def feed(self, fd, data):
        """Write `data` to a tar's stdin (non-blocking), reading the tars' stderr while it
        waits (a tar blocked on its stderr never reads on); False past the deadline or when
        that tar is gone."""
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(fd, view) :]
                continue
            except BlockingIOError:
                pass
            except OSError:
                return False
            left = self.deadline - time.monotonic()
            if left <= 0:
                return False
            readable, _, _ = select.select(list(self.errs), [fd], [], left)
            for efd in readable:
                self._drain(efd)
        return True

    def kill(self):
        for pid, _, _ in self.procs:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def wait(self):
        """Until every process ended or the deadline passed (then they are killed):
        [(exit status, or None when killed; the head of its stderr)]."""
        try:
            live = {pidfd for _, pidfd, _ in self.procs}
            while live and (left := self.deadline - time.monotonic()) > 0:
                for fd in select.select(list(live) + list(self.errs), [], [], left)[0]:
                    if fd in live:
                        live.discard(fd)
                    else:
                        self._drain(fd)
            for fd in list(self.errs):  # ended; a grandchild may hold a stderr open
                os.set_blocking(fd, False)
                self._drain(fd)
            out = []
            for pid, pidfd, head in self.procs:
                if pidfd in live:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    _, status = os.waitpid(pid, 0)
                except ChildProcessError:  # reaped by reap() during another request
                    status = DEAD.pop(pid, None)
                code = (
                    None if pidfd in live or status is None else os.waitstatus_to_exitcode(status)
                )
                out.append((code, head.decode("utf-8", "replace")))
            return out
        finally:
            self.close()

    def close(self):
        for _, pidfd, _ in self.procs:
            os.close(pidfd)
        for fd in self.errs:
            os.close(fd)
        self.procs, self.errs = [], {}
        for path in reversed(self.locked):  # files, then folders from the deepest
            with contextlib.suppress(OSError):
                os.chmod(path, self.locked[path], follow_symlinks=False)
        self.locked = {}


FORK_TOOLS: dict = {}  # "send" / "recv": the fork in flight in this sandbox (one at a time)


def fork_tools(side, deadline):
    """A new fork's Tools for `side`; one left by a fork the host gave up on is ended."""
    old = FORK_TOOLS.pop(side, None)
    if old is not None:
        old.kill()
        old.wait()
    FORK_TOOLS[side] = Tools(deadline)
    return FORK_TOOLS[side]


def fork_walk(roots, deadline, max_entries, max_bytes, outs, tools):
    """One walk of the writable places as the sandbox user, each name written (NUL-ended)
    to every tar's list as it is found (each place first, a folder before its contents):
    the tars archive while the walk goes on. The user's own locked folders and files are
    opened for the owner (tools.locked: their modes, put back when the tars end).
    Fifos, sockets and devices are left out (counted). Stops at the first bound.
    Returns (entries, bytes)."""
    skipped = tools.skipped
    pending = []
    count = total = 0

    def emit(path):
        pending.append(path[1:].encode("utf-8", "surrogateescape"))
        if len(pending) >= 256:
            flush()

    def flush():
        if pending:
            data = b"\0".join(pending) + b"\0"
            pending.clear()
            for fd in outs:
                tools.feed(fd, data)  # a tar gone or late: its status says so

    for root in roots:
        emit(root)
        stack = [root]
        while stack:
            if time.monotonic() > deadline:
                skipped["time_limit"] = 1
                return count, total
            entries = listed(stack.pop())
            if entries is None:
                skipped["unreadable"] = skipped.get("unreadable", 0) + 1
                continue
            for e, st in entries:
                mode = st.st_mode
                if stat.S_ISDIR(mode):
                    need = 0o700
                elif stat.S_ISREG(mode):
                    need = 0o400
                    total += held_bytes(st)
                elif stat.S_ISLNK(mode):
                    need = 0
                else:  # fifos, sockets, devices are not carried
                    skipped["special"] = skipped.get("special", 0) + 1
                    continue
                if st.st_uid == SANDBOX_UID and mode & need != need:
                    open_for_owner(e.path, mode, need, tools.locked)
                elif need and not readable_by_user(st):
                    skipped["unreadable"] = skipped.get("unreadable", 0) + 1
                    continue
                count += 1
                if count > max_entries > 0:
                    skipped["over_count"] = 1
                    return count, total
                if total > max_bytes > 0:
                    skipped["over_size"] = 1
                    return count, total
                emit(e.path)
                if need == 0o700:
                    stack.append(e.path)
    flush()
    return count, total


def held_bytes(st):
    """The bytes a regular file holds (its holes excepted): what a fork by pipes copies
    (tar --sparse) and a child's places then hold. A 900 MB file made by `truncate` holds
    none; its apparent size is not memory in any child."""
    return min(st.st_size, st.st_blocks * 512)


def readable_by_user(st):
    """Could the sandbox user (no supplementary group) read this file / list this folder?"""
    need = 5 if stat.S_ISDIR(st.st_mode) else 4
    if st.st_uid == SANDBOX_UID:
        return (st.st_mode >> 6) & need == need
    if st.st_gid == SANDBOX_GID:
        return (st.st_mode >> 3) & need == need
    return st.st_mode & need == need


def fork_deadline(req):
    max_seconds = float(req.get("max_seconds") or 0)
    return time.monotonic() + (max_seconds if max_seconds > 0 else 3600.0)


def op_fork_send(session, req):
    """The parent's side of a fork by pipes: one GNU tar per pipe the host sent, as the
    sandbox user, archiving the names the walk feeds it (fork_walk), bounded like fork_get:
    entries and bytes by the walk (past one the tars are killed: the children's archives
    end early and the host refuses the fork), time by the deadline. Answers when the walk
    ends, the tars still running (op_fork_wait ends them): the answer names what was
    locked (the children put those modes back) and the processes left behind."""
    t0 = time.monotonic()
    deadline = fork_deadline(req)
    fds = recv_fds(str(req.get("token")), max(1, min(int(req.get("pipes") or 1), MAX_PIPES)), req)
    tools = fork_tools("send", deadline)
    lists = []
    try:
        # --sparse: a file's holes (found with SEEK_HOLE) stay holes in every child
        argv = [TAR, "-c", "-f", "-", "-C", "/", "--format=gnu", "--sparse", "--no-recursion",
                "--null", "--verbatim-files-from", "--ignore-failed-read", "-b", TAR_BLOCKING,
                "-T", "-"]  # fmt: skip
        for fd in fds:
            r, w = os.pipe2(os.O_CLOEXEC)
            lists.append(w)
            os.set_blocking(w, False)
            with contextlib.suppress(OSError):
                fcntl_setpipe(w)
            try:
                tools.start(argv, r, fd)
            finally:
                os.close(r)
        roots = fork_roots()
        entries, total = fork_walk(
            roots,
            deadline,
            int(req.get("max_entries") or 0),
            int(req.get("max_bytes") or 0),
            lists,
            tools,
        )
    except BaseException:
        tools.kill()
        raise
    finally:
        for fd in fds + lists:
            os.close(fd)
    if any(k in tools.skipped for k in ("over_count", "over_size", "time_limit")):
        tools.kill()
    if queues := message_queues():
        tools.skipped["message_queues"] = queues
    procs = fork_processes(session.shell.pid, {pid for pid, _, _ in tools.procs})
    locked = {}
    room = LOCKED_CHARS
    for path, mode in tools.locked.items():  # what fits the answer's header line
        room -= len(path) + 16
        if room < 0:
            break
        locked[path] = mode
    send(
        {
            "id": req["id"],
            "ok": True,
            "roots": roots,
            "summary": {
                "entries": entries,
                "bytes": total,
                "skipped": tools.skipped,
                "seconds": round(time.monotonic() - t0, 3),
            },
            "locked": locked,
            "locked_left_out": len(tools.locked) - len(locked),
            "processes": procs[:20],
            "process_count": len(procs),
        }
    )


def op_fork_look(session, req):
    """Before a fork by snapshot (the host snapshots the places in `req["places"]`): the
    processes it leaves behind, and the other writable places that hold something (then
    the host forks by pipes instead: a snapshot would not carry them)."""
    places = set(req.get("places") or ())
    held = []
    for root in fork_roots():
        if root in places:
            continue
        with contextlib.suppress(OSError), os.scandir(root) as it:
            if next(it, None) is not None:
                held.append(root)
    procs = fork_processes(session.shell.pid)
    send(
        {
            "id": req["id"],
            "ok": True,
            "held": held,
            "summary": {"skipped": {"message_queues": queues} if (queues := message_queues()) else {}},
            "processes": procs[:20],
            "process_count": len(procs),
        }
    )


def fcntl_setpipe(fd, size=1 << 20):
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)


def op_fork_recv(req):
    """A child's side of a fork by pipes: GNU tar, as the sandbox user, extracts what
    arrives on the pipe the host sent, only under this sandbox's writable places (the
    member names given to tar; GNU tar itself refuses `..` and absolute names and makes
    the archive's symlinks only after every other member: nothing is written through
    one), files with their modes and mtimes, the places themselves left as they are.
    What the parent sent is hostile: it can write no more than the sandbox user could
    (this sandbox's tmpfs sizes bound it), and tar is killed at the deadline. Answers at
    once; op_fork_wait says how tar ended. Its umask is 0: each file is made with its
    mode (no chmod after); folders get their modes and times when the archive has ended
    (the walk names a folder's contents after its siblings)."""
    deadline = fork_deadline(req)
    (fd,) = recv_fds(str(req.get("token")), 1, req)
    tools = fork_tools("recv", deadline)
    roots = [r[1:] for r in fork_roots()]
    # the places themselves are left as they are (exactly those names excluded: no
    # recursion for those patterns); only what is under them is written
    argv = [TAR, "-x", "-f", "-", "-C", "/", "--no-same-owner", "--preserve-permissions",
            "-b", TAR_BLOCKING, "--read-full-records", "--delay-directory-restore",
            "--no-recursion", "--anchored", "--no-wildcards",
            *[f"--exclude={r}" for r in roots], "--recursion", "--", *roots]  # fmt: skip
    try:
        tools.start(argv, fd, None, umask=0)
    finally:
        os.close(fd)
    send({"id": req["id"], "ok": True})


def op_fork_wait(req):
    """The end of this sandbox's side of a fork (op_fork_send / op_fork_recv): its tars'
    exit, the parent's locked modes put back."""
    side = "send" if req.get("side") == "send" else "recv"
    tools = FORK_TOOLS.pop(side, None)
    if tools is None:
        raise ValueError("no fork in flight here")
    statuses = tools.wait()
    ok = (0, 1) if side == "send" else (0,)  # tar -c: 1 is "a file changed as we read it"
    bad = [(code, err) for code, err in statuses if code not in ok]
    if not bad:
        send({"id": req["id"], "ok": True})
        return
    code, err = bad[0]
    why = "its time limit ran out" if code is None else f"tar exited {code}: {err[-600:]}"
    where = "read" if side == "send" else "written"
    send({"id": req["id"], "ok": False, "error": f"the fork's archive was not {where} ({why})"})


# ----------------------------------------------------------------------------- reset


# + WORKDIR and HOME; each only where the sandbox user can write (see wipe_roots)
WIPE_ROOTS = ("/tmp", "/dev/shm", "/dev/mqueue", "/var/tmp", "/run", "/run/lock")
SYSVIPC = ("shm", "sem", "msg")
RESET_KILL_S = 3.0
WIPE_S = 30.0
BOOT_STATE: dict = {}  # what a fresh sandbox looks like, taken before the first shell


def user_writable(root):
    """Can the sandbox user create entries in `root` (a writable mount, and its owner or
    a world-writable folder)?"""
    try:
        st = os.lstat(root)
        vfs = os.statvfs(root)
    except OSError:
        return False
    if vfs.f_flag & os.ST_RDONLY or not stat.S_ISDIR(st.st_mode):
        return False
    if st.st_uid == SANDBOX_UID:
        return bool(st.st_mode & stat.S_IWUSR)
    return bool(st.st_mode & stat.S_IWOTH) or (
        st.st_gid == SANDBOX_GID and bool(st.st_mode & stat.S_IWGRP)
    )


def fork_roots():
    """The writable places a fork carries: all the reset wipes but /dev/mqueue (a POSIX
    message queue cannot be made by writing a file: counted, not carried)."""
    return [r for r in wipe_roots() if r != "/dev/mqueue"]


def message_queues():
    try:
        return len(os.listdir("/dev/mqueue"))
    except OSError:
        return 0


def wipe_roots():
    home = os.environ.get("HOME", "/home/sandbox")
    out = []
    for root in (WORKDIR, home) + WIPE_ROOTS:
        if root not in out and user_writable(root):
            out.append(root)
    return out


def xattrs(path):
    """{name: value (hex)} of `path`'s extended attributes; POSIX ACLs are two of them
    (system.posix_acl_access, system.posix_acl_default: a default ACL on a place decides
    the mode of every file created in it, whatever the umask says)."""
    try:
        names = os.listxattr(path, follow_symlinks=False)
    except OSError:  # not supported here: nothing an episode could have set either
        return {}
    out = {}
    for name in sorted(names):
        try:
            out[name] = os.getxattr(path, name, follow_symlinks=False).hex()
        except OSError as e:
            out[name] = f"unreadable: {e.errno}"
    return out


def root_state(root):
    """What a probe can see of one writable place: its mode, owner, extended attributes
    and ACLs, entries, free space."""
    st = os.lstat(root)
    state: dict = {"mode": st.st_mode, "uid": st.st_uid, "gid": st.st_gid}
    state["xattrs"] = xattrs(root)
    state["entries"] = sorted(os.listdir(root))
    if not root.startswith("/dev/mqueue") and root not in SHARED_FS_PLACES:
        vfs = os.statvfs(root)
        state["free"] = (vfs.f_bfree, vfs.f_ffree)
    return state


def sysvipc_ids():
    """{kind: [ids]} of every System V IPC object in this IPC namespace."""
    out = {}
    for kind in SYSVIPC:
        ids = []
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 1 and fields[1].isdigit():
                        ids.append(int(fields[1]))
        except OSError:
            pass
        out[kind] = ids
    return out


TCP_LISTEN = 10
SOCK_DIAG_BY_FAMILY = 20
NLMSG_ERROR, NLMSG_DONE = 2, 3


def tcp_listeners_netlink(family):
    """["tcp:<family>:<address hex>:<port>"] of this namespace's TCP listeners (sock_diag).

    Why not /proc/net/tcp: reading it walks the kernel's whole established-connection hash
    table, shared by every namespace of the host (about 5 ms per file here, 10 of a 22 ms
    reset); a LISTEN-only dump walks the listeners of this namespace alone. Raises OSError
    when the kernel refuses (the caller falls back to /proc).
    """
    import socket
    import struct

    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4)  # NETLINK_SOCK_DIAG
    try:
        sock.settimeout(2.0)
        req = struct.pack("=BBBxI48x", family, socket.IPPROTO_TCP, 0, 1 << TCP_LISTEN)
        sock.send(struct.pack("=IHHII", 16 + len(req), SOCK_DIAG_BY_FAMILY, 0x301, 1, 0) + req)
        out: list[str] = []
        while True:
            data = sock.recv(65536)
            if not data:
                raise OSError("sock_diag: the dump ended early")
            at = 0
            while at + 16 <= len(data):
                size, kind = struct.unpack_from("=IH", data, at)
                if size < 16 or at + size > len(data):
                    raise OSError("sock_diag: malformed message")
                if kind == NLMSG_DONE:
                    return sorted(out)
                if kind == NLMSG_ERROR:
                    raise OSError("sock_diag: refused")
                if kind == SOCK_DIAG_BY_FAMILY and size >= 16 + 24:
                    body = data[at + 16 : at + size]
                    port = struct.unpack_from(">H", body, 4)[0]
                    out.append(f"tcp:{family}:{body[8:24].hex()}:{port}")
                    if len(out) > 100000:
                        raise OSError("sock_diag: too many listeners")
                at += (size + 3) & ~3
    finally:
        sock.close()


def tcp_listeners():
    """This namespace's TCP listeners (v4 and v6): sock_diag, else /proc/net/tcp{,6}."""
    try:
        return tcp_listeners_netlink(2) + tcp_listeners_netlink(10)
    except OSError:
        pass
    out = []
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            next(f, None)
            out += [f"{name}:{ln.split()[1]}" for ln in f if ln.split()[3:4] == ["0A"]]
    return out


def listening_sockets():
    """Sockets of this network namespace that a process would hold: listeners, udp, unix."""
    out = tcp_listeners()
    for name in ("udp", "udp6", "raw", "raw6", "unix"):
        with contextlib.suppress(OSError), open(f"/proc/net/{name}") as f:
            next(f, None)
            out += [f"{name}:{i}" for i, _ in enumerate(f)]
    return sorted(out)


def take_boot_state():
    # Without /proc/sysvipc (gVisor) IPC objects can be neither listed nor removed: such a
    # sandbox cannot prove a reset, and is replaced instead of reused.
    BOOT_STATE["sysvipc_visible"] = all(os.path.exists(f"/proc/sysvipc/{k}") for k in SYSVIPC)
    BOOT_STATE["roots"] = {root: root_state(root) for root in wipe_roots()}
    BOOT_STATE["sockets"] = listening_sockets()
    BOOT_STATE["oom"] = oom_count()


def remove_tree_contents(root, boot):
    """Delete everything under `root` (as the sandbox user), unlocking folders it locked;
    drop the extended attributes and ACLs it set on `root` itself (the boot ones stay)."""
    boot_mode = boot["mode"]
    st = os.lstat(root)
    if stat.S_IMODE(st.st_mode) != stat.S_IMODE(boot_mode) and st.st_uid == os.geteuid():
        os.chmod(root, stat.S_IMODE(boot_mode) | stat.S_IRWXU)
    stack, dirs = [root], []
    while stack:
        d = stack.pop()
        if d != root:
            os.chmod(d, stat.S_IRWXU)  # a folder the model made 000 or read-only
        with os.scandir(d) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stack.append(entry.path)
                    dirs.append(entry.path)
                else:
                    os.unlink(entry.path)
    for d in reversed(dirs):
        os.rmdir(d)
    for name in xattrs(root):
        if name not in boot["xattrs"] and st.st_uid == os.geteuid():
            os.removexattr(root, name, follow_symlinks=False)  # an ACL too: mode bits rule again
    if stat.S_IMODE(os.lstat(root).st_mode) != stat.S_IMODE(boot_mode):
        os.chmod(root, stat.S_IMODE(boot_mode))


def rm_sysvipc():
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ipc_rmid = 0
    for kind, ids in sysvipc_ids().items():
        for i in ids:
            if kind == "shm":
                libc.shmctl(i, ipc_rmid, None)
            elif kind == "sem":
                libc.semctl(i, 0, ipc_rmid, 0)
            else:
                libc.msgctl(i, ipc_rmid, None)


def wipe_as_user():
    """In a child that is the sandbox user (the owner of everything left): wipe, remove IPC."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(r)
            os.closerange(3, w)
            os.closerange(w + 1, MAXFD)
            become_sandbox_user()
            errors = []
            for root, state in BOOT_STATE["roots"].items():
                try:
                    remove_tree_contents(root, state)
                except OSError as e:
                    errors.append(f"wipe {root}: {e}"[:300])
            try:
                rm_sysvipc()
            except OSError as e:
                errors.append(f"sysvipc: {e}"[:300])
            os.write(w, json.dumps(errors[:10]).encode()[:60000])
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    data = b""
    deadline = time.monotonic() + WIPE_S
    while time.monotonic() < deadline:
        ready, _, _ = select.select([r], [], [], 0.2)
        if ready:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            data += chunk
    os.close(r)
    if not data:  # the wiper overran (or died): it goes with everything else
        others_gone()
    for _ in range(200):  # the wiper exits right after its report
        reap()
        if pid in DEAD:
            break
        time.sleep(0.001)
    try:
        report = json.loads(data.decode() or "null")
    except ValueError:
        report = None
    if not isinstance(report, list):
        return ["the wiper did not finish"]
    return [str(e) for e in report]


def others_gone():
    """SIGKILL every process but us until none is left (False if it would not converge).

    kill(-1) reaches every process of the namespace in one kernel walk; the dead are
    reaped (orphans are re-parented to us) and /proc is read again until only PID 1 is left.
    """
    if os.getpid() != 1:
        return False
    deadline = time.monotonic() + RESET_KILL_S
    pause = 0.001
    while time.monotonic() < deadline:
        reap()
        if set(proc_table()) <= {1}:
            return True
        with contextlib.suppress(OSError):
            os.kill(-1, signal.SIGKILL)
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    reap()
    return set(proc_table()) <= {1}


def op_reset(session, chan, req):
    """Bring the sandbox back to how it booted, then prove it; a new session either way.

    Every process but PID 1 is killed (kill(-1) is atomic against forks, so setsid, nohup
    and double forks go too), every writable place is emptied by a child running as the
    sandbox user, System V IPC objects are removed, and then the state is compared with
    the boot snapshot: processes, each place's entries/mode/owner/free blocks and inodes,
    IPC objects, sockets of the namespace, the OOM counter. `failed` lists what differs;
    the host destroys a sandbox whose reset failed.
    """
    global T_START, LIFETIME_S
    session.shell.kill()
    for side in list(FORK_TOOLS):  # a fork the host gave up on: its tars go with the rest
        FORK_TOOLS.pop(side).close()
    failed = []
    if not others_gone():
        failed.append("processes survived SIGKILL")
    else:
        failed += wipe_as_user()
        if not others_gone():
            failed.append("processes survived the wipe")
    DEAD.clear()
    for root, boot in BOOT_STATE["roots"].items():
        try:
            now = root_state(root)
        except OSError as e:
            failed.append(f"{root}: {e}")
            continue
        for key, value in boot.items():
            if now.get(key) != value:
                failed.append(f"{root}: {key} differs")
    if not BOOT_STATE["sysvipc_visible"]:
        failed.append("System V IPC objects cannot be listed here (no /proc/sysvipc)")
    elif any(sysvipc_ids().values()):
        failed.append("System V IPC objects left")
    if req.get("check_net", True) and listening_sockets() != BOOT_STATE["sockets"]:
        failed.append("sockets left")
    if oom_count() != BOOT_STATE["oom"]:
        failed.append("the OOM counter moved (the cgroup remembers an OOM kill)")
    lifetime = float(req.get("lifetime") or 0)
    T_START, LIFETIME_S = time.monotonic(), lifetime
    session = Session()
    first = session.run(chan, "true", 10.0, 1024)
    if first.get("exit_code") != 0:
        failed.append("the new shell did not answer")
    return session, failed


# ----------------------------------------------------------------------------- main


def main():
    global T_START, LIFETIME_S
    # As PID 1, signals without a handler are ignored; Python's own SIGINT handler would not be.
    if os.getpid() != 1:
        # Killing "every new process" is only safe inside the sandbox's own pid namespace.
        sys.stderr.write("sandflow helper: refusing to run outside a pid namespace (pid != 1)\n")
        sys.exit(3)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    try:
        guard = protect_self()
    except (OSError, AttributeError, ImportError) as e:
        # Fail closed: a helper the sandbox user could reach must not run at all.
        sys.stderr.write(f"sandflow helper: cannot protect its channel: {e}\n")
        sys.exit(3)
    if CTL_FD >= 0:  # every child closes it anyway; an exec never keeps it
        with contextlib.suppress(OSError):
            os.set_inheritable(CTL_FD, False)
    chan = Channel()
    take_boot_state()  # what a reset must return to (op "reset")
    session = Session()
    first = session.run(chan, "true", 10.0, 1024)
    send({"ready": True, "pid": os.getpid(), "boot": first["exit_code"], **guard})
    while True:
        if LIFETIME_S and time.monotonic() - T_START > LIFETIME_S:
            kill_all()
            send({"id": -1, "expired": True})
            return
        raw = chan.line()
        if raw is None:
            idle_fds = [STDIN, session.shell.out, session.shell.err]
            r, _, _ = select.select(idle_fds, [], [], 0.5)
            reap()
            if STDIN in r and not chan.fill(0) and chan.eof:
                return
            if session.shell.out in r or session.shell.err in r:
                session.drain_idle()
                if not session.shell.alive():
                    # Killed between commands (a background `kill $$`): its pipes are at
                    # EOF, so replace it now instead of spinning on them.
                    session.restart()
                    session.died_idle = True
            continue
        req = json.loads(raw)
        op = req.get("op")
        rid = req.get("id")
        try:
            if op == "exec":
                timeout = float(req.get("timeout") or 120)
                if LIFETIME_S:
                    timeout = max(0.01, min(timeout, LIFETIME_S - (time.monotonic() - T_START)))
                res = session.run(chan, req["cmd"], timeout, int(req.get("cap") or 32000))
                res["id"] = rid
                send(res)
            elif op == "put":
                op_put(chan, req)
            elif op == "get":
                op_get(req)
            elif op == "fork_get":
                op_fork_get(session, req)
            elif op == "fork_put":
                op_fork_put(chan, req)
            elif op == "fork_send":
                op_fork_send(session, req)
            elif op == "fork_recv":
                op_fork_recv(req)
            elif op == "fork_wait":
                op_fork_wait(req)
            elif op == "fork_look":
                op_fork_look(session, req)
            elif op == "reset":
                session, failed = op_reset(session, chan, req)
                send({"id": rid, "ok": not failed, "failed": failed[:20]})
            elif op == "lifetime":  # a pooled sandbox's next episode: its own wall clock
                T_START, LIFETIME_S = time.monotonic(), max(0.0, float(req.get("s") or 0))
                send({"id": rid, "ok": True})
            elif op == "ping":
                send({"id": rid, "ok": True})
            elif op == "exit":
                kill_all()
                send({"id": rid, "ok": True})
                return
            else:
                send({"id": rid, "ok": False, "error": f"unknown op {op!r}"})
        except EOFError:
            return
        except Exception as e:  # noqa: BLE001 - reported to the host, the helper carries on
            send({"id": rid, "ok": False, "error": f"{type(e).__name__}: {e}"})


if __name__ == "__main__" or __name__ == "sandflow_helper":
    try:
        main()
    finally:
        kill_all()
