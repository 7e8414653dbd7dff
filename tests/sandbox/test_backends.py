"""Backends are found by name and say what they can do (sandbox/backends.py).

A new backend is one module and one `register_backend` call; callers ask capabilities,
never the name (tests/test_architecture.py fails on `backend == "docker"` outside sandbox/).
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sandbox import SandboxConfig, open_sandbox
from sandbox.backends import backend_names, capabilities, get_backend, register_backend


def test_the_two_builtin_backends_are_registered_with_their_capabilities() -> None:
    assert {"docker", "bwrap"} <= set(backend_names())
    docker, bwrap = capabilities("docker"), capabilities("bwrap")
    assert docker.image and docker.engine and docker.parallel_open and docker.fork
    # bwrap's --die-with-parent follows the starting thread: never opened from workers
    assert not bwrap.parallel_open and not bwrap.image and bwrap.fork and bwrap.snapshot_volumes
    assert "allowlist" in docker.network_policies and "none" in bwrap.network_policies


def test_an_unknown_backend_is_one_sentence_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown sandbox backend 'firecracker': use 'bwrap' or 'docker'"):
        get_backend("firecracker")
    with pytest.raises(ValidationError, match="unknown sandbox backend 'firecracker'"):
        SandboxConfig(backend="firecracker")


def test_a_registered_backend_is_opened_through_the_registry(tmp_path) -> None:
    """A third backend made of one registration: SandboxConfig accepts its name and
    open_sandbox builds it from its target, with the capabilities it declared."""
    from sandbox.backends import _BACKENDS, Capabilities

    module = tmp_path / "toy_backend.py"
    module.write_text(
        "class ToySandbox:\n"
        "    backend = 'toy'\n"
        "    def __init__(self, config):\n"
        "        self.config = config\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        register_backend("toy", "toy_backend:ToySandbox", Capabilities(fork=False))
        box = open_sandbox(SandboxConfig(backend="toy", run_id="r"))
        assert type(box).__name__ == "ToySandbox" and box.config.run_id == "r"
        assert capabilities("toy") == Capabilities(fork=False)
    finally:
        _BACKENDS.pop("toy", None)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_backend", None)


@pytest.mark.parametrize("bad", ["", "a b", "x;y"])
def test_a_backend_name_is_a_plain_word(bad: str) -> None:
    with pytest.raises(ValueError, match="a backend name is"):
        register_backend(bad, "m:C", capabilities("docker"))


def test_a_live_sandbox_answers_its_capabilities(box) -> None:
    assert box.capabilities == capabilities(box.backend)
    assert box.capabilities.usage and box.resource_usage().cpu_s is not None
