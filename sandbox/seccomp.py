"""The bubblewrap backend's seccomp filter: Docker's default policy, compiled by libseccomp.

Why: bubblewrap applies no syscall filter of its own, so a bwrap sandbox could call what a
docker sandbox cannot: `add_key`/`keyctl` (the kernel keyring is per uid and was shared
with every host process and every other sandbox of that uid), `bpf`, `userfaultfd`,
`perf_event_open`, new user namespaces (`unshare`, `clone` with `CLONE_NEW*`), `mount`,
`setns`, `kexec_load`, `init_module`, `add_key`... A docker sandbox runs under the engine's
default profile; this module gives bwrap the same one.

The policy mirrors Docker's default profile for a container without CAP_SYS_ADMIN (ours
have none): an allowlist, every other syscall fails with EPERM (so a syscall this list does
not know, on a newer kernel, is refused too); `clone` only without namespace flags,
`clone3` fails with ENOSYS (libc then falls back to `clone`, whose flags a filter can
see), `socket` anything but AF_VSOCK, `ioctl` anything but btrfs's (EOPNOTSUPP),
`personality` only the harmless personas. Only the native architecture's syscalls pass: a
32-bit syscall from a 64-bit process kills it.

libseccomp compiles the program (through `pyseccomp`, a ctypes binding of the system's
libseccomp2); bubblewrap loads it with `--seccomp FD` just before it runs the helper, so
the helper and everything it starts run under it (and under no-new-privileges, which
bubblewrap always sets). The program is compiled once per process.
"""

from __future__ import annotations

import errno
import functools
import os
import tempfile

# Docker's default allowlist (moby profiles/seccomp/default.json), the names libseccomp
# knows on this architecture; the 32-bit twins (`chown32`...) resolve to nothing on 64-bit.
_ALLOWED_WORDS = """
    accept accept4 access adjtimex alarm bind brk capget capset chdir chmod chown chown32
    clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime
    clock_gettime64 clock_nanosleep clock_nanosleep_time64 close close_range connect
    copy_file_range creat dup dup2 dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old
    epoll_pwait epoll_pwait2 epoll_wait epoll_wait_old eventfd eventfd2 execve execveat exit
    exit_group faccessat faccessat2 fadvise64 fadvise64_64 fallocate fanotify_mark fchdir
    fchmod fchmodat fchown fchown32 fchownat fcntl fcntl64 fdatasync fgetxattr flistxattr
    flock fork fremovexattr fsetxattr fstat fstat64 fstatat64 fstatfs fstatfs64 fsync
    ftruncate ftruncate64 futex futex_time64 futex_waitv futimesat getcpu getcwd getdents
    getdents64 getegid getegid32 geteuid geteuid32 getgid getgid32 getgroups getgroups32
    getitimer getpeername getpgid getpgrp getpid getppid getpriority getrandom getresgid
    getresgid32 getresuid getresuid32 getrlimit get_robust_list getrusage getsid getsockname
    getsockopt get_thread_area gettid gettimeofday getuid getuid32 getxattr
    inotify_add_watch inotify_init inotify_init1 inotify_rm_watch io_cancel ioctl io_destroy
    io_getevents io_pgetevents io_pgetevents_time64 ioprio_get ioprio_set io_setup io_submit
    io_uring_enter io_uring_register io_uring_setup ipc kill landlock_add_rule
    landlock_create_ruleset landlock_restrict_self lchown lchown32 lgetxattr link linkat
    listen listxattr llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 madvise
    membarrier memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock mlock2
    mlockall mmap mmap2 mprotect mq_getsetattr mq_notify mq_open mq_timedreceive
    mq_timedreceive_time64 mq_timedsend mq_timedsend_time64 mq_unlink mremap msgctl msgget
    msgrcv msgsnd msync munlock munlockall munmap name_to_handle_at nanosleep newfstatat
    _newselect open openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc
    pkey_free pkey_mprotect poll ppoll ppoll_time64 prctl pread64 preadv preadv2 prlimit64
    process_mrelease pselect6 pselect6_time64 pwrite64 pwritev pwritev2 read readahead
    readlink readlinkat readv recv recvfrom recvmmsg recvmmsg_time64 recvmsg
    remap_file_pages removexattr rename renameat renameat2 restart_syscall rmdir rseq
    rt_sigaction rt_sigpending rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend
    rt_sigtimedwait rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity sched_getattr
    sched_getparam sched_get_priority_max sched_get_priority_min sched_getscheduler
    sched_rr_get_interval sched_rr_get_interval_time64 sched_setaffinity sched_setattr
    sched_setparam sched_setscheduler sched_yield seccomp select semctl semget semop
    semtimedop semtimedop_time64 send sendfile sendfile64 sendmmsg sendmsg sendto setfsgid
    setfsgid32 setfsuid setfsuid32 setgid setgid32 setgroups setgroups32 setitimer setpgid
    setpriority setregid setregid32 setresgid setresgid32 setresuid setresuid32 setreuid
    setreuid32 setrlimit set_robust_list setsid setsockopt set_thread_area set_tid_address
    setuid setuid32 setxattr shmat shmctl shmdt shmget shutdown sigaltstack signalfd
    signalfd4 sigprocmask sigreturn socketcall socketpair splice stat stat64 statfs statfs64
    statx symlink symlinkat sync sync_file_range syncfs sysinfo tee tgkill time timer_create
    timer_delete timer_getoverrun timer_gettime timer_gettime64 timer_settime
    timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
    timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat
    utime utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid waitpid write writev
    process_vm_readv process_vm_writev ptrace arch_prctl modify_ldt arm_fadvise64_64
    arm_sync_file_range sync_file_range2 breakpoint cacheflush set_tls riscv_flush_icache
"""
ALLOWED: tuple[str, ...] = tuple(_ALLOWED_WORDS.split())
# process_vm_*/ptrace: as Docker allows them on kernels >= 4.8 (their own checks: the same
# uid, and dumpable; the helper is neither). arch_prctl/modify_ldt: x86; the arm/riscv
# names exist only there.

# Refused on purpose (not in the list above), among others: add_key request_key keyctl
# bpf userfaultfd perf_event_open unshare setns mount umount2 pivot_root chroot
# fsopen fsmount move_mount open_tree kexec_load kexec_file_load init_module
# finit_module delete_module reboot swapon swapoff acct quotactl syslog lookup_dcookie
# open_by_handle_at iopl ioperm settimeofday clock_settime sethostname setdomainname
# vhangup kcmp pidfd_getfd process_madvise fanotify_init get_mempolicy set_mempolicy mbind
# move_pages migrate_pages clone3 (ENOSYS), clone with CLONE_NEW*, socket(AF_VSOCK).

CLONE_NAMESPACES = 0x7E020000  # CLONE_NEWNS|NEWCGROUP|NEWUTS|NEWIPC|NEWUSER|NEWPID|NEWNET
AF_VSOCK = 40
BTRFS_IOCTL_TYPE = 0x94
PERSONAS = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # linux, +UNAME26 variants, the query


class SeccompUnavailable(RuntimeError):
    """The filter cannot be built here (no libseccomp): a bwrap sandbox must not start."""


@functools.cache
def program() -> bytes:
    """The compiled BPF program (what `bwrap --seccomp FD` reads), built once per process."""
    try:
        import pyseccomp as sc
    except (ImportError, OSError) as e:  # OSError: libseccomp.so.2 missing or unloadable
        raise SeccompUnavailable(
            f"cannot build the sandbox's seccomp filter: {e} (needs the `pyseccomp` package "
            "and the system's libseccomp2: `apt-get install -y libseccomp2`)"
        ) from None
    flt = sc.SyscallFilter(sc.ERRNO(errno.EPERM))
    for name in ALLOWED:
        if name == "ioctl":  # below, all but btrfs's
            continue
        try:
            number = sc.resolve_syscall(sc.Arch.NATIVE, name)
        except (OSError, ValueError):
            continue
        if number < 0:  # not a syscall of this architecture
            continue
        flt.add_rule(sc.ALLOW, number)
    flt.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_NAMESPACES, 0))
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    flt.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.NE, AF_VSOCK))
    # btrfs's ioctls (subvolumes, snapshots, reflinks; magic 0x94): a sandbox whose places
    # are btrfs volumes (sandbox/volumes.py) must not make subvolumes the host would have
    # to find, nor clone blocks its quota does not count. EOPNOTSUPP: `cp` copies instead.
    # (libseccomp lets an unconditional rule win, and has no "masked not equal": so each
    # other ioctl type byte is allowed by its own rule)
    flt.add_rule(
        sc.ERRNO(errno.EOPNOTSUPP), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFF00, BTRFS_IOCTL_TYPE << 8)
    )
    for kind in range(256):
        if kind != BTRFS_IOCTL_TYPE:
            flt.add_rule(sc.ALLOW, "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFF00, kind << 8))
    for persona in PERSONAS:
        flt.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    with tempfile.TemporaryFile() as f:
        flt.export_bpf(f)
        f.seek(0)
        data = f.read()
    if not data or len(data) % 8:
        raise SeccompUnavailable(f"libseccomp exported a malformed program ({len(data)} bytes)")
    return data


def unavailable() -> str | None:
    """Why no bwrap sandbox can start here for want of its filter, or None."""
    try:
        program()
    except SeccompUnavailable as e:
        return str(e)
    return None


def program_fd() -> int:
    """A pipe's read end holding the program, for `bwrap --seccomp FD` (the caller closes it).

    The program (a few KB) fits a pipe's buffer, so it is written whole before bwrap runs.
    """
    data = program()
    r, w = os.pipe()
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view) :]
    except BaseException:
        os.close(r)
        raise
    finally:
        os.close(w)
    return r
