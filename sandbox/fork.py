"""Fork a live sandbox: n children whose files and shell state equal the parent's now.

Why here and not in the engine: a fork is a copy of what the reset wipes (every writable
place) plus the session shell's state, and both are the helper's to read and write. The
parent's helper streams one tar of its writable places (bounded like copy_out: bytes by
the sandbox's writable limit, entries, seconds) in frames of 1 MiB; the host passes each
frame on to every child's helper as it arrives (a few frames queued per child, never the
archive whole), so the parent's export and the children's writes overlap. Each child
writes as the sandbox user, never through a symlink. The host never parses what the
parent wrote; each child checks every member itself (sandbox/_helper.py, op_fork_put).
When the parent's export fails its bound half-way, the children are told to stop: the
ones this call opened are closed, the ones it was given are reset (a pool's wipe).

Not carried (docs/sandbox.md, "Fork"): processes (the child's shell is new; `ForkInfo`
names what was running), fifos, sockets and devices, files the sandbox user cannot read,
extended attributes and ACLs, System V IPC objects, the kernel keyring, open fds.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import queue
import re
import secrets
import shlex
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from sandbox.base import SandboxError

if TYPE_CHECKING:  # sandbox.common's HelperSandbox.fork calls in here
    from sandbox.common import HelperSandbox

QUEUE_FRAMES = 4  # frames (1 MiB each) queued on the host per child: what it holds at most
SHELL_STATE_CAP = 4 << 20  # bytes of shell state (variables, functions, aliases) carried
SHELL_TIMEOUT_S = 30.0
MAX_CHILDREN = 64
ROOTS_BOUND = 8  # writable places a sandbox may have (sandbox/_helper.py, wipe_roots)
ULIMIT_FLAGS = "cdefilmnqrstuvxR"
ENTRY_OVERHEAD = 8192  # tar bytes per entry beyond its data (sandbox/common.py, TAR_OVERHEAD)
FORK_PUT_TIMEOUT_S = 135.0  # a child finishing the archive (the file ops' 120 s + slack)
STALL_S = 60.0  # a child that takes no frame for this long is stalled (it is removed)

# Runs in the parent's session shell: prints umask, ulimits, then a script that recreates
# the variables (exported or not, arrays, attributes), functions, aliases, traps, options
# and cwd, and ends with the previous command's status. It leaves the shell as it found it.
DUMP = r"""__sf_fork_s=$?; __sf_fork_dump() {
local __sf_s=$1 __sf_n; unset __sf_fork_s
umask -p; echo '#@H'; ulimit -H -a; echo '#@S'; ulimit -S -a; echo '#@script'
echo 'for __sf_v in $(compgen -e); do unset "$__sf_v" 2>/dev/null; done; unset __sf_v'
for __sf_n in $(compgen -v); do case $__sf_n in
BASH*|FUNCNAME|GROUPS|RANDOM|SRANDOM|SECONDS|LINENO|EPOCH*|PIPESTATUS|HISTCMD|PPID|UID|EUID|\
SHELLOPTS|DIRSTACK|COMP_*|_|__sf_*|OPTIND|OPTERR) ;;
*) declare -p "$__sf_n" 2>/dev/null ;; esac; done
declare -f; declare -Fx; alias -p; trap -p
echo 'unset -f __sf_fork_dump'; shopt -p; set +o
if [[ -v BASH_COMPAT ]]; then declare -p BASH_COMPAT; else echo 'unset BASH_COMPAT'; fi
echo '#@cd'; printf 'builtin cd -- %q\n' "$PWD"; declare -p OLDPWD 2>/dev/null || echo 'unset OLDPWD'
printf '__sf_rc %d\n' "$__sf_s"
unset -f __sf_fork_dump; return "$__sf_s"; }; __sf_fork_dump "$__sf_fork_s"
"""
_ULIMIT_LINE = re.compile(r"\((?:[^()]*, )?-(\w)\)\s+(\S+)\s*$")


class ForkError(SandboxError):
    """The fork could not be made (the parent is untouched; no child is left open)."""


@dataclass
class ForkInfo:
    """What a child knows about its making: whose fork, what did not come along."""

    parent: str
    files_bytes: int = 0
    entries: int = 0
    processes_not_carried: list[str] = field(default_factory=list)
    process_count: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    method: str = ""  # "snapshot" (btrfs volumes), "pipes" (tar to tar) or "host" (relayed)

    @property
    def notice(self) -> str:
        """One line for the model or a log: the processes the child does not have."""
        if not self.process_count:
            return f"forked from {self.parent}: no process was running"
        return (
            f"forked from {self.parent}: {self.process_count} running processes were not "
            f"carried over (e.g. {'; '.join(self.processes_not_carried[:3])})"
        )


def writable_bound(box: HelperSandbox) -> int:
    """The most a fork may copy: every writable place full (each is sized tmp_size_mb)."""
    return box.config.limits.tmp_size_mb * (1 << 20) * ROOTS_BOUND


def fork_sandbox(
    parent: HelperSandbox,
    n: int,
    *,
    children: list[Any] | None = None,
    opener: Callable[[], Any] | None = None,
) -> list[Any]:
    """n children equal to `parent` now (module docstring). `children`: fresh or reset
    sandboxes of the same config to fork into (e.g. from a warm pool: no start cost);
    else `opener()` (default: the parent's class and config) starts each. Each child gets
    `.fork_info` (ForkInfo). On failure every child this call opened is closed."""
    if not 1 <= n <= MAX_CHILDREN:
        raise ValueError(f"fork: n must be between 1 and {MAX_CHILDREN}, got {n}")
    if children is not None and len(children) != n:
        raise ValueError(f"fork: {n} children asked for but {len(children)} sandboxes given")
    t0 = time.perf_counter()
    shell = "" if _takes_pipes(parent) else read_shell(parent)  # else read while copying
    opened: list[Any] = []
    given = list(children or [])
    streamed = False
    try:
        if children is None:
            open_one = opener or (lambda: type(parent)(parent.config))
            if parent.capabilities.parallel_open:
                children = _parallel([open_one] * n)
            else:  # bwrap's --die-with-parent is the *thread* that started it: start here
                children = []
                for _ in range(n):
                    children.append(open_one())
            opened = list(children)
        streamed = True
        info = None
        if _takes_snapshots(parent, children):
            info = fork_by_snapshot(parent, children)
        if info is None and all(_takes_pipes(box) for box in (parent, *children)):
            with contextlib.suppress(_NoSideChannel):  # then as below, nothing was written
                info = fork_by_pipes(parent, children)
        if info is None:
            shell = shell or read_shell(parent)
            info = stream_files(parent, children)
            info.method = "host"
            _parallel([partial(replay_shell, c, shell) for c in children])
    except BaseException:
        for c in opened:
            c.close()
        if streamed:  # given children may be half written: wipe them (or remove them)
            for c in given:
                _wipe(c)
        raise
    info.seconds = time.perf_counter() - t0
    for c in children:
        c.fork_info = ForkInfo(**{**info.__dict__})
    return children


def _takes_snapshots(parent: Any, children: list[Any]) -> bool:
    """bwrap sandboxes whose places are volumes of one btrfs root (sandbox/volumes.py)."""
    store = getattr(parent, "volumes", None)
    return store is not None and all(getattr(c, "volumes", None) is store for c in children)


def fork_by_snapshot(parent: Any, children: list[Any]) -> ForkInfo | None:
    """The fork of bwrap sandboxes on btrfs volumes: each child shows a snapshot of the
    parent's subvolume at its places (BwrapSandbox.take_snapshot_of: ~2 ms, whatever the
    parent holds), then gets the parent's shell state. The host copies no file and reads
    none. None (nothing done) when the parent holds something in a writable place a fork
    carries outside its volume (/dev/shm or /var/tmp, where an image makes them writable):
    then the fork goes by pipes, which carries it."""
    look, _ = parent._helper_call({"op": "fork_look", "places": list(parent._place_paths())})
    held = look.get("held")
    if not look.get("ok") or not isinstance(held, list):
        raise ForkError(f"sandbox {parent.name}: fork refused: {str(look.get('error'))[:300]}")
    if held:
        return None
    shell = read_shell(parent)
    for c in children:  # one btrfs transaction each: in turn
        c.take_snapshot_of(parent)
    _parallel([partial(replay_shell, c, shell) for c in children])
    info = _info(parent.name, look)
    info.method = "snapshot"
    return info


class _NoSideChannel(Exception):
    """A docker helper could not reach its side channel: the fork goes through the host."""


def _takes_pipes(box: Any) -> bool:
    """Can the box's helper take a fork's pipe ends? bwrap: over its control socket;
    docker: over its side channel (sandbox/bulk.py), while its helper has reached it."""
    bulk = getattr(box, "bulk", None)
    return getattr(box, "ctl", None) is not None or (bulk is not None and bulk.enabled)


def _wipe(child: Any) -> None:
    """A given child a failed fork touched: reset it (a pool's wipe), or remove it."""
    if child.closed:
        return
    try:
        failed = child.reset()
    except Exception:  # noqa: BLE001 - then it goes
        failed = ["reset"]
    if failed:
        child.close()


def _parallel(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run jobs in threads (each child has its own channel); the first error is raised
    after all have ended."""
    if len(jobs) == 1:
        return [jobs[0]()]
    results: list[Any] = [None] * len(jobs)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for r in results:  # opened sandboxes of the jobs that did succeed
            if hasattr(r, "close"):
                r.close()
        raise errors[0]
    return results


def read_shell(parent: HelperSandbox) -> str:
    """The script that replays the parent's shell state (DUMP, run in its session shell)."""
    header, _ = parent._helper_call(
        {"op": "exec", "cmd": DUMP, "timeout": SHELL_TIMEOUT_S, "cap": SHELL_STATE_CAP}
    )
    out = header.get("stdout")
    if header.get("exit_code") is None or not isinstance(out, str):
        raise ForkError(f"sandbox {parent.name}: its shell state could not be read")
    if header.get("dropped_bytes") or header.get("truncated"):
        raise ForkError(
            f"sandbox {parent.name}: its shell state is over {SHELL_STATE_CAP} bytes "
            "(variables, functions, aliases): not forked"
        )
    return shell_script(out)


def stream_files(parent: HelperSandbox, children: list[Any]) -> ForkInfo:
    """The parent's writable places into every child through the host (docker; the fork
    by pipes is fork_by_pipes): each frame passed on as it arrives (one sender thread per
    child, QUEUE_FRAMES queued each). The parent's bounds are checked when its export
    ends; past one, the children are told to stop (ForkError)."""
    limits = parent.copy_limits
    max_bytes = min(writable_bound(parent), limits.max_bytes)
    msg = {
        "op": "fork_get",
        "max_bytes": max_bytes,
        "max_entries": limits.max_files,
        "max_seconds": limits.max_seconds,
    }
    uploads = []
    try:
        for c in children:
            uploads.append(c._check_open().upload({"op": "fork_put"}, bulk=c.bulk))
    except BaseException:
        for u in uploads:
            u.release()
        for c in children[len(uploads) :]:
            c.kill()
        raise
    senders = [_Sender(c, u) for c, u in zip(children, uploads, strict=True)]
    failure: BaseException | None = None
    info = ForkInfo(parent=parent.name)
    try:
        max_total = max_bytes + (limits.max_files + ROOTS_BOUND + 2) * ENTRY_OVERHEAD
        reply = parent._check_open().stream(
            msg, max_total=max_total, deadline_s=limits.max_seconds + 60.0, bulk=parent.bulk
        )
        with parent._consuming(reply, "(its writable places)"):
            for chunk in reply:
                for s in senders:
                    s.offer(chunk)
        info = _info(parent.name, reply.final or {})
        failure = _over_bound(parent, info, max_bytes)
    except BaseException as e:
        failure = e
    for s in senders:
        s.close()
    for s in senders:
        s.finish(abort=failure is not None)
    if failure is not None:
        raise failure
    for s in senders:
        if s.error is not None:
            raise s.error
    return info


PIPE_SIZE = 1 << 20  # each pipe's buffer: fewer switches between the two tars
RELOCK_MAX = 10_000  # locked entries whose modes a child puts back


def fork_by_pipes(parent: HelperSandbox, children: list[Any]) -> ForkInfo:
    """The fork by pipes (sandbox/_helper.py, op_fork_send / op_fork_recv / op_fork_wait;
    the ends go over bwrap's control socket, or docker's side channel, _send_with_fds):
    one pipe per child, its read end passed to the child's helper (GNU tar
    extracts from it as the sandbox user), the write ends to the parent's (one GNU tar per
    pipe archives what the parent's walk names). The host holds no byte of the archive and
    parses none. While the tars copy, the parent's shell state is read and replayed in
    each child but its cwd (and `$?`), which follow once the files are in, with the modes
    of what the parent's user had locked. The parent's walk checks the bounds as it goes
    (past one its tars are killed and the fork refused); a child's tar is killed at the
    deadline and writes no more than its tmpfs sizes hold."""
    limits = parent.copy_limits
    max_bytes = min(writable_bound(parent), limits.max_bytes)
    token = secrets.token_hex(8)
    deadline = time.monotonic() + limits.max_seconds + 60.0
    ends: list[int] = []
    started: list[Any] = []  # the sandboxes whose tars run: each gets a fork_wait
    header: dict[str, Any] = {}
    failure: BaseException | None = None
    pending: list[tuple[Any, Any, int]] = []
    try:
        writers = []
        for c in children:
            r, w = os.pipe2(os.O_CLOEXEC)
            ends += [r, w]
            writers.append(w)
            with contextlib.suppress(OSError):  # a smaller buffer only costs switches
                fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
            msg = {"op": "fork_recv", "token": token, "max_seconds": limits.max_seconds}
            pending.append(_send_with_fds(c, msg, [r]))
            _close(ends, r)
        msg = {"op": "fork_send", "token": token, "pipes": len(writers), "max_bytes": max_bytes,
               "max_entries": limits.max_files, "max_seconds": limits.max_seconds}  # fmt: skip
        pending.append(_send_with_fds(parent, msg, writers))
        for w in writers:  # the parent's tars hold the only write ends now
            _close(ends, w)
    except BaseException as e:
        failure = e
    finally:
        for fd in ends:
            os.close(fd)
    for item in pending:  # every request sent is answered (the channels stay in step)
        try:
            answer = _answer(item, deadline)
        except BaseException as e:  # noqa: BLE001 - raised below
            failure = failure or e
            continue
        if answer.get("ok"):
            started.append(item[0])
        elif failure is None:
            failure = ForkError(
                f"sandbox {item[0].name}: fork refused: {str(answer.get('error'))[:300]}"
            )
        if item[0] is parent:
            header = answer
    info = _info(parent.name, header)
    failure = failure or _over_bound(parent, info, max_bytes)
    rest = ""
    if failure is None:  # the shell state, while the tars copy
        try:
            head, _, rest = read_shell(parent).rpartition("\n#@cd\n")
            _parallel([partial(replay_shell, c, head) for c in children])
        except BaseException as e:
            failure = e
    for box in started:  # every tar ends (the children's see the end of their pipes)
        try:
            side = "send" if box is parent else "recv"
            msg = {"op": "fork_wait", "side": side}
            client = box._check_open()  # its tars may take max_seconds: wait that long
            left = max(1.0, deadline - time.monotonic())
            end, _ = box._guarded(lambda c=client, m=msg, t=left: c.request(m, timeout=t))
        except BaseException as e:  # noqa: BLE001 - raised below
            failure = failure or e
            continue
        if not end.get("ok") and failure is None:
            failure = ForkError(f"sandbox {box.name}: fork failed: {str(end.get('error'))[:300]}")
    if failure is not None:
        raise failure
    if _count(header.get("locked_left_out")):
        raise ForkError(
            f"sandbox {parent.name}: more locked files and folders (chmod 000 and the like) "
            "than a fork carries the modes of: not forked"
        )
    rest = relock_script(header.get("locked")) + rest
    _parallel([partial(replay_shell, c, rest) for c in children])
    info.method = "pipes"
    return info


def _send_with_fds(box: Any, msg: dict[str, Any], fds: list[int]) -> tuple[Any, Any, int]:
    """Send the fds over the box's control socket, then the request naming them; holds the
    channel until _answer. Docker: the request first, naming a side channel; once the
    helper says it reached it, the fds over it (_NoSideChannel when it did not: its
    refusal is read, the channel is in step, the side channel not offered again)."""
    client = box._check_open()
    if box.ctl is None:
        listener = box.bulk.listen()
        if listener is None:
            raise _NoSideChannel()
    client.lock.acquire()
    try:
        if box.ctl is not None:
            socket.send_fds(box.ctl, [msg["token"].encode()], fds)
            rid = client._send(msg, b"")
            return box, client, rid
        rid = client._send({**msg, "bulk": listener.name}, b"")
        side = client._bulk_ack(rid, listener, box.bulk)
        if side is None:  # its answer follows: the request failed before anything ran
            client.read_message(time.monotonic() + 30.0)
            client.lock.release()
            raise _NoSideChannel()
        try:
            socket.send_fds(side.sock, [msg["token"].encode()], fds)
        finally:
            side.close()
    except _NoSideChannel:
        raise
    except BaseException:
        client.lock.release()
        box.kill()
        raise
    return box, client, rid


def _answer(item: tuple[Any, Any, int], deadline: float) -> dict[str, Any]:
    """The helper's answer to a request of _send_with_fds; a broken channel removes the box."""
    box, client, rid = item

    def read() -> dict[str, Any]:
        try:
            header, _ = client.read_message(deadline)
            client._expect(header, rid)
            return header
        finally:
            client.lock.release()

    result: dict[str, Any] = box._guarded(read)
    return result


def _close(ends: list[int], fd: int) -> None:
    ends.remove(fd)
    os.close(fd)


def relock_script(raw: object) -> str:
    """Shell lines that put back the modes the parent's user had locked (its tar read them
    opened for the owner): deepest first, as the parent's helper did, one chmod for each
    run of the same mode. Bounded: the map came out of a sandbox."""
    if not isinstance(raw, dict):
        return ""
    runs: list[tuple[int, list[str]]] = []
    for path, mode in list(raw.items())[:RELOCK_MAX][::-1]:
        if not (isinstance(path, str) and type(mode) is int and 0 <= mode <= 0o7777):
            continue
        if runs and runs[-1][0] == mode and len(runs[-1][1]) < 200:
            runs[-1][1].append(shlex.quote(path))
        else:
            runs.append((mode, [shlex.quote(path)]))
    return "".join(f"/bin/chmod {m:o} -- {' '.join(ps)} 2>/dev/null\n" for m, ps in runs)


def _over_bound(parent: HelperSandbox, info: ForkInfo, max_bytes: int) -> ForkError | None:
    limits = parent.copy_limits
    if info.skipped.get("over_size") or info.skipped.get("over_count"):
        return ForkError(
            f"sandbox {parent.name}: its writable places hold more than a fork copies "
            f"({max_bytes} bytes, {limits.max_files} entries): not forked"
        )
    if info.skipped.get("time_limit"):
        return ForkError(
            f"sandbox {parent.name}: reading its writable places took over "
            f"{limits.max_seconds:g}s: not forked"
        )
    return None


class _Sender:
    """One child's side of a fork: a thread sending the frames queued for it."""

    def __init__(self, child: Any, upload: Any) -> None:
        self.child = child
        self.upload = upload
        self.error: BaseException | None = None
        self.queue: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUE_FRAMES)
        self.thread = threading.Thread(target=self._run, name="sandflow-fork-send", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (chunk := self.queue.get()) is not None:
            if self.error is None:
                try:
                    self.upload.send(chunk)
                except BaseException as e:  # noqa: BLE001 - raised by stream_files
                    self.error = e

    def offer(self, chunk: bytes | None) -> None:
        """Queue a frame; a child that takes none for STALL_S is removed (its sender then
        fails at once and empties the queue)."""
        try:
            self.queue.put(chunk, timeout=STALL_S)
        except queue.Full:
            self.error = self.error or ForkError(
                f"sandbox {self.child.name}: writing the fork stalled; removed"
            )
            self.child.kill()
            self.queue.put(chunk)

    def close(self) -> None:
        self.offer(None)
        self.thread.join()

    def finish(self, *, abort: bool) -> None:
        """End the child's payload and read its answer; a child that fails is removed."""
        if self.error is not None:
            self.upload.release()
            self.child.kill()
            return
        try:
            header = self.upload.end(abort=abort, timeout=FORK_PUT_TIMEOUT_S)
        except BaseException as e:  # noqa: BLE001 - raised by stream_files
            self.error = ForkError(f"sandbox {self.child.name}: writing the fork failed ({e})")
            self.child.kill()
            return
        if not abort and not header.get("ok"):
            self.error = ForkError(
                f"sandbox {self.child.name}: fork refused: {str(header.get('error'))[:300]}"
            )


def _info(parent: str, final: dict[str, Any]) -> ForkInfo:
    """The parent helper's account, bounded (it came out of a sandbox)."""
    raw = final.get("summary")
    summary: dict[str, Any] = raw if isinstance(raw, dict) else {}
    procs = final.get("processes")
    count = final.get("process_count")
    raw = summary.get("skipped")
    skipped: dict[str, Any] = raw if isinstance(raw, dict) else {}
    return ForkInfo(
        parent=parent,
        files_bytes=_count(summary.get("bytes")),
        entries=_count(summary.get("entries")),
        processes_not_carried=[str(p)[:200] for p in procs[:20]] if isinstance(procs, list) else [],
        process_count=_count(count),
        skipped={str(k)[:40]: _count(v) for k, v in list(skipped.items())[:20]},
    )


def _count(v: object) -> int:
    return v if type(v) is int and 0 <= v < 1 << 50 else 0


def shell_script(dump: str) -> str:
    """The restore script from the parent's dump: umask, hard then soft limits, the rest."""
    head, sep, script = dump.partition("#@script\n")
    if not sep:
        raise ForkError("the parent's shell state dump is malformed")
    lines: list[str] = []
    section = ""
    for line in head.splitlines():
        if line.startswith("umask "):
            lines.append(line)
        elif line in ("#@H", "#@S"):
            section = line[2]
        elif section and (m := _ULIMIT_LINE.search(line)) and m.group(1) in ULIMIT_FLAGS:
            value = m.group(2)
            if value == "unlimited" or value.isdigit():
                lines.append(f"ulimit -{section} -{m.group(1)} {value} 2>/dev/null")
    return "\n".join(lines) + "\n" + script


def replay_shell(child: HelperSandbox, shell: str) -> None:
    """Replay the parent's shell state in `child` (after its files are in)."""
    header, _ = child._helper_call(
        {"op": "exec", "cmd": shell, "timeout": SHELL_TIMEOUT_S, "cap": 4096}
    )
    if header.get("exit_code") is None or header.get("timed_out"):
        raise ForkError(f"sandbox {child.name}: the parent's shell state could not be replayed")
