"""The one shared sandbox image, built two ways from one content list.

The paper's design keeps storage constant: every task runs in the same image. The
tag carries a hash of the content list, so changing the list builds a new image and
an unchanged list reuses the one already there. Two build paths give the same
content: a Dockerfile (when a registry is reachable) and a fully offline path
(debootstrap a Debian root filesystem from Debian's own package mirror, then
`docker import`). The root filesystem of the offline path is kept on disk because
the bubblewrap backend runs directly on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_REPO = "sandflow/sandbox"
SUITE = "bookworm"
SANDBOX_USER = "sandbox"
# The sandbox user's uid (and gid): no account of any host. At 1000 it was the first real
# user of most machines (here `cloudsdk`), and a uid shares per-uid kernel state with every
# process of it, sandbox or not: the keyring, RLIMIT_NPROC, inotify instances, mqueue bytes,
# pipe buffers. 2,100,000,000 lies above the ranges hosts hand out (Debian's users stop at
# 59,999 and its subordinate ids at 600,100,000; sssd's id mapping at 2,000,200,000; systemd
# containers at 1,879,048,191) and below 2**31 (no signedness trouble); tests check it is
# in no /etc/passwd of the host that runs them.
SANDBOX_UID = 2_100_000_000
WORKDIR = "/testbed"

# What every task can count on. Debian names, so both build paths install the same.
PACKAGES: tuple[str, ...] = (
    "bash",
    "coreutils",
    "util-linux",
    "procps",
    "findutils",
    "grep",
    "sed",
    "gawk",
    "diffutils",
    "patch",
    "less",
    "file",
    "tar",
    "gzip",
    "bzip2",
    "xz-utils",
    "unzip",
    "zip",
    "ca-certificates",
    "curl",
    "wget",
    "git",
    "python3",
    "python3-pip",
    "python3-venv",
    "python3-numpy",
    "python3-sympy",
    "python3-scipy",
    "python3-mpmath",
    "python3-matplotlib",
    "python-is-python3",
)


@dataclass(frozen=True)
class ImageSpec:
    """A content list and the identity derived from it."""

    packages: tuple[str, ...] = PACKAGES
    suite: str = SUITE
    user: str = SANDBOX_USER
    uid: int = SANDBOX_UID
    workdir: str = WORKDIR
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def content_hash(self) -> str:
        blob = json.dumps(
            {
                "packages": sorted(self.packages),
                "suite": self.suite,
                "user": self.user,
                "uid": self.uid,
                "workdir": self.workdir,
                "extra": self.extra,
                "layout": 1,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:12]

    @property
    def tag(self) -> str:
        return f"{IMAGE_REPO}:{self.content_hash}"

    def dockerfile(self) -> str:
        """The registry path: same packages, same user, same layout."""
        pkgs = " \\\n    ".join(sorted(self.packages))
        return (
            f"FROM debian:{self.suite}-slim\n"
            "RUN apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y "
            f"--no-install-recommends \\\n    {pkgs} \\\n"
            " && rm -rf /var/lib/apt/lists/*\n"
            f"RUN groupadd -g {self.uid} {self.user} "
            f"&& useradd -l -m -u {self.uid} -g {self.uid} -s /bin/bash {self.user} "
            f"&& mkdir -p {self.workdir} && chown {self.uid}:{self.uid} {self.workdir}\n"
            f'LABEL sandflow.image="1" sandflow.content_hash="{self.content_hash}"\n'
            f"ENV {_env_line()}\n"
            f"WORKDIR {self.workdir}\n"
            'CMD ["/bin/bash"]\n'
        )


DEFAULT_SPEC = ImageSpec()

_IMAGE_ENV = {
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PIP_BREAK_SYSTEM_PACKAGES": "1",
    "MPLBACKEND": "Agg",
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
}


def _env_line() -> str:
    return " ".join(f'{k}="{v}"' for k, v in _IMAGE_ENV.items())


def image_env() -> dict[str, str]:
    return dict(_IMAGE_ENV)


def cache_dir() -> Path:
    """HostSettings.cache_dir (SANDFLOW_CACHE_DIR), else $XDG_CACHE_HOME/sandflow."""
    from sandbox import settings

    given = settings.current().cache_dir
    if given is not None:
        return given
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "sandflow"


def rootfs_path(spec: ImageSpec = DEFAULT_SPEC) -> Path:
    """Where the offline build keeps its root filesystem (the bubblewrap backend's root)."""
    return cache_dir() / f"rootfs-{spec.content_hash}"


def debian_mirror(suite: str = SUITE) -> str:
    """HostSettings.debian_mirror (SANDFLOW_DEBIAN_MIRROR), else the Debian mirror this
    machine's apt uses (never a built-in host name: it may be one this machine cannot reach)."""
    from sandbox import settings
    from sandbox.apt_sources import MirrorNotFoundError
    from sandbox.apt_sources import debian_mirror as from_apt

    try:
        return from_apt(suite, settings.current().debian_mirror)
    except MirrorNotFoundError as e:
        raise ImageBuildError(str(e)) from None


class ImageBuildError(RuntimeError):
    pass


def _run(cmd: list[str], **kw: object) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        raise ImageBuildError(
            f"`{' '.join(cmd[:3])} ...` failed with exit code {proc.returncode}:\n"
            + "\n".join(tail)
        )


def _install_rootfs(tmp: Path, target: Path, spec: ImageSpec) -> None:
    """A finished root filesystem in `tmp` becomes `target`, the same whichever way it was
    built: a resolv.conf placeholder (it keeps bind-mounting one possible in the bubblewrap
    backend), the completion marker, then the rename (a half-built tree is never `target`)."""
    (tmp / "etc" / "resolv.conf").write_text("")
    (tmp / ".sandflow-complete").write_text(spec.content_hash + "\n")
    if target.exists():
        shutil.rmtree(target)
    tmp.rename(target)


def build_rootfs(spec: ImageSpec = DEFAULT_SPEC, *, force: bool = False, log=print) -> Path:
    """Debootstrap a minbase Debian with the content list; reuse it when already complete."""
    target = rootfs_path(spec)
    marker = target / ".sandflow-complete"
    if marker.exists() and not force:
        return target
    if os.geteuid() != 0:
        raise ImageBuildError(
            "Building the sandbox root filesystem needs root (debootstrap). "
            "Run `sudo sandflow image build`, or build on a machine with a registry via "
            "`sandflow image build --dockerfile`."
        )
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed: `apt-get install -y debootstrap`.")
    mirror = debian_mirror(spec.suite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"rootfs-{spec.content_hash}-", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it 0700: the sandbox user could not traverse `/`
    try:
        log(f"debootstrap {spec.suite} ({len(spec.packages)} packages) from {mirror}")
        _run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(sorted(spec.packages))}",
                spec.suite,
                str(tmp),
                mirror,
            ]
        )
        _run(
            [
                "chroot",
                str(tmp),
                "sh",
                "-c",
                # -l: no lastlog/faillog entry (a sparse file of uid x 292 bytes: 600 GB)
                f"groupadd -g {spec.uid} {spec.user} && "
                f"useradd -l -m -u {spec.uid} -g {spec.uid} -s /bin/bash {spec.user} && "
                f"mkdir -p {spec.workdir} && chown {spec.uid}:{spec.uid} {spec.workdir} && "
                "apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin",
            ]
        )
        _install_rootfs(tmp, target, spec)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def image_exists(client, tag: str) -> bool:
    import docker.errors

    try:
        client.images.get(tag)
        return True
    except docker.errors.ImageNotFound:
        return False


def import_rootfs(client, spec: ImageSpec, rootfs: Path, *, log=print) -> str:
    """`docker import` the root filesystem with the same metadata the Dockerfile sets."""
    changes = [f"ENV {k}={v}" for k, v in _IMAGE_ENV.items()] + [
        f"WORKDIR {spec.workdir}",
        'CMD ["/bin/bash"]',
        f'LABEL sandflow.image="1" sandflow.content_hash="{spec.content_hash}"',
    ]
    cmd = ["docker", "import"]
    for c in changes:
        cmd += ["--change", c]
    cmd += ["-", spec.tag]
    log(f"docker import -> {spec.tag}")
    tar = subprocess.Popen(
        [
            "tar",
            "-C",
            str(rootfs),
            "--numeric-owner",
            "--exclude=./.sandflow-complete",
            "-cf",
            "-",
            ".",
        ],
        stdout=subprocess.PIPE,
    )
    try:
        imp = subprocess.run(cmd, stdin=tar.stdout, capture_output=True, text=True)
    finally:
        if tar.stdout:
            tar.stdout.close()
        tar.wait()
    if imp.returncode != 0 or tar.returncode != 0:
        raise ImageBuildError(f"docker import failed: {imp.stderr.strip()[-2000:]}")
    return spec.tag


def build_image(
    spec: ImageSpec = DEFAULT_SPEC,
    *,
    force: bool = False,
    dockerfile: bool = False,
    extra_tags: tuple[str, ...] = (),
    with_rootfs: bool = True,
    log=print,
) -> str:
    """Build (or reuse) the image for `spec`, and the bubblewrap rootfs; returns its tag."""
    import docker

    client = docker.from_env()
    if not force and image_exists(client, spec.tag):
        log(f"{spec.tag} is already built")
    elif dockerfile:
        with tempfile.TemporaryDirectory() as ctx:
            Path(ctx, "Dockerfile").write_text(spec.dockerfile())
            log(f"docker build -> {spec.tag}")
            client.images.build(path=ctx, tag=spec.tag, rm=True, pull=True)
    else:
        rootfs = build_rootfs(spec, force=force, log=log)
        import_rootfs(client, spec, rootfs, log=log)
    image = client.images.get(spec.tag)
    for extra in (f"{IMAGE_REPO}:latest", *extra_tags):
        repo, _, tag = extra.rpartition(":")
        image.tag(repo, tag)
    if with_rootfs and not (rootfs_path(spec) / ".sandflow-complete").exists():
        export_rootfs(spec, log=log)
    return spec.tag


def export_rootfs(spec: ImageSpec = DEFAULT_SPEC, *, log=print) -> Path:
    """The bubblewrap rootfs from the built image (`docker export`): seconds, not a debootstrap.

    Used when the image exists (e.g. built from the Dockerfile) but the rootfs does not.
    """
    target = rootfs_path(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"rootfs-{spec.content_hash}-", dir=target.parent))
    tmp.chmod(0o755)
    created = subprocess.run(
        ["docker", "create", "--label", "sandflow.export=1", spec.tag, "true"],
        capture_output=True,
        text=True,
    )
    if created.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ImageBuildError(f"docker create {spec.tag} failed: {created.stderr.strip()}")
    cid = created.stdout.strip()
    log(f"docker export {spec.tag} -> {target}")
    try:
        exp = subprocess.Popen(["docker", "export", cid], stdout=subprocess.PIPE)
        untar = subprocess.run(
            ["tar", "-x", "--numeric-owner", "-C", str(tmp)],
            stdin=exp.stdout,
            capture_output=True,
            text=True,
        )
        if exp.stdout:
            exp.stdout.close()
        exp.wait()
        if exp.returncode != 0 or untar.returncode != 0:
            raise ImageBuildError(f"exporting {spec.tag} failed: {untar.stderr.strip()[-1000:]}")
        (tmp / "etc" / "resolv.conf").unlink(missing_ok=True)  # the image's may be a link
        _install_rootfs(tmp, target, spec)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        subprocess.run(["docker", "rm", "-f", cid], capture_output=True)
    return target


def image_size_bytes(tag: str = DEFAULT_SPEC.tag) -> int:
    import docker

    return int(docker.from_env().images.get(tag).attrs.get("Size", 0))


def _early_rootfs_main() -> int:
    """`python3 sandbox/image.py`: debootstrap the root filesystem with the system Python.

    scripts/setup.sh starts this in the background before the project's environment
    exists, so the image's slowest step (debootstrap) overlaps the pip install; `sandflow
    image build` then finds the finished rootfs and only imports it. Does nothing when the
    image or the rootfs already exists. Uses the standard library alone.
    """
    import sys

    try:
        inspect = subprocess.run(
            ["docker", "image", "inspect", DEFAULT_SPEC.tag], capture_output=True, timeout=30
        )
        if inspect.returncode == 0:
            print(f"{DEFAULT_SPEC.tag} is already built")
            return 0
    except (OSError, subprocess.TimeoutExpired):
        pass  # no docker CLI or engine yet: the rootfs is wanted either way
    try:
        path = build_rootfs(DEFAULT_SPEC, log=lambda m: print(m, flush=True))
    except ImageBuildError as e:
        print(f"image build failed: {e}", file=sys.stderr)
        return 1
    print(f"rootfs ready: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover - exercised by scripts/setup.sh
    import sys
    import types

    # Run by path with the system Python: make `sandbox.apt_sources` importable without
    # the package's __init__ (which needs the project's dependencies).
    _root = str(Path(__file__).resolve().parent.parent)
    sys.path[0] = _root
    _pkg = types.ModuleType("sandbox")
    _pkg.__path__ = [str(Path(_root) / "sandbox")]
    sys.modules["sandbox"] = _pkg
    # This script is an entry point of its own (scripts/setup.sh, before the application
    # exists): like the application, it reads its settings and hands them to the library.
    from sandbox import settings as _settings

    _settings.configure(
        cache_dir=os.environ.get("SANDFLOW_CACHE_DIR") or None,
        debian_mirror=os.environ.get("SANDFLOW_DEBIAN_MIRROR") or None,
    )
    raise SystemExit(_early_rootfs_main())
