"""The image build's Debian mirror comes from the machine's apt configuration or
SANDFLOW_DEBIAN_MIRROR, never from a built-in host name. Sample files only: no mirror
is contacted here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from sandbox.apt_sources import (
    MirrorNotFoundError,
    debian_mirror,
    parse_deb822,
    parse_one_line,
    read_sources,
)
from sandbox.image import ImageBuildError
from sandbox.image import debian_mirror as image_mirror

REPO = Path(__file__).resolve().parents[2]

DEB822 = """\
# a comment before the first stanza
Types: deb deb-src
# a comment inside the stanza
URIs: http://main.example.test/debian
Suites: bookworm bookworm-updates
Components: main contrib
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://security.example.test/debian-security
Suites: bookworm-security
Components: main
"""


def apt_tree(tmp_path: Path, files: dict[str, str]) -> Path:
    apt = tmp_path / "apt"
    (apt / "sources.list.d").mkdir(parents=True)
    for name, text in files.items():
        (apt / name).write_text(text)
    return apt


def test_deb822_sources_file(tmp_path: Path) -> None:
    apt = apt_tree(tmp_path, {"sources.list.d/debian.sources": DEB822})
    assert debian_mirror("bookworm", None, apt_dir=apt) == "http://main.example.test/debian"


def test_one_line_sources_list_with_options_and_comments(tmp_path: Path) -> None:
    text = (
        "# deb http://commented.example.test/debian bookworm main\n"
        "deb-src http://src.example.test/debian bookworm main\n"
        "deb http://security.example.test/debian-security bookworm-security main\n"
        "deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] http://one.example.test/debian bookworm main # trailing\n"
    )
    apt = apt_tree(tmp_path, {"sources.list": text})
    assert debian_mirror("bookworm", None, apt_dir=apt) == "http://one.example.test/debian"


def test_parsers_keep_every_binary_source() -> None:
    one = parse_one_line(
        "deb\thttp://a.example.test/debian bookworm main\ndeb [trusted=yes] file:/srv/mirror bookworm main\n",
        "x",
    )
    assert [(s.uri, s.suites) for s in one] == [
        ("http://a.example.test/debian", ("bookworm",)),
        ("file:/srv/mirror", ("bookworm",)),
    ]
    stanzas = parse_deb822(DEB822, "y")
    assert [s.uri for s in stanzas] == [
        "http://main.example.test/debian",
        "http://security.example.test/debian-security",
    ]
    assert stanzas[0].suites == ("bookworm", "bookworm-updates")
    assert stanzas[1].is_security and not stanzas[0].is_security


def test_deb822_folded_fields_disabled_stanzas_and_several_uris() -> None:
    text = (
        "Types: deb\nURIs: http://off.example.test/debian\nSuites: bookworm\nEnabled: no\n\n"
        "Types: deb\nURIs: http://first.example.test/debian\n http://second.example.test/debian\n"
        "Suites: bookworm\nComponents: main\n"
    )
    assert [s.uri for s in parse_deb822(text, "z")] == [
        "http://first.example.test/debian",
        "http://second.example.test/debian",
    ]


def test_only_security_or_other_distributions_is_not_a_mirror(tmp_path: Path) -> None:
    apt = apt_tree(
        tmp_path,
        {
            "sources.list": "deb http://security.example.test/debian-security bookworm-security main\n",
            "sources.list.d/other.list": "deb http://archive.example.test/ubuntu jammy main\n",
        },
    )
    with pytest.raises(MirrorNotFoundError) as e:
        debian_mirror("bookworm", None, apt_dir=apt)
    msg = str(e.value)
    assert (
        "SANDFLOW_DEBIAN_MIRROR" in msg and str(apt / "sources.list") in msg and "*.sources" in msg
    )


def test_updates_suite_or_debian_path_is_a_fallback(tmp_path: Path) -> None:
    apt = apt_tree(
        tmp_path, {"sources.list": "deb http://u.example.test/debian bookworm-updates main\n"}
    )
    assert debian_mirror("bookworm", None, apt_dir=apt) == "http://u.example.test/debian"
    apt2 = apt_tree(
        tmp_path / "b", {"sources.list": "deb http://t.example.test/debian trixie main\n"}
    )
    assert debian_mirror("bookworm", None, apt_dir=apt2) == "http://t.example.test/debian"


def test_files_apt_ignores_are_ignored(tmp_path: Path) -> None:
    apt = apt_tree(
        tmp_path,
        {
            "sources.list.d/old.list.disabled": "deb http://stale.example.test/debian bookworm main\n",
            "sources.list.d/old.sources.bak": DEB822,
        },
    )
    assert read_sources(apt) == []
    with pytest.raises(MirrorNotFoundError):
        debian_mirror("bookworm", None, apt_dir=apt)


def test_env_var_wins_and_is_checked(tmp_path: Path) -> None:
    apt = apt_tree(tmp_path, {"sources.list.d/debian.sources": DEB822})
    given = "http://mine.example.test/debian"  # the debian_mirror setting, handed in
    assert debian_mirror("bookworm", given, apt_dir=apt) == "http://mine.example.test/debian"
    with pytest.raises(MirrorNotFoundError, match="not a mirror URL"):
        debian_mirror("bookworm", "deb.example.test", apt_dir=apt)


def test_no_configuration_at_all(tmp_path: Path) -> None:
    with pytest.raises(MirrorNotFoundError, match="is not set, and none of"):
        debian_mirror("bookworm", None, apt_dir=tmp_path / "missing")


def test_image_build_reports_it_as_an_image_build_error(host_settings: Any) -> None:
    host_settings(debian_mirror="gopher://x")
    with pytest.raises(ImageBuildError, match="SANDFLOW_DEBIAN_MIRROR"):
        image_mirror()


def test_no_built_in_host_name_in_the_image_module() -> None:
    source = (REPO / "sandbox" / "image.py").read_text() + (
        REPO / "sandbox" / "apt_sources.py"
    ).read_text()
    assert "debian.org" not in source


def test_early_rootfs_script_runs_with_the_system_python_alone(tmp_path: Path) -> None:
    """setup.sh runs sandbox/image.py by path before the venv exists: no project dependency
    may be imported on that path (here: the mirror check fails first, with its message)."""
    code = (
        "import runpy, sys; sys.argv = ['image.py']; "
        f"runpy.run_path({str(REPO / 'sandbox' / 'image.py')!r}, run_name='__main__')"
    )
    env = {
        "PATH": "/usr/sbin:/sbin",
        "SANDFLOW_DEBIAN_MIRROR": "gopher://x",
        "SANDFLOW_CACHE_DIR": str(tmp_path),
        "PYTHONNOUSERSITE": "1",
    }
    # -S: no site-packages at all, so pydantic, docker, ... cannot be found; no docker CLI on PATH
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env, timeout=60
    )
    if "needs root" in proc.stderr or "debootstrap is not installed" in proc.stderr:
        pytest.skip("needs root and debootstrap to reach the mirror check")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "SANDFLOW_DEBIAN_MIRROR" in proc.stderr and "Traceback" not in proc.stderr
