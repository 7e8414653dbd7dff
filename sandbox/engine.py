"""The Docker engine connection: local socket, DOCKER_HOST, or a per-sandbox docker_host.

Clients are cached per engine address (one connection pool, sized for many concurrent
sandboxes). A missing engine or image fails with a message that says what to do, not
a urllib3 traceback.
"""

from __future__ import annotations

import os
import threading
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from sandbox.base import SandboxError

_LOCK = threading.Lock()
_CLIENTS: dict[str, Any] = {}
_IMAGES: set[tuple[str, str]] = set()
API_TIMEOUT_S = 120
POOL_SIZE = 64


def engine_address(docker_host: str | None = None) -> str:
    return docker_host or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def shown_address(address: str) -> str:
    """An engine address as records, logs and errors show it: a password in it (a URL's
    user:password@) is never written anywhere."""
    try:
        parts = urlsplit(address)
        if parts.password is None:
            return address
        host = parts.hostname or ""
        user = f"{parts.username}@" if parts.username else ""
        port = f":{parts.port}" if parts.port else ""
    except ValueError:  # not a URL docker could use either: shown without what may be secret
        return address.split("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{user}{host}{port}"))


def engine_of(backend: str, docker_host: str | None = None, runtime: str | None = None) -> str:
    """Which engine a sandbox of this configuration runs on, as an episode records it
    (`episodes.sandbox_engine`): with several engines (Dask workers each bound to one,
    remote hosts), failures and speed are grouped by it. Known before the sandbox opens,
    so an engine that refuses is named too. A password in the address is never kept."""
    from sandbox.backends import capabilities

    if not capabilities(backend).engine:
        return backend
    label = f"docker {shown_address(engine_address(docker_host))}"
    return f"{label} runtime={runtime}" if runtime else label


def docker_client(docker_host: str | None = None) -> Any:
    """A cached, pinged `docker.DockerClient` for the engine at `docker_host` (or DOCKER_HOST)."""
    import docker
    import docker.errors

    key = engine_address(docker_host)
    with _LOCK:
        client = _CLIENTS.get(key)
        if client is not None:
            return client
        try:
            if docker_host:
                client = docker.DockerClient(
                    base_url=docker_host,
                    timeout=API_TIMEOUT_S,
                    max_pool_size=POOL_SIZE,
                    use_ssh_client=docker_host.startswith("ssh://"),
                )
            else:
                client = docker.from_env(timeout=API_TIMEOUT_S, max_pool_size=POOL_SIZE)
            client.ping()
        except Exception as e:  # noqa: BLE001 - docker raises many kinds; one clear message
            shown = shown_address(key)
            raise SandboxError(
                f"No Docker engine answers at {shown} "
                f"({type(e).__name__}: {str(e).replace(key, shown)[:200]}). "
                "Start one with `sudo bash scripts/setup.sh`, point DOCKER_HOST (or "
                "SandboxConfig.docker_host) at a running engine, or use the bubblewrap "
                "backend (--backend bwrap)."
            ) from None
        _CLIENTS[key] = client
        return client


def ensure_image(client: Any, tag: str) -> None:
    """Fail early and clearly when the sandbox image is not on this engine."""
    import docker.errors

    key = (str(client.api.base_url), tag)
    if key in _IMAGES:
        return
    try:
        client.api.inspect_image(tag)
    except docker.errors.ImageNotFound:
        raise SandboxError(
            f"The sandbox image {tag} is not on the engine at {client.api.base_url}. "
            "Build it with `sandflow image build` (offline, from Debian packages)."
        ) from None
    _IMAGES.add(key)


def ping(docker_host: str | None = None, timeout_s: float = 5.0) -> str | None:
    """None when the engine at `docker_host` (or DOCKER_HOST) answers within `timeout_s`,
    else why not, in one line. A fresh connection each time: a health check must not
    reuse a pool that still looks alive."""
    import docker

    key = engine_address(docker_host)
    try:
        client = docker.DockerClient(base_url=key, timeout=timeout_s, use_ssh_client=key.startswith("ssh://"))
        try:
            client.ping()
        finally:
            client.close()
    except Exception as e:  # noqa: BLE001 - any failure is "does not answer"
        shown = shown_address(key)
        return f"no Docker engine answers at {shown} ({type(e).__name__}: {str(e).replace(key, shown)[:200]})"
    return None
