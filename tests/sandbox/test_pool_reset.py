"""The warm pool: a reset sandbox is indistinguishable from a fresh one (both backends).

The battery: a dirty episode does everything an episode can do to leave state behind
(escaped processes, files in every writable place, locked folders, IPC objects, sockets,
shell state), the sandbox is given back and reset, and every named probe (PROBES; listed
in docs/sandbox.md) must observe the same as in a sandbox that was never used.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import pyseccomp
import pytest

from sandbox import Sandbox, SandboxClosed, SandboxConfig, SandboxError, open_sandbox
from sandbox.pool import CreationPacer, PoolSettings, SandboxPool

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TMPFS = "/testbed /home/sandbox /tmp /dev/shm /dev/mqueue"
WRITABLE = "/testbed /home/sandbox /tmp /dev/shm /dev/mqueue /run /var/tmp"
ADD_KEY, KEYCTL = (
    pyseccomp.resolve_syscall(pyseccomp.Arch.NATIVE, n) for n in ("add_key", "keyctl")
)

# name -> a command whose output is a deterministic observation of the sandbox's state
PROBES: dict[str, str] = {
    "processes": (  # every process but the probe itself: owner, state, command line
        'python3 -c "import os\n'
        "me = os.getpid()\n"
        "rows = []\n"
        "for p in filter(str.isdigit, os.listdir('/proc')):\n"
        " if int(p) == me: continue\n"
        " st = open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0]\n"
        " cmd = open(f'/proc/{p}/cmdline','rb').read().replace(b'\\0', b' ')[:60]\n"
        " rows.append((os.stat(f'/proc/{p}').st_uid, st, cmd))\n"
        'print(len(rows), sorted(rows))"'
    ),
    "cwd": "pwd",
    "environment": "env -u _ | sort",
    "shell_variables": "compgen -v | sort",
    "shell_functions_aliases_traps": "declare -F; alias; trap -p; jobs -l",
    "shell_options": "set -o; shopt",
    "umask": "umask; umask -S",
    "rlimits": "ulimit -a -S; ulimit -a -H",
    "shell_fds": "cd /proc/$$/fd && echo *; cd - >/dev/null",
    "writable_places_tree": (
        f"for d in {WRITABLE}; do [ -e $d ] && find $d -printf '%p %m %u %g %y %s\\n' "
        "2>&1 | sort; done"
    ),
    "writable_places_space": (  # the tmpfs mounts (/run and /var/tmp sit on the host's disk)
        f"for d in {TMPFS}; do [ -d $d ] && stat -f -c '%n %f %a %d' $d; done"
    ),
    "sysv_ipc": "cat /proc/sysvipc/shm /proc/sysvipc/sem /proc/sysvipc/msg",
    "listening_sockets": (
        'python3 -c "import sys\n'
        "for n in ('tcp','tcp6'):\n"
        " rows=open('/proc/net/'+n).read().splitlines()[1:]\n"
        " print(n, sorted(r.split()[1] for r in rows if r.split()[3]=='0A'))\n"
        "for n in ('udp','udp6','raw','unix'):\n"
        " print(n, len(open('/proc/net/'+n).read().splitlines()[1:]))\""
    ),
    "hostname_identity": "hostname; id; cat /proc/self/status | grep -E '^(Cap|NoNewPrivs|Seccomp)'",
    "acls_xattrs": (  # extended attributes and POSIX ACLs of every writable place and the
        # mode a new file gets in each (a default ACL beats the umask)
        'python3 -c "import os\n'
        f"for d in '{WRITABLE}'.split():\n"
        " if not os.path.isdir(d): continue\n"
        " try: names = sorted(os.listxattr(d))\n"
        " except OSError as e: names = [e.errno]\n"
        " print(d, [(n, os.getxattr(d, n).hex()) if isinstance(n, str) else n for n in names])\n"
        " f = os.path.join(d, '.sandflow-probe')\n"
        " try: os.close(os.open(f, os.O_CREAT | os.O_WRONLY, 0o666))\n"
        " except OSError as e: print(d, 'no file', e.errno); continue\n"
        ' print(d, oct(os.stat(f).st_mode), sorted(os.listxattr(f))); os.unlink(f)"'
    ),
    "keyring": (  # the kernel keyring: /proc/keys, and whether keyctl answers at all
        "cat /proc/keys /proc/key-users 2>&1 | sed 's/^[0-9a-f]* //'; "
        'python3 -c "import ctypes, os; l = ctypes.CDLL(None, use_errno=True); '
        f'print(l.syscall({KEYCTL}, 0, -4, 0), os.strerror(ctypes.get_errno()))"'
    ),
    "dev_shm": (  # POSIX shared memory: its mode, owner and size, and that it works
        "stat -c '%a %U' /dev/shm; stat -f -c '%b %S' /dev/shm; ls -A /dev/shm; "
        'python3 -c "import multiprocessing as mp; from multiprocessing import shared_memory\n'
        "mp.Lock(); m = shared_memory.SharedMemory(create=True, size=4096); m.buf[0] = 1\n"
        "m.close(); m.unlink(); print('shared memory works')\""
    ),
    "previous_status": "echo $?",
    "home_history": "ls -la ~ | awk '{print $1, $NF}'; history | wc -l",
}

DIRTY = r"""
cd /tmp && export LEFT=1 PATH=/tmp:$PATH && umask 077 && ulimit -S -n 100
alias ll='ls -l'; f() { :; }; set -o noclobber; shopt -s extglob; trap 'echo bye' EXIT
mkdir -p /testbed/a/b/c /home/sandbox/.cache/x /tmp/deep && echo x > /testbed/a/b/c/f
d=/tmp/deep; for i in $(seq 60); do d=$d/dddddddddd; done; mkdir -p $d && touch $d/leaf
chmod 000 /testbed/a/b; chmod 500 /home/sandbox/.cache; chmod 700 /testbed
echo 'echo hi' > /home/sandbox/.bashrc; echo cmd >> /home/sandbox/.bash_history
mkfifo /tmp/fifo; ln -s /etc/passwd /testbed/link; ln /testbed/a/b/c/f /testbed/hard 2>/dev/null
printf x > /tmp/$'we\nird name'; : > /tmp/.hidden
head -c 100000 /dev/zero > /dev/shm/blob
python3 -c "import os, _posixshmem; os.close(_posixshmem.shm_open('/left', os.O_CREAT | os.O_RDWR, 0o600))"
[ -d /dev/mqueue ] && [ -w /dev/mqueue ] && : > /dev/mqueue/q 2>/dev/null
ipcmk -M 65536 >/dev/null; ipcmk -Q >/dev/null; ipcmk -S 3 >/dev/null
(setsid sleep 1000 &) ; nohup sleep 999 >/dev/null 2>&1 &
bash -c '( ( trap "" TERM HUP; exec -a stubborn sleep 998 ) & ) &'
sleep 997 & kill -STOP $!; disown -a
python3 - <<'PY' &
import os, socket, time
t = socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
t.bind(("127.0.0.1", 8080)); t.listen()
u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("127.0.0.1", 9090))
a = socket.socket(socket.AF_UNIX); a.bind("\0sandflow-left"); a.listen()
f = socket.socket(socket.AF_UNIX); f.bind("/tmp/sock"); f.listen()
if os.fork() == 0:
    os.setsid()
time.sleep(1000)
PY
(while :; do echo noise; sleep 0.1; done) &
python3 - <<'PY'
import ctypes, os, struct
# a default ACL (new files: owner rw, nobody else) and an access ACL, where the user owns
# the place (docker's workdir and home), and user xattrs; keyctl/add_key for the keyring
def acl(*entries):
    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, 0xFFFFFFFF) for t, p in entries)
for d in ("/testbed", "/home/sandbox", "/tmp"):
    for name, value in (("system.posix_acl_default", acl((1, 6), (4, 0), (0x20, 0))),
                        ("system.posix_acl_access", acl((1, 7), (4, 5), (0x20, 0))),
                        ("user.left", b"x")):
        try:
            os.setxattr(d, name, value)
        except OSError:
            pass
l = ctypes.CDLL(None, use_errno=True)
l.syscall(@ADD_KEY@, b"user", b"left", b"secret", 6, -4)
PY
sleep 0.5
""".replace("@ADD_KEY@", str(ADD_KEY))


@pytest.fixture
def pool(make_config: Callable[..., SandboxConfig]) -> Iterator[Callable[..., SandboxPool]]:
    made: list[SandboxPool] = []

    def make(**settings: object) -> SandboxPool:
        p = SandboxPool(make_config("pooled"), PoolSettings(**settings))
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()
        for slot in list(p._slots):  # a failed test's leases: never leak them
            slot.box.kill()


def _observe(sb: Sandbox) -> dict[str, str]:
    out = {}
    for name, cmd in PROBES.items():
        r = sb.exec(cmd, timeout=30)
        out[name] = f"{r.exit_code}\n{r.stdout}\n{r.stderr}"
    return out


def _wait_idle(p: SandboxPool, n: int = 1) -> None:
    deadline = time.monotonic() + 30
    while p.idle < n and time.monotonic() < deadline:
        time.sleep(0.02)
    assert p.idle >= n, f"the pool did not get its sandbox back ({p.stats})"


def test_reset_sandbox_equals_fresh_on_every_probe(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig], backend: str
) -> None:
    with open_sandbox(make_config("fresh-probe")) as fresh:
        expected = _observe(fresh)
    p = pool()
    cfg = make_config("dirty")
    sb = p.acquire(cfg)
    name = sb.name
    before = _observe(sb)
    assert before == expected, "a newly created pooled sandbox differs from a fresh one"
    dirty = sb.exec(DIRTY, timeout=60)
    assert dirty.exit_code == 0, dirty.stderr
    dirtied = _observe(sb)
    sb.close()
    must_see: tuple[str, ...] = (
        "processes",
        "cwd",
        "environment",
        "umask",
        "writable_places_tree",
        "sysv_ipc",
    )
    if backend == "docker":  # the workdir and home are the user's own (bwrap: root's 1777)
        must_see += ("acls_xattrs",)
    missed = [
        probe
        for probe in must_see + ("listening_sockets", "dev_shm")
        if dirtied[probe] == expected[probe]
    ]
    assert missed == [], f"these probes did not see the dirty episode: {missed}"
    # /dev/shm is the same on both backends: a 1777 tmpfs of shm_size_mb where the
    # sandbox user's multiprocessing works (issue #37: bwrap's was root's 755)
    blocks = (64 << 20) // 4096
    assert expected["dev_shm"] == f"0\n1777 root\n{blocks} 4096\nshared memory works\n\n"
    assert "blob\nleft\n" in dirtied["dev_shm"]
    _wait_idle(p)
    again = p.acquire(make_config("next"))
    assert again.name == name, "the pool replaced the sandbox instead of resetting it"
    assert again.pooled_episodes == 1
    after = _observe(again)
    for probe in PROBES:
        assert after[probe] == expected[probe], (
            f"probe {probe!r} tells a reset sandbox from a fresh one"
        )
    again.close()
    assert p.stats.resets_failed == 0 and p.stats.created == 1


SHM_USE = r"""
import multiprocessing as mp, os
from multiprocessing import shared_memory

def work(lock, name, i):
    with lock:
        m = shared_memory.SharedMemory(name=name)
        m.buf[i] = i + 1
        m.close()

if __name__ == "__main__":
    lock = mp.Lock()
    m = shared_memory.SharedMemory(create=True, size=1 << 20)
    ps = [mp.Process(target=work, args=(lock, m.name, i)) for i in range(3)]
    [p.start() for p in ps]
    [p.join() for p in ps]
    print("workers", bytes(m.buf[:3]).hex())
    m.close()
    m.unlink()
    try:  # past the bound: the tmpfs is full, not the host's memory
        with open("/dev/shm/big", "wb") as f:
            f.write(b"x" * (9 << 20))
    except OSError as e:
        print("bounded", e.strerror)
    os.unlink("/dev/shm/big")
"""


def test_multiprocessing_and_shared_memory_work_in_a_bounded_dev_shm(
    make_config: Callable[..., SandboxConfig],
) -> None:
    """Issue #37: on bwrap /dev/shm was root's 755, so `multiprocessing.Lock()` and
    `shared_memory` (joblib, a torch DataLoader) failed; docker's is a 1777 tmpfs. Both
    backends: a 1777 tmpfs of `shm_size_mb`, writable by the sandbox user, bounded."""
    with open_sandbox(make_config("shm", shm_size_mb=8)) as sb:
        r = sb.exec("stat -c '%a %U' /dev/shm; stat -f -c '%b %S' /dev/shm", timeout=30)
        assert r.stdout.split("\n")[:2] == ["1777 root", f"{(8 << 20) // 4096} 4096"], r.stdout
        sb.write_file("/tmp/shm_use.py", SHM_USE)
        r = sb.exec("python3 /tmp/shm_use.py", timeout=60)
        assert r.exit_code == 0, r.stdout + r.stderr
        assert r.stdout == "workers 010203\nbounded No space left on device\n", r.stdout + r.stderr


DEFAULT_ACL = r"""
import os, struct
acl = struct.pack("<I", 2) + b"".join(
    struct.pack("<HHI", tag, perm, 0xFFFFFFFF) for tag, perm in ((1, 6), (4, 0), (0x20, 0))
)  # user::rw- group::--- other::---
for d in ("/testbed", "/home/sandbox"):
    try:
        os.setxattr(d, "system.posix_acl_default", acl)
        print(d, "set")
    except OSError as e:
        print(d, e.strerror)
"""


def test_a_default_acl_on_the_workdir_or_home_does_not_outlive_the_episode(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig], backend: str
) -> None:
    """Issue #22 item 10's sibling (#11): the next episode's new files were mode 600 while
    `umask` said 022. The reset removes ACLs and extended attributes from the writable
    places (the sandbox is reused), or the battery fails it (the sandbox is replaced)."""
    p = pool()
    sb = p.acquire(make_config("acl"))
    name = sb.name
    sb.write_file("/tmp/acl.py", DEFAULT_ACL)
    r = sb.exec("python3 /tmp/acl.py; umask; touch /testbed/f ~/g; stat -c '%a' /testbed/f ~/g")
    if backend == "docker":  # the user owns its workdir and home there (bwrap: root, 1777)
        assert r.stdout.split() == ["/testbed", "set", "/home/sandbox", "set", "0022", "600", "600"]
    sb.close()
    _wait_idle(p)
    again = p.acquire(make_config("after-acl"))
    r = again.exec(
        "umask; touch /testbed/f ~/g; stat -c '%a' /testbed/f ~/g; "
        "python3 -c \"import os; print(os.listxattr('/testbed'), os.listxattr(os.path.expanduser('~')))\""
    )
    assert r.stdout.split("\n")[:4] == ["0022", "644", "644", "[] []"], r.stdout + r.stderr
    assert again.name == name and p.stats.resets_failed == 0, p.stats
    again.close()


def test_lease_is_dead_after_close(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    p = pool()
    sb = p.acquire(make_config("lease"))
    sb.exec("echo secret > /testbed/s")
    sb.close()
    sb.close()  # idempotent
    with pytest.raises(SandboxClosed):
        sb.exec("cat /testbed/s")
    with pytest.raises(SandboxClosed):
        sb.read_file("/testbed/s")
    assert getattr(sb, "killed_by_signal", None) is None


def test_failed_reset_destroys_and_replaces(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    """An OOM kill is remembered by the cgroup: the reset cannot prove a fresh state."""
    p = pool()
    sb = p.acquire(make_config("oom"))
    name = sb.name
    r = sb.exec("python3 -c 'x = bytearray(2000 << 20)'", timeout=60)
    assert r.exit_code != 0
    sb.close()
    deadline = time.monotonic() + 30
    while p.idle == 0 and p.live and time.monotonic() < deadline:
        time.sleep(0.05)
    if p.stats.resets_failed == 0:  # rlimits instead of a cgroup (no OOM kill): nothing to remember
        assert p.idle == 1
        return
    assert p.idle == 0 and p.live == 0
    nxt = p.acquire(make_config("after-oom"))
    assert nxt.name != name and nxt.exec("echo ok").stdout == "ok\n"
    nxt.close()


def test_max_episodes_retires_the_sandbox(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    p = pool(max_episodes=2)
    names = []
    for i in range(3):
        sb = p.acquire(make_config(f"ep{i}"))
        names.append(sb.name)
        sb.close()
        if i < 2:
            deadline = time.monotonic() + 30
            while p.idle < 1 and p.live and time.monotonic() < deadline:
                time.sleep(0.02)
    assert names[0] == names[1] != names[2]
    assert p.stats.retired == 1


def test_episode_wall_clock_is_per_lease(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    from sandbox import SandboxExpired

    p = pool()
    cfg = make_config("wall", wall_clock_s=1.5)
    sb = p.acquire(cfg)
    t0 = time.monotonic()
    assert sb.exec("sleep 10").timed_out and time.monotonic() - t0 < 9.5  # cut, not waited
    with pytest.raises(SandboxExpired):
        sb.exec("true")
    sb.close()
    nxt = p.acquire(make_config("after-wall", wall_clock_s=30))
    assert nxt.exec("echo ok").stdout == "ok\n"  # a new sandbox, or the old one: never expired
    nxt.close()


def test_creation_failures_are_retried_and_reported(
    make_config: Callable[..., SandboxConfig],
) -> None:
    """Engine faults at creation: retried with back-off, counted; a persistent one is raised."""
    failures = {"left": 2}

    def flaky(cfg: SandboxConfig) -> Sandbox:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise SandboxError("injected: engine busy")
        return open_sandbox(cfg)

    p = SandboxPool(make_config("flaky"), PoolSettings(create_attempts=4), opener=flaky)
    try:
        sb = p.acquire(make_config("flaky-ep"), timeout=120)
        assert sb.exec("echo ok").stdout == "ok\n"
        sb.close()
        assert p.stats.create_failures == 2 and p.stats.created == 1
    finally:
        p.close()

    def broken(cfg: SandboxConfig) -> Sandbox:
        raise SandboxError("injected: engine down")

    p = SandboxPool(
        make_config("broken"), PoolSettings(create_attempts=2, create_rate=50), opener=broken
    )
    try:
        with pytest.raises(SandboxError, match="engine down"):
            p.acquire(make_config("broken-ep"), timeout=60)
        assert p.stats.creations_given_up == 1 and p.stats.create_failures == 2
    finally:
        p.close()


def test_pacer_ramps_up_and_backs_off() -> None:
    import threading

    pacer = CreationPacer(rate=10, rate_min=1, rate_max=40)
    stop = threading.Event()
    t0 = time.monotonic()
    for _ in range(10):  # the bucket starts full: one second's worth at once
        assert pacer.wait(stop)
    assert time.monotonic() - t0 < 0.8  # one token at hand would make these 10 take >= 0.9 s
    for _ in range(20):  # then 10/s
        assert pacer.wait(stop)
    assert time.monotonic() - t0 >= 1.5  # the bound itself: 20 tokens at 10/s take >= 2 s
    for _ in range(5):
        pacer.success()
    assert pacer.rate == 15
    pacer.failure()
    assert pacer.rate == 7.5
    stop.set()
    assert pacer.wait(stop) is False


def test_close_drains_the_pool(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    p = pool()
    assert p.prewarm(3, timeout=120) == 3
    boxes = [slot.box for slot in p._idle]
    leased = p.acquire(make_config("held"))
    p.close()
    assert all(b.closed for b in boxes[1:])
    leased.close()  # given back to a closed pool: destroyed
    assert leased.closed and p.live == 0


_POOL_OWNER = """
import sys, time
sys.path.insert(0, {repo!r})
from sandbox import SandboxConfig, SandboxLimits
from sandbox.pool import PoolSettings, SandboxPool
cfg = SandboxConfig(backend={backend!r}, run_id={run_id!r}, limits=SandboxLimits(memory_mb=256))
pool = SandboxPool(cfg, PoolSettings(create_rate=20))
held = pool.acquire(cfg)
pool.prewarm(3)
print(pool.live, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_owner_death_drains_the_pool(backend: str, test_run_id: str, sig: int) -> None:
    """SIGTERM/SIGINT: the registry's handler drains the pool; SIGKILL: the watchdog does."""
    from sandbox import gc as G
    from sandbox.engine import docker_client

    run_id = f"{test_run_id}-pool{int(sig)}"
    client = docker_client()

    def left() -> list[G.SandboxInfo]:
        return [i for i in G.list_all(client, run_id) if i.run_id == run_id]

    code = _POOL_OWNER.format(repo=REPO, backend=backend, run_id=run_id)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "4", "the owner did not fill its pool"
        assert len(left()) == 4
        proc.send_signal(sig)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 60
        while left() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left() == [], f"pooled {backend} sandboxes survived their owner's {sig!r}"
    finally:
        if proc.poll() is None:
            proc.kill()
        G.collect(client, everything=True, run_prefix=run_id)


def test_acquire_follows_the_reuse_setting(make_config: Callable[..., SandboxConfig]) -> None:
    from sandbox import acquire
    from sandbox.pool import PooledSandbox, close_all, pool_for

    fresh = acquire(make_config("fresh-acq"))
    try:
        assert not isinstance(fresh, PooledSandbox)
    finally:
        fresh.close()
    assert fresh.closed  # type: ignore[attr-defined]
    cfg = make_config("pooled-acq").model_copy(update={"reuse": "pool"})
    try:
        first = acquire(cfg)
        assert isinstance(first, PooledSandbox) and isinstance(first, Sandbox)
        name = first.name
        first.close()
        _wait_idle(pool_for(cfg))
        second = acquire(cfg.model_copy(update={"episode_id": "pooled-acq-2"}))
        assert (
            isinstance(second, PooledSandbox)
            and second.name == name
            and second.config.episode_id == "pooled-acq-2"
        )
        second.close()
    finally:
        close_all()


def test_a_lease_without_wall_clock_is_not_cut_by_the_previous_one(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    p = pool()
    first = p.acquire(make_config("short", wall_clock_s=2))
    name = first.name
    assert first.exec("echo ok").stdout == "ok\n"
    first.close()
    _wait_idle(p)
    second = p.acquire(make_config("long"))
    assert second.name == name
    r = second.exec("sleep 8; echo done", timeout=30)
    assert r.stdout == "done\n" and not r.timed_out  # the helper's lifetime was disarmed
    second.close()


def test_reset_outruns_a_forking_background_loop(
    pool: Callable[..., SandboxPool], make_config: Callable[..., SandboxConfig]
) -> None:
    """Processes that keep forking while the reset kills: kill(-1) takes them all at once."""
    p = pool()
    sb = p.acquire(make_config("forker"))
    name = sb.name
    sb.exec(
        "bash -c 'while :; do (sleep 0.05 &); sleep 0.01; done' >/dev/null 2>&1 & disown; sleep 0.3"
    )
    assert sb.exec("ps -eo args --no-headers | grep -c '[w]hile :'").stdout.strip() != "0"
    sb.close()
    _wait_idle(p)
    again = p.acquire(make_config("after-forker"))
    assert again.name == name, f"reset failed: {p.stats}"
    r = again.exec("ps -eo args --no-headers | grep -c -e '[w]hile :' -e '[s]leep 0.05'")
    assert r.stdout.strip() == "0"
    again.close()


def test_a_waiter_takes_the_sandbox_coming_back_from_its_reset(
    pool: Callable[..., SandboxPool],
    make_config: Callable[..., SandboxConfig],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An acquire while a reset is under way waits for it instead of creating a sandbox
    (a reset is ~10 ms, a creation 0.15-2 s and ~0.2 s of engine CPU)."""
    import sandbox.pool as pool_mod

    monkeypatch.setattr(pool_mod, "RESET_WAIT_S", 60.0)  # the policy, not the fallback's timing
    p = pool()
    first = p.acquire(make_config("back-1"))
    name = first.name
    first.exec("echo x > /testbed/left")
    first.close()  # reset in the background; the next acquire comes at once
    second = p.acquire(make_config("back-2"))
    try:
        assert second.name == name and p.stats.created == 1, p.stats
        assert second.exec("ls /testbed").stdout == ""
    finally:
        second.close()


def test_prewarm_starts_the_pool_for_a_config(make_config: Callable[..., SandboxConfig]) -> None:
    from sandbox import prewarm
    from sandbox.pool import close_all, pool_for

    assert prewarm(make_config("no-pool"), 2) == 0  # fresh per episode: nothing to warm
    cfg = make_config("warm").model_copy(update={"reuse": "pool"})
    try:
        prewarm(cfg, 2)
        p = pool_for(cfg)
        _wait_idle(p, 2)
        assert p.stats.created == 2
        sb = p.acquire(cfg)
        assert sb.exec("echo ok").stdout == "ok\n" and p.stats.created == 2
        sb.close()
    finally:
        close_all()


def test_the_reset_listener_check_sees_tcp_listeners(
    make_config: Callable[..., SandboxConfig],
) -> None:
    """The reset's socket check (sock_diag, LISTEN only) sees what /proc/net/tcp shows."""
    from sandbox.protocol import helper_source

    with open_sandbox(make_config("listeners")) as sb:
        sb.write_file("/tmp/sfhelper.py", helper_source())
        script = (
            "import socket, sys\n"
            "sys.path.insert(0, '/tmp'); import sfhelper as h\n"
            "print(h.tcp_listeners_netlink(2) + h.tcp_listeners_netlink(10))\n"
            "a = socket.socket(); a.bind(('127.0.0.1', 8080)); a.listen()\n"
            "b = socket.socket(); b.bind(('0.0.0.0', 8082)); b.listen()\n"
            "c = socket.socket(); c.connect(('127.0.0.1', 8080))\n"
            "print(h.tcp_listeners_netlink(2) + h.tcp_listeners_netlink(10))\n"
            "rows = open('/proc/net/tcp').read().splitlines()[1:]\n"
            "print(sorted(int(r.split()[1].split(':')[1], 16) for r in rows if r.split()[3] == '0A'))\n"
        )
        sb.write_file("/tmp/probe.py", script)
        r = sb.exec("python3 /tmp/probe.py")
    assert r.exit_code == 0, r.stderr
    before, after, proc = r.stdout.splitlines()
    assert before == "[]"
    assert after == (
        "['tcp:2:00000000000000000000000000000000:8082', 'tcp:2:7f000001000000000000000000000000:8080']"
    )
    assert proc == "[8080, 8082]"  # the same listeners as /proc; the connection is not one
