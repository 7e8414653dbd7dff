"""Fixtures for the sandbox suite: every test runs against both backends.

`box` is one sandbox per backend shared by the whole session (tests that leave it usable);
`fresh` opens dedicated sandboxes for tests that abuse or destroy theirs, and closes them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from sandbox import Sandbox, SandboxConfig, SandboxLimits, open_sandbox

BACKENDS = ["docker", "bwrap"]


@pytest.fixture(scope="session", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "docker":
        request.getfixturevalue("sandbox_image")
    else:
        request.getfixturevalue("sandbox_rootfs")
    return str(request.param)


def config_maker(backend: str, run_id: str) -> Callable[..., SandboxConfig]:
    """make(episode, **limits): a SandboxConfig of the tests' small limits."""

    def make(episode: str = "ep", **limits: object) -> SandboxConfig:
        base = {"memory_mb": 512, "pids": 128, "cpus": 1.0, "tmp_size_mb": 256}
        base.update(limits)
        return SandboxConfig(
            backend=backend,  # type: ignore[arg-type]
            run_id=run_id,
            episode_id=episode,
            limits=SandboxLimits(**base),  # type: ignore[arg-type]
        )

    return make


@pytest.fixture(scope="session")
def make_config(backend: str, test_run_id: str) -> Callable[..., SandboxConfig]:
    return config_maker(backend, test_run_id)


@pytest.fixture(scope="session")
def box(make_config: Callable[..., SandboxConfig]) -> Iterator[Sandbox]:
    sb = open_sandbox(make_config("shared"))
    yield sb
    sb.close()


@pytest.fixture
def fresh(make_config: Callable[..., SandboxConfig]) -> Iterator[Callable[..., Sandbox]]:
    opened: list[Sandbox] = []

    def open_(episode: str = "fresh", **limits: object) -> Sandbox:
        sb = open_sandbox(make_config(episode, **limits))
        opened.append(sb)
        return sb

    yield open_
    for sb in opened:
        sb.close()
