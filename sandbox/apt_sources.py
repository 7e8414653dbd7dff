"""Which Debian mirror this machine's apt already uses: the image build debootstraps from it.

A machine that installs Debian packages at all has a mirror it can reach in its apt
configuration; a built-in host name would be one it may not reach (an offline
network, a proxy-only site, a pinned snapshot). Both formats apt reads are parsed:
the one-line ``deb [options] URI SUITE COMPONENT...`` of ``sources.list`` and
``sources.list.d/*.list``, and the deb822 stanzas of ``sources.list.d/*.sources``.
Files apt itself ignores (other suffixes, such as ``*.disabled``) are ignored here too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "SANDFLOW_DEBIAN_MIRROR"
SCHEMES = ("http://", "https://", "file:/")


class MirrorNotFoundError(RuntimeError):
    """Neither SANDFLOW_DEBIAN_MIRROR nor the apt configuration names a Debian mirror."""


@dataclass(frozen=True)
class AptSource:
    """One binary (``deb``) source: a URI and the suites it serves."""

    uri: str
    suites: tuple[str, ...]
    origin: str  # file (and line) it came from, for messages

    @property
    def is_security(self) -> bool:
        """Security archives hold only updates: debootstrap cannot start from one."""
        return any(s.endswith("-security") or "/" in s for s in self.suites) or self.uri.rstrip(
            "/"
        ).endswith("-security")


def parse_one_line(text: str, origin: str) -> list[AptSource]:
    """``deb [arch=amd64 signed-by=...] URI SUITE [COMPONENT...]`` lines (``deb-src`` skipped)."""
    out: list[AptSource] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line.startswith("deb ") and not line.startswith("deb\t"):
            continue
        rest = line[3:].strip()
        if rest.startswith("["):  # options block: may hold spaces inside the brackets
            end = rest.find("]")
            if end < 0:
                continue
            rest = rest[end + 1 :].strip()
        parts = rest.split()
        if len(parts) < 2:
            continue
        out.append(AptSource(uri=parts[0], suites=(parts[1],), origin=f"{origin}:{n}"))
    return out


def parse_deb822(text: str, origin: str) -> list[AptSource]:
    """deb822 stanzas (``Types: deb``, ``URIs:``, ``Suites:``; ``Enabled: no`` skipped)."""
    out: list[AptSource] = []
    stanzas: list[dict[str, str]] = []
    fields: dict[str, str] = {}
    last: str | None = None
    for raw in [*text.splitlines(), ""]:
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if fields:
                stanzas.append(fields)
            fields, last = {}, None
            continue
        if raw[0] in " \t" and last is not None:  # folded continuation of the previous field
            fields[last] += " " + raw.strip()
            continue
        key, sep, value = raw.partition(":")
        if not sep:
            continue
        last = key.strip().lower()
        fields[last] = value.strip()
    for i, st in enumerate(stanzas, 1):
        if "deb" not in st.get("types", "").split():
            continue
        if st.get("enabled", "yes").strip().lower() in ("no", "false", "0"):
            continue
        suites = tuple(st.get("suites", "").split())
        for uri in st.get("uris", "").split():
            if suites:
                out.append(AptSource(uri=uri, suites=suites, origin=f"{origin} (stanza {i})"))
    return out


def read_sources(apt_dir: Path = Path("/etc/apt")) -> list[AptSource]:
    """Every binary source apt reads under `apt_dir`, in apt's own order."""
    files: list[tuple[Path, bool]] = [(apt_dir / "sources.list", False)]
    parts = apt_dir / "sources.list.d"
    if parts.is_dir():
        for p in sorted(parts.iterdir()):
            if p.suffix == ".list":
                files.append((p, False))
            elif p.suffix == ".sources":
                files.append((p, True))
    out: list[AptSource] = []
    for path, deb822 in files:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        out += parse_deb822(text, str(path)) if deb822 else parse_one_line(text, str(path))
    return out


def pick_mirror(sources: Iterable[AptSource], suite: str) -> str | None:
    """The URI of a Debian archive that debootstrap can build `suite` from.

    First choice: a source listing `suite` itself; next, one listing `suite-updates` or
    `suite-backports` (same archive); last, any non-security source whose path ends in
    ``/debian`` (Debian's archive layout, which serves every suite). None if nothing fits.
    """
    usable = [s for s in sources if s.uri.startswith(SCHEMES) and not s.is_security]
    for s in usable:
        if suite in s.suites:
            return s.uri
    for s in usable:
        if any(x in (f"{suite}-updates", f"{suite}-backports") for x in s.suites):
            return s.uri
    for s in usable:
        if s.uri.rstrip("/").endswith("/debian"):
            return s.uri
    return None


def debian_mirror(
    suite: str,
    mirror: str | None = None,
    apt_dir: Path = Path("/etc/apt"),
) -> str:
    """`mirror` (the debian_mirror setting, SANDFLOW_DEBIAN_MIRROR, handed in) if given, else
    the mirror apt uses for `suite`; a clear error if neither."""
    given = (mirror or "").strip()
    if given:
        if not given.startswith(SCHEMES):
            raise MirrorNotFoundError(
                f"{ENV_VAR}={given!r} is not a mirror URL: give http://HOST/debian, "
                "https://HOST/debian or file:/PATH (a Debian archive that holds "
                f"dists/{suite})."
            )
        return given
    found = pick_mirror(read_sources(apt_dir), suite)
    if found:
        return found
    raise MirrorNotFoundError(
        f"No Debian mirror to build the sandbox image from: {ENV_VAR} is not set, and none of "
        f"{apt_dir}/sources.list, {apt_dir}/sources.list.d/*.list or *.sources names a "
        f"Debian archive for {suite!r} (an http(s):// or file: URI whose suites include "
        f"{suite}, or whose path ends in /debian). Set {ENV_VAR}=http://HOST/debian to a "
        "mirror this machine can reach."
    )
