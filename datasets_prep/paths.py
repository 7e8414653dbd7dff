"""Host paths named by data stay inside the folder they belong to.

Two places read host files because data or a user's folder names them:

* a table's `context_path` column (a document per row, relative to the table's folder):
  `read_inside(table_dir, value)`;
* `sandflow run -i DIR` (every file of the user's folder goes to the sandbox, the prompt
  and the records): `read_input_folder(DIR)`.

The rules, for both:

* a path is relative, has no `..` component and no NUL byte; it is resolved with every
  symlink followed (`os.path.realpath`) and must still be inside the folder. `..`,
  absolute paths, `/proc/self/environ` and symlinks (or symlink chains, relative or
  absolute, to files or folders) that leave the folder are refused with a message
  naming the path and where it leads;
* only regular files are read (no fifo — which would block —, socket or device);
* the file is opened without following a final symlink (`O_NOFOLLOW`), and what was
  actually opened is checked again (the fd's own path under /proc/self/fd must be
  inside the folder, and it must be the file that was checked): a file or folder
  swapped for a symlink between the check and the read (TOCTOU) is refused, never
  followed;
* sizes are checked with stat before reading and the read itself is bounded, so a
  file that grows after the check cannot blow the limit either.

Inside an input folder, a symlink to a *file* that stays inside is read as that file's
content (under the link's name); a symlink to a *folder* that stays inside is skipped
(its files are already copied under their own path) and reported. A hard link is the
file itself (the kernel cannot say where "else" it lives): it is read as content, like
any regular file the user put in the folder.
"""

from __future__ import annotations

import errno
import os
import stat
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from datasets_prep import limits as L

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
# Characters that make a name lie about itself: controls (newline, escape, ...) and the
# bidirectional overrides/isolates that render "txt.exe" as "exe.txt".
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f")
MAX_SHOWN_PROBLEMS = 20


class UnsafePathError(ValueError):
    """A host path named by data or a user's folder leads outside its folder, or cannot be
    read safely. The message names the path (and the caller adds the row and field)."""


class UnreadablePathError(UnsafePathError):
    """The path is where it should be but cannot be read (permissions, an I/O error)."""


class InputFolderError(ValueError):
    """A `sandflow run -i` folder holds something that cannot go into a sandbox; the
    message lists every offending entry by name."""


def show(name: str) -> str:
    """A name as it can be printed: undecodable bytes as \\xNN escapes, controls escaped."""
    try:
        text = os.fsencode(name).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a lone surrogate that is not an undecodable byte
        text = name.encode("utf-8", "backslashreplace").decode("ascii")
    text = "".join(
        c if c.isprintable() and c not in _BIDI else f"\\u{ord(c):04x}" if ord(c) > 0xFF else f"\\x{ord(c):02x}"
        for c in text
    )
    return f"'{text}'"


def name_problem(name: str) -> str | None:
    """Why a file name cannot be used in a task (None: it can).

    Names must be UTF-8 (the records, the prompt and Parquet are), free of control and
    bidirectional-override characters (they would forge lines of the prompt or disguise
    the name), relative, and without `..`."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8"
    for c in name:
        if c in _BIDI or unicodedata.category(c) == "Cc":
            what = "a NUL byte" if c == "\x00" else f"the control character U+{ord(c):04X}"
            return f"contains {what}"
    if name.startswith("/"):
        return "is an absolute path"
    if ".." in PurePosixPath(name).parts:
        return "contains '..'"
    return None


def _real_folder(root: str | Path) -> str:
    """The folder, resolved; '/' is refused: every host file would be "inside" it."""
    real = os.path.realpath(root)
    if real == "/":
        raise UnsafePathError(
            f"the folder {str(root)!r} is the root of the file system, so every host file would be "
            "inside it; keep the table (or the input files) in a folder of their own"
        )
    return real


def folder_to_walk(root: str | Path, what: str) -> str:
    """`root` resolved, for a walk (walk_folder); UnsafePathError naming `what` when it is
    '/' or not a folder."""
    try:
        real = _real_folder(root)
    except UnsafePathError as e:
        raise UnsafePathError(f"{what}: {e}") from None
    if not os.path.isdir(real):
        raise UnsafePathError(f"{what} {str(root)!r} is not a folder")
    return real


def inside(path: str | Path, root: str | Path) -> bool:
    """`path` is `root` or below it (both already resolved)."""
    return Path(path) == Path(root) or Path(path).is_relative_to(root)


def resolve_inside(root: str | Path, name: str) -> Path:
    """`name` (relative to `root`) with every symlink followed; refused unless it stays in
    `root`. Raises UnsafePathError naming the path and, for a symlink, where it leads."""
    if not isinstance(name, str):
        raise UnsafePathError(f"{name!r} is not a path (a {type(name).__name__})")
    if not name.strip():
        raise UnsafePathError("the path is empty")
    if "\x00" in name:
        raise UnsafePathError(f"{show(name)} contains a NUL byte")
    if PurePosixPath(name).is_absolute():
        raise UnsafePathError(
            f"{show(name)} is an absolute path; paths are read relative to {str(root)!r} and "
            "must stay inside it"
        )
    if ".." in PurePosixPath(name).parts:
        raise UnsafePathError(f"{show(name)} contains '..'; paths must stay inside {str(root)!r}")
    real_root = _real_folder(root)
    target = os.path.realpath(os.path.join(real_root, name))
    if not inside(target, real_root):
        raise UnsafePathError(
            f"{show(name)} leads to {target!r} (through a symlink), outside {str(root)!r}; "
            "paths must stay inside the folder"
        )
    return Path(target)


def open_regular(path: str | Path, *, root: str | Path, expect: os.stat_result | None = None) -> int:
    """An fd for reading the regular file `path`, proven to be inside `root` (resolved).

    The final component is not followed (O_NOFOLLOW), a fifo does not block (O_NONBLOCK),
    and after opening, the fd itself is checked: a regular file, the same file as
    `expect` (from an earlier lstat), and — through /proc/self/fd — inside `root`. So a
    path component swapped for a symlink after the caller's checks is never read."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENXIO, errno.ENOTDIR):  # a link or a special file swapped in
            raise UnsafePathError(f"{str(path)!r} cannot be opened safely: {e.strerror}") from None
        raise UnreadablePathError(f"{str(path)!r} cannot be read: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{str(path)!r} is not a regular file")
        if expect is not None and (st.st_dev, st.st_ino) != (expect.st_dev, expect.st_ino):
            raise UnsafePathError(f"{str(path)!r} was replaced while it was being read")
        try:
            actual = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # no /proc: the O_NOFOLLOW open and the inode check stand alone
            actual = None
        if actual is not None and not inside(actual, root):
            raise UnsafePathError(f"{str(path)!r} leads to {actual!r}, outside {str(root)!r}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_fd(fd: int, limit: int, what: str, field: str, per: str) -> bytes:
    """Read at most `limit` bytes; one byte more is an error (the file grew past it)."""
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = os.read(fd, min(1 << 20, limit + 1 - got))
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        got += len(chunk)
        if got > limit:
            raise UnsafePathError(L.over_limit(what, got, field, per) + " (it grew while being read)")


def read_inside(root: str | Path, name: str, *, limit: int | None = None) -> bytes:
    """The bytes of the file `name` names relative to `root`; nothing outside `root` is
    ever opened (see the module doc). Raises UnsafePathError naming the path."""
    target = resolve_inside(root, name)
    real_root = _real_folder(root)
    try:
        st = os.stat(target)
    except FileNotFoundError:
        raise UnsafePathError(f"{show(name)} does not exist in {str(root)!r}") from None
    except OSError as e:
        raise UnsafePathError(f"{show(name)} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise UnsafePathError(f"{show(name)} is not a regular file")
    limit = L.LIMITS.max_file_bytes if limit is None else limit
    if st.st_size > limit:
        raise UnsafePathError(L.over_limit(show(name), st.st_size, "max_file_bytes", "per file"))
    fd = open_regular(target, root=real_root, expect=st)
    try:
        return read_fd(fd, limit, show(name), "max_file_bytes", "per file")
    finally:
        os.close(fd)


# ----------------------------------------------------------------- sandflow run -i DIR
@dataclass
class InputFolder:
    """The files of a user's input folder, ready to become a task's `input_files`."""

    files: dict[str, str | bytes] = field(default_factory=dict)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (name, why), not errors
    total_bytes: int = 0


@dataclass
class _Planned:
    name: str
    path: str
    st: os.stat_result


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


@dataclass
class WalkEntry:
    """One entry of a folder walk (`walk_folder`): what it is, and what the caller needs to
    say about it. `detail` is the OS error, the name problem, the symlink's target (for
    `link_outside`), the folder a symlink names (for `link_dir`) or the file kind."""

    kind: str  # file | dir | unlistable | bad_name | stat_error | link_outside | link_broken | link_dir | special
    rel: str
    path: str = ""
    st: os.stat_result | None = None
    detail: str = ""


def walk_folder(real_root: str) -> Iterator[WalkEntry]:
    """Every entry under `real_root` (resolved), files of a folder before its subfolders,
    names sorted, without following anything out of it: a symlink is classified by where
    it leads (outside, broken, a folder inside, or a file inside, which is yielded as that
    file), and subfolders are entered only after the caller has seen their `dir` entry (a
    caller that stops iterating stops the walk). The one walk of a user's folder:
    `sandflow run -i` (`_plan`) and the corpus of a data build (datasets_prep.corpus)."""
    stack: list[tuple[str, str]] = [("", real_root)]
    while stack:
        rel_dir, dir_path = stack.pop()
        try:
            with os.scandir(dir_path) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            yield WalkEntry("unlistable", rel_dir or ".", detail=e.strerror or "")
            continue
        subdirs: list[tuple[str, str]] = []
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            bad = name_problem(entry.name)
            if bad:
                yield WalkEntry("bad_name", rel, detail=bad)
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError as e:
                yield WalkEntry("stat_error", rel, detail=e.strerror or "")
                continue
            path = entry.path
            if stat.S_ISLNK(st.st_mode):
                target = os.path.realpath(entry.path)
                if not inside(target, real_root):
                    yield WalkEntry("link_outside", rel, detail=target)
                    continue
                try:
                    st = os.stat(target)
                except OSError as e:
                    yield WalkEntry("link_broken", rel, detail=e.strerror or "")
                    continue
                if stat.S_ISDIR(st.st_mode):
                    yield WalkEntry("link_dir", rel, target, st, os.path.relpath(target, real_root))
                    continue
                path = target
            if stat.S_ISDIR(st.st_mode):
                yield WalkEntry("dir", rel, path, st)
                subdirs.append((rel, path))
            elif not stat.S_ISREG(st.st_mode):
                yield WalkEntry("special", rel, path, st, _kind(st.st_mode))
            else:
                yield WalkEntry("file", rel, path, st)
        stack.extend(reversed(subdirs))


def _plan(root: str, real_root: str) -> tuple[list[_Planned], list[tuple[str, str]], list[str]]:
    """Walk the folder without following anything: what to read, what to skip, what is wrong."""
    lim = L.LIMITS
    planned: list[_Planned] = []
    skipped: list[tuple[str, str]] = []
    problems: list[str] = []
    total = folders = 0
    for e in walk_folder(real_root):
        if e.kind == "unlistable":
            problems.append(f"{show(e.rel)}: cannot list the folder ({e.detail})")
        elif e.kind == "bad_name":
            problems.append(f"{show(e.rel)}: the file name {e.detail}; rename it")
        elif e.kind == "stat_error":
            problems.append(f"{show(e.rel)}: {e.detail}")
        elif e.kind == "link_outside":
            problems.append(
                f"{show(e.rel)} is a symlink to {e.detail!r}, outside the folder "
                "(copy the file into the folder instead)"
            )
        elif e.kind == "link_broken":
            problems.append(f"{show(e.rel)} is a symlink that cannot be followed ({e.detail})")
        elif e.kind == "link_dir":
            skipped.append((e.rel, f"a symlink to the folder {e.detail!r} "
                                   "inside the input folder: its files are copied under their own path"))
        elif e.kind == "dir":
            folders += 1
            if folders > lim.max_files_per_task:
                problems.append(f"more than {lim.max_files_per_task} folders ({L.env_name('max_files_per_task')})")
                return planned, skipped, problems
        elif e.kind == "special":
            problems.append(f"{show(e.rel)} is {e.detail}; only regular files can be copied")
        else:
            assert e.st is not None
            if e.st.st_size > lim.max_file_bytes:
                problems.append(L.over_limit(show(e.rel), e.st.st_size, "max_file_bytes", "per file"))
                continue
            total += e.st.st_size
            planned.append(_Planned(e.rel, e.path, e.st))
            if len(planned) > lim.max_files_per_task:
                problems.append(
                    f"more than {lim.max_files_per_task} files ({L.env_name('max_files_per_task')})"
                )
                return planned, skipped, problems
            if total > lim.max_task_bytes:
                problems.append(L.over_limit("the folder's files", total, "max_task_bytes", "per task"))
                return planned, skipped, problems
    return planned, skipped, problems


def read_input_folder(root: str | Path) -> InputFolder:
    """Every file of a user's folder as name -> text (UTF-8) or bytes, under the rules of
    the module doc. All problems are collected and raised together (InputFolderError),
    before any file is read, so the user fixes the folder in one go."""
    root = str(root)
    try:
        real_root = folder_to_walk(root, "input folder")
    except UnsafePathError as e:
        raise InputFolderError(str(e)) from None
    planned, skipped, problems = _plan(root, real_root)
    if problems:
        raise _folder_error(root, problems)
    out = InputFolder(skipped=skipped)
    for p in sorted(planned, key=lambda p: p.name):
        try:
            fd = open_regular(p.path, root=real_root, expect=p.st)
            try:
                data = read_fd(fd, L.LIMITS.max_file_bytes, show(p.name), "max_file_bytes", "per file")
            finally:
                os.close(fd)
        except UnsafePathError as e:
            raise _folder_error(root, [f"{show(p.name)}: {e}"]) from None
        out.total_bytes += len(data)
        if out.total_bytes > L.LIMITS.max_task_bytes:
            raise _folder_error(
                root, [L.over_limit("the folder's files", out.total_bytes, "max_task_bytes", "per task")]
            )
        try:
            out.files[p.name] = data.decode("utf-8")
        except UnicodeDecodeError:
            out.files[p.name] = data
    return out


def _folder_error(root: str, problems: list[str]) -> InputFolderError:
    shown = problems[:MAX_SHOWN_PROBLEMS]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    return InputFolderError(
        f"input folder {root!r}: nothing was started, because\n  " + "\n  ".join(shown) + more
    )
