"""Tar in, tar out: the only way files cross the sandbox boundary.

Files travel as tar streams (docker's put_archive/get_archive, or the helper's put/get
ops), never through shell quoting, so any byte content and any size round-trips.

Exporting is the dangerous direction: the sandbox controls what the tar contains. So
`safe_extract` writes only regular files and directories, only under the chosen host
folder, never through a symlink, and within a byte and file-count budget; everything
else (symlinks, hard links, devices, fifos, absolute or `..` names) is skipped and
reported, never followed.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from sandbox.image import SANDBOX_UID


@dataclass(frozen=True)
class CopyLimits:
    """Bounds on one copy: a runaway sandbox must not fill the host's disk nor stall a run.

    `max_files` counts every entry (files, folders, links, anything else), the copied folder
    itself excepted; `max_seconds` bounds an export's walk in the sandbox (what is left when
    it runs out is reported, never waited for).
    """

    max_bytes: int = 1 << 30
    max_files: int = 100_000
    max_seconds: float = 60.0


SKIPPED_SAMPLE = 100  # (name, why) pairs kept on ExportedFiles.skipped; the summary counts all
EXAMPLES = 5  # names kept per reason in the summary
EXAMPLE_CHARS = 200

# Why an entry was not written, as the summary's keys (stable: they go into the warehouse).
REASONS = {
    "unsafe_name": "absolute or '..' name",
    "symlink": "symlink (never followed)",
    "hard_link": "hard link to a file outside the export",
    "device": "device file",
    "fifo": "fifo",
    "special": "fifo, socket or device file (not sent)",
    "outside": "would leave the host folder through a symlink",
    "over_count": "over the entry-count limit",
    "over_size": "over the size limit",
    "time_limit": "not looked at: the export's time limit ran out",
    "unreadable": "unreadable in the sandbox",
    "changed": "changed while it was exported (written zero-padded)",
    "write_error": "cannot be written on the host",
}


@dataclass
class ExportSummary:
    """One structured account of an export: what was written, what was not, and why.

    Counts are exact unless `count_exact` is False (the count of what was left out past a
    cap stopped at its own time bound); `examples` keeps a few names per reason.
    """

    files: int = 0
    dirs: int = 0
    bytes: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[str]] = field(default_factory=dict)
    stopped: str | None = None  # "count" | "time": the sandbox side stopped walking early
    count_exact: bool = True
    seconds: float = 0.0

    def add(self, reason: str, name: str, n: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + n
        names = self.examples.setdefault(reason, [])
        shown = printable(name)
        if len(names) < EXAMPLES and shown not in names:
            names.append(shown)

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def merge_helper(self, raw: object) -> None:
        """Fold in the sandbox side's own account; hostile input: only known keys, bounded."""
        if not isinstance(raw, dict):
            return
        skipped, examples = raw.get("skipped"), raw.get("examples")
        if isinstance(skipped, dict):
            for reason, n in list(skipped.items())[: len(REASONS)]:
                if reason in REASONS and type(n) is int and 0 <= n < 1 << 40:
                    self.skipped[reason] = self.skipped.get(reason, 0) + n
        if isinstance(examples, dict):
            for reason, names in list(examples.items())[: len(REASONS)]:
                if reason in self.skipped and isinstance(names, list):
                    for name in names[:EXAMPLES]:
                        if isinstance(name, str):
                            kept = self.examples.setdefault(reason, [])
                            if len(kept) < EXAMPLES:
                                kept.append(printable(name))
        if raw.get("stopped") in ("count", "time"):
            self.stopped = raw["stopped"]
        if raw.get("count_exact") is False:
            self.count_exact = False
        if isinstance(raw.get("seconds"), int | float):
            self.seconds = float(raw["seconds"])

    def as_dict(self) -> dict[str, object]:
        return {
            "files": self.files,
            "dirs": self.dirs,
            "bytes": self.bytes,
            "skipped_total": self.total_skipped,
            "skipped": dict(self.skipped),
            "examples": {k: list(v) for k, v in self.examples.items()},
            "stopped": self.stopped,
            "count_exact": self.count_exact,
            "seconds": self.seconds,
        }

    def describe(self, limits: CopyLimits | None = None) -> str:
        """One line for a log or an error message."""
        text = f"{self.files} files, {self.dirs} folders, {self.bytes} bytes written"
        if not self.skipped:
            return text
        parts = []
        for reason, n in sorted(self.skipped.items(), key=lambda kv: -kv[1]):
            why = REASONS.get(reason, reason)
            if limits is not None and reason == "over_count":
                why += f" of {limits.max_files}"
            elif limits is not None and reason == "over_size":
                why += f" of {limits.max_bytes} bytes"
            elif limits is not None and reason == "time_limit":
                why += f" ({limits.max_seconds:g}s)"
            more = "" if self.count_exact or reason not in ("over_count", "time_limit") else "+"
            names = ", ".join(self.examples.get(reason, [])[:3])
            parts.append(f"{n}{more} {why}" + (f" (e.g. {names})" if names else ""))
        return f"{text}; {self.total_skipped} skipped: " + "; ".join(parts)


def printable(name: str) -> str:
    """A sandbox-chosen name made safe for logs and terminals: bounded, no control bytes."""
    name = name[:EXAMPLE_CHARS]
    if name.isprintable():
        return name
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in name)


class ExportedFiles(list[Path]):
    """The host paths written by copy_out, plus what was skipped and why.

    `summary` counts everything; `skipped` keeps the first SKIPPED_SAMPLE (name, why) pairs.
    """

    def __init__(self) -> None:
        super().__init__()
        self.skipped: list[tuple[str, str]] = []
        self.bytes_written = 0
        self.summary = ExportSummary()

    def skip(self, reason: str, name: str, why: str | None = None) -> None:
        self.summary.add(reason, name)
        if len(self.skipped) < SKIPPED_SAMPLE:
            self.skipped.append((name, printable(why) if why else REASONS[reason]))


def _info(
    name: str, *, size: int = 0, mode: int = 0o644, kind: bytes = tarfile.REGTYPE
) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = mode
    info.type = kind
    info.uid = info.gid = SANDBOX_UID
    info.uname = info.gname = "sandbox"
    info.mtime = int(time.time())
    return info


def file_tar(rel_path: str, data: bytes, *, parents: Iterable[str] = ()) -> bytes:
    """A tar holding `parents` (directories, outermost first) and one file at `rel_path`."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        for d in parents:
            tar.addfile(_info(d, mode=0o755, kind=tarfile.DIRTYPE))
        tar.addfile(_info(rel_path, size=len(data)), io.BytesIO(data))
    return buf.getvalue()


def open_checked(path: str, st: os.stat_result, real_root: str) -> IO[bytes]:
    """Open a host file for copy_in only if it is still the regular file the walk saw and
    it is inside the copied folder: no final symlink (O_NOFOLLOW; a fifo does not block),
    the same inode as the walk's lstat, and its own path under /proc/self/fd inside the
    folder. A file or folder swapped for a symlink after the walk is never followed."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(
            f"copy_in: {path} changed while it was being copied ({exc.strerror})"
        ) from None
    try:
        now = os.fstat(fd)
        if not stat.S_ISREG(now.st_mode) or (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            raise ValueError(f"copy_in: {path} changed while it was being copied")
        try:
            actual: str | None = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: O_NOFOLLOW and the inode check stand alone
            actual = None
        if actual is not None and os.path.commonpath([actual, real_root]) != real_root:
            raise ValueError(f"copy_in: {path} leads to {actual}, outside {real_root}")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def tree_tar(
    host_dir: Path, prefix: str, limits: CopyLimits
) -> tuple[bytes, list[tuple[str, str]]]:
    """A tar of a host folder for copy_in; host symlinks and special files are skipped."""
    root = Path(host_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"copy_in: host folder {root} does not exist or is not a folder")
    skipped: list[tuple[str, str]] = []
    total = files = 0
    real_root = os.path.realpath(root)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:", format=tarfile.PAX_FORMAT) as tar:
        prefix = prefix.strip("/")
        parts = prefix.split("/") if prefix else []
        for i in range(len(parts)):
            tar.addfile(_info("/".join(parts[: i + 1]), mode=0o755, kind=tarfile.DIRTYPE))
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root)
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                rel = posixpath.normpath(posixpath.join(prefix, rel_dir, name))
                st = os.lstat(full)
                if stat.S_ISDIR(st.st_mode):
                    if os.path.islink(full):
                        skipped.append((rel, "symlink"))
                        dirnames.remove(name)
                        continue
                    tar.addfile(_info(rel, mode=0o755, kind=tarfile.DIRTYPE))
                elif stat.S_ISREG(st.st_mode):
                    files += 1
                    total += st.st_size
                    if files > limits.max_files or total > limits.max_bytes:
                        raise ValueError(
                            f"copy_in: {root} holds more than {limits.max_files} files or "
                            f"{limits.max_bytes} bytes (at {rel})"
                        )
                    with open_checked(full, st, real_root) as f:
                        tar.addfile(
                            _info(
                                rel, size=st.st_size, mode=0o755 if st.st_mode & 0o111 else 0o644
                            ),
                            f,
                        )
                else:
                    skipped.append(
                        (rel, "symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file")
                    )
    return buf.getvalue(), skipped


class _ChunkReader(io.RawIOBase):
    """A file object over an iterator of byte chunks (the helper's streamed answer)."""

    def __init__(self, chunks: Iterable[bytes]) -> None:
        self._it: Iterator[bytes] = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            try:
                self._buf = next(self._it)
            except StopIteration:
                return 0
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


MAX_META_BYTES = 1 << 16  # a pax or GNU long-name header: names and attributes, not data


class BoundedTarInfo(tarfile.TarInfo):
    """Refuses metadata headers (pax, GNU long names) bigger than MAX_META_BYTES.

    tarfile reads such a header's whole declared size into memory before looking at it; a
    forged header declaring gigabytes must be an error, not an allocation.
    """

    _META_TYPES = (
        tarfile.XHDTYPE,
        tarfile.XGLTYPE,
        tarfile.SOLARIS_XHDTYPE,
        tarfile.GNUTYPE_LONGNAME,
        tarfile.GNUTYPE_LONGLINK,
    )

    def _proc_member(self, tarfile_: tarfile.TarFile) -> tarfile.TarInfo:
        if self.type in self._META_TYPES and self.size > MAX_META_BYTES:
            raise tarfile.ReadError(
                f"a tar metadata header of {self.size} bytes (limit {MAX_META_BYTES})"
            )
        return super()._proc_member(tarfile_)  # type: ignore[misc]


def open_stream(chunks: Iterable[bytes] | bytes) -> tarfile.TarFile:
    if isinstance(chunks, bytes | bytearray):
        return tarfile.open(fileobj=io.BytesIO(chunks), mode="r|", tarinfo=BoundedTarInfo)
    return tarfile.open(
        fileobj=io.BufferedReader(_ChunkReader(chunks), 1 << 20), mode="r|", tarinfo=BoundedTarInfo
    )


def read_single_file(
    chunks: Iterable[bytes] | bytes, path: str, max_bytes: int = 1 << 30
) -> tuple[bytes | None, str | None]:
    """(content, None) for a regular file; (None, link target) for a symlink."""
    with open_stream(chunks) as tar:
        for member in tar:
            if member.isfile():
                if member.size > max_bytes:
                    raise ValueError(
                        f"read_file: {path} is {member.size} bytes, over the limit of {max_bytes}"
                    )
                f = tar.extractfile(member)
                assert f is not None
                content = f.read(member.size)
                return content, None
            if member.issym():
                return None, member.linkname
            if member.isdir():
                raise IsADirectoryError(f"read_file: {path} is a directory")
            raise ValueError(f"read_file: {path} is not a regular file")
    raise FileNotFoundError(f"read_file: {path}: empty archive")


def _safe_rel(name: str) -> str | None:
    """The member name without its first component, or None when it is unsafe."""
    if name.startswith("/") or "\\" in name or "\0" in name:
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if any(p == ".." for p in parts):
        return None
    return "/".join(parts[1:])


def _reason(member: tarfile.TarInfo) -> tuple[str, str] | None:
    """(summary key, words) for an entry that is never written, else None."""
    if member.issym():
        return "symlink", f"symlink -> {member.linkname}"
    if member.islnk():
        return "hard_link", f"hard link -> {member.linkname}"
    if member.ischr() or member.isblk():
        return "device", "device file"
    if member.isfifo():
        return "fifo", "fifo"
    if not (member.isfile() or member.isdir()):
        return "special", "special file"
    return None


def safe_extract(
    chunks: Iterable[bytes] | bytes, host_dir: Path | str, limits: CopyLimits
) -> ExportedFiles:
    """Write the archive's regular files and folders under `host_dir`, and nothing else.

    The archive's top-level entry (the exported folder itself) maps to `host_dir`. Every
    other entry, whatever its kind, counts against `limits.max_files`; past it nothing more
    is created (the rest is only counted).
    """
    root = Path(host_dir)
    root.mkdir(parents=True, exist_ok=True)
    root = root.resolve()
    out = ExportedFiles()
    summary = out.summary
    extracted: dict[str, Path] = {}  # member name -> where we wrote it (for hard links)
    budget = _Budget(limits.max_files)
    over = f"over the file-count limit of {limits.max_files}"
    with open_stream(chunks) as tar:
        for member in tar:
            name = member.name
            rel = _safe_rel(name)
            if rel == "" and member.isdir():
                continue  # the exported folder itself: host_dir
            if not budget.spend():
                out.skip("over_count", name, over)
                continue
            if rel is None:
                out.skip("unsafe_name", name)
                continue
            why = _reason(member)
            if member.islnk() and member.linkname in extracted:
                why = None  # a second name of a file we already wrote: write a copy of it
            if why:
                out.skip(why[0], name, why[1])
                continue
            if rel == "":
                if member.isfile():  # a single file was exported: keep its own name
                    rel = posixpath.basename(name.rstrip("/"))
                else:
                    continue
            try:
                target = _prepare(root, rel, is_dir=member.isdir(), budget=budget)
            except _OverCount:
                out.skip("over_count", name, over)
                continue
            if target is None:
                out.skip("outside", name)
                continue
            if member.isdir():
                summary.dirs += 1
                continue
            size = extracted[member.linkname].stat().st_size if member.islnk() else member.size
            if out.bytes_written + size > limits.max_bytes:
                out.skip("over_size", name, f"over the size limit of {limits.max_bytes} bytes")
                continue
            if member.islnk():
                src: IO[bytes] | None = open(extracted[member.linkname], "rb")  # noqa: SIM115
                member.size = size
            else:
                src = tar.extractfile(member)
            if src is None:
                continue
            mode = 0o755 if member.mode & 0o111 else 0o644
            try:
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, mode)
            except OSError as e:
                src.close()
                out.skip("write_error", name, f"cannot write: {e.strerror}")
                continue
            with os.fdopen(fd, "wb") as f, src:
                left = size
                while left > 0 and (chunk := src.read(min(left, 1 << 20))):
                    f.write(chunk)
                    left -= len(chunk)
            out.bytes_written += size
            summary.files += 1
            summary.bytes += size
            out.append(target)
            extracted[name] = target
    return out


class _Budget:
    """Entries left under the count cap; folders created implicitly (a member's missing
    parents) spend it too, so a deep name cannot create more than the cap allows."""

    def __init__(self, left: int) -> None:
        self.left = left

    def spend(self) -> bool:
        self.left -= 1
        return self.left >= 0


def _prepare(root: Path, rel: str, *, is_dir: bool, budget: _Budget) -> Path | None:
    """Create the parents of root/rel without ever passing through a symlink."""
    parts = rel.split("/")
    cur = root
    for i, part in enumerate(parts):
        cur = cur / part
        last = i == len(parts) - 1
        if os.path.islink(cur):
            return None
        if last and not is_dir:
            return cur
        if not cur.exists():
            if not last and not budget.spend():
                raise _OverCount
            cur.mkdir(mode=0o755)
        elif not cur.is_dir():
            return None
    return cur


class _OverCount(Exception):
    """Creating a member's missing parent folders would pass the entry-count cap."""
