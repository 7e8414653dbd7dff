"""The egress proxy's shared download cache (docker backend): sandboxes of one policy that
install the same wheel get it from the cache after the first, intact (pip's hash check),
and no sandbox can empty, poison or read another's private replies through it.

Every "outside" is a listener this test starts on 127.0.0.1: a pypiserver whose request
log counts what reached the upstream, and a small HTTP server that sets cookies.
"""

from __future__ import annotations

import hashlib
import http.client
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from sandbox import SandboxConfig, SandboxLimits, egress, open_sandbox
from sandbox.docker_backend import DockerSandbox
from tests.sandbox.test_egress import WHEEL, _free_port, build_wheel

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(egress.unavailable() is not None, reason=str(egress.unavailable())),
]


@dataclass
class CountedIndex:
    port: int
    log: Path
    wheel: Path

    def fetches(self, path_end: str) -> int:
        """GETs of a path ending so that reached the index (its own request log)."""
        msgs = [x.rsplit("|", 1)[-1] for x in self.log.read_text(errors="replace").splitlines()]
        return sum(1 for m in msgs if m.startswith("GET ") and m.split()[1].endswith(path_end))


class CookieServer(BaseHTTPRequestHandler):
    """Replies that must not be shared: one sets a cookie, one answers a request with
    credentials. Counts what reached it."""

    hits: dict[str, int] = {}

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        CookieServer.hits[self.path] = CookieServer.hits.get(self.path, 0) + 1
        body = f"private reply {CookieServer.hits[self.path]} for {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "max-age=3600")  # cacheable, were it not private
        if self.path.startswith("/login"):
            self.send_header("Set-Cookie", f"session=secret{CookieServer.hits[self.path]}")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CountedIndex]:
    folder = tmp_path_factory.mktemp("cached-index")
    wheel = build_wheel(folder, payload_bytes=1 << 20)
    log = folder.parent / "index-requests.log"
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pypiserver", "run", "-i", "127.0.0.1", "-p", str(port)]
        + ["-v", "--log-file", str(log), "--log-req-frmt", "%(REQUEST_METHOD)s %(PATH_INFO)s"]
        + [str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                with closing(http.client.HTTPConnection("127.0.0.1", port, timeout=0.5)) as c:
                    c.request("GET", "/simple/")
                    if c.getresponse().status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        yield CountedIndex(port, log, wheel)
    finally:  # also when it never answered: the server must not outlive the test
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cookie_port() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), CookieServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield int(server.server_address[1])
    server.shutdown()


def _policy(index: CountedIndex, cookie_port: int, *extra: str) -> Iterator[SandboxLimits]:
    """A policy of its own (its own squid, its own empty cache), removed afterwards."""
    lim = SandboxLimits(
        memory_mb=512,
        pids=128,
        tmp_size_mb=256,
        network="allowlist",
        egress_allow=(
            f"pypi.test:{index.port}",
            f"private.test:{cookie_port}",
            f"127.0.0.1:{index.port},{cookie_port}",  # the listeners' address, listed by itself
            *extra,
        ),
        egress_hosts=("pypi.test=127.0.0.1", "private.test=127.0.0.1"),
    )
    from sandbox.engine import docker_client

    api = docker_client().api
    ep = egress.endpoint_for(api, lim)
    yield lim
    egress.teardown(api, ep)
    shutil.rmtree(ep.state_dir / "cache", ignore_errors=True)  # the test's cached wheel


@pytest.fixture(scope="module")
def limits(index: CountedIndex, cookie_port: int) -> Iterator[SandboxLimits]:
    yield from _policy(index, cookie_port)


@pytest.fixture
def cold_limits(index: CountedIndex, cookie_port: int) -> Iterator[SandboxLimits]:
    yield from _policy(index, cookie_port, f"cold-{time.time_ns()}.test")


def _open(limits: SandboxLimits, run_id: str, episode: str) -> DockerSandbox:
    sb = open_sandbox(SandboxConfig(run_id=run_id, episode_id=episode, limits=limits))
    assert isinstance(sb, DockerSandbox)
    return sb


def _pip(port: int) -> str:
    return (
        "pip install -q --no-cache-dir --trusted-host pypi.test "
        f"--index-url http://pypi.test:{port}/simple/ sfegress-probe"
        " && python -c 'import sfegress_probe; print(sfegress_probe.VALUE)'"
    )


@pytest.mark.slow
def test_twenty_sandboxes_install_one_wheel_fetched_once(
    cold_limits: SandboxLimits, index: CountedIndex, test_run_id: str
) -> None:
    """20 sandboxes, 4 at a time, `pip install` the same wheel through a proxy with an
    empty cache: every install passes pip's hash check, the index sees the wheel fetched
    once, the records show 19 cache hits."""
    since = time.time()
    before = index.fetches(WHEEL)

    def install(i: int) -> tuple[str, list[egress.EgressRecord]]:
        with _open(cold_limits, test_run_id, f"cache-{i}") as sb:
            res = sb.exec(_pip(index.port), timeout=180)
            out = res.stdout + res.stderr if res.exit_code else res.stdout
            time.sleep(0.2)
            return out, sb.egress_records(since)

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(install, range(20)))
    for out, _ in results:
        assert "installed through the egress proxy" in out, out
    assert index.fetches(WHEEL) - before == 1  # the upstream saw the wheel once
    wheel = [r for _, recs in results for r in recs if r.url.endswith(WHEEL)]
    assert len(wheel) == 20 and all(r.status == 200 and r.allowed for r in wheel), wheel
    # 19 answered without a connection to the index (squid logs no server for them): hits,
    # and requests that joined the one fetch in flight. squid tags most of those _CF_, but
    # some it logs as a plain TCP_MISS with no server (seen in CI: TCP_MISS/-), so the
    # server field, not the result code, is what tells.
    served = [r for r in wheel if r.server == "-"]
    assert len(served) == 19, " ".join(sorted(f"{r.result}/{r.server}" for r in wheel))
    size = index.wheel.stat().st_size
    assert all(r.bytes_in >= size for r in wheel)  # every sandbox got the whole file


def test_a_forced_revalidation_cannot_empty_the_cached_wheel(
    limits: SandboxLimits, index: CountedIndex, test_run_id: str
) -> None:
    """The root cause of the empty wheels once served from the cache: the index answers a
    conditional request with `304` and `Content-Length: 0`, which squid 5.7 wrote into the
    stored reply. A sandbox can force that revalidation; it must not empty the file for
    the next one (the proxy never sends conditional requests upstream)."""
    path = f"/packages/{WHEEL}"
    with closing(http.client.HTTPConnection("127.0.0.1", index.port, timeout=5)) as c:
        c.request("GET", path, headers={"If-Modified-Since": formatdate(usegmt=True)})
        r = c.getresponse()
        r.read()
        assert (r.status, r.getheader("Content-Length")) == (304, "0")  # what squid mishandles
    url = f"http://pypi.test:{index.port}{path}"
    digest = hashlib.sha256(index.wheel.read_bytes()).hexdigest()
    fetch = f"curl -sf -o /tmp/w.whl {{h}} {url} && sha256sum /tmp/w.whl | cut -c1-64"
    with _open(limits, test_run_id, "warm") as sb:
        assert sb.exec(fetch.format(h="")).stdout.strip() == digest
    with _open(limits, test_run_id, "attacker") as sb:
        for header in ("Cache-Control: max-age=0", "Cache-Control: no-cache", "Pragma: no-cache"):
            got = sb.exec(fetch.format(h=f"-H '{header}'"))
            assert got.stdout.strip() == digest, (header, got)
        got = sb.exec(fetch.format(h=f"-H 'If-Modified-Since: {formatdate(usegmt=True)}'"))
        assert got.exit_code == 0  # a 304 for this client alone, or the whole file
    with _open(limits, test_run_id, "victim") as sb:
        since = time.time()
        assert sb.exec(fetch.format(h="")).stdout.strip() == digest
        r = sb.exec(_pip(index.port), timeout=120)
        assert "installed through the egress proxy" in r.stdout, r.stdout + r.stderr
        time.sleep(0.2)
        served = [x for x in sb.egress_records(since) if x.url.endswith(WHEEL)]
    assert [("HIT" in x.result, x.bytes_in >= index.wheel.stat().st_size) for x in served] == [
        (True, True),
        (True, True),
    ]


def test_private_replies_are_not_shared(
    limits: SandboxLimits, cookie_port: int, test_run_id: str
) -> None:
    """A reply that sets a cookie, and any reply to a request with credentials or a cookie,
    is never served to another sandbox from the cache."""
    base = f"http://private.test:{cookie_port}"
    before = dict(CookieServer.hits)
    seen = []
    for i in range(2):
        with _open(limits, test_run_id, f"private-{i}") as sb:
            r = sb.exec(
                f"curl -sf -D - {base}/login; curl -sf -H 'Authorization: Bearer t{i}' {base}/me;"
                f" curl -sf -H 'Cookie: session=s{i}' {base}/page"
            )
            assert r.exit_code == 0, r
            seen.append(r.stdout)
    assert "session=secret2" in seen[1] and "session=secret1" not in seen[1]
    for path in ("/login", "/me", "/page"):
        assert CookieServer.hits.get(path, 0) - before.get(path, 0) == 2, (path, seen)


def test_the_view_marks_cache_hits(
    limits: SandboxLimits,
    index: CountedIndex,
    test_run_id: str,
    tmp_path: Path,
    scripted_model: object,
) -> None:
    """The `egress` view's cache_hit column comes from the proxy's own record of each reply."""
    from datasets_prep.task import Task
    from tasks.loop import run_episode
    from tests.scripted_model import ScriptedModel, tool_reply
    from tests.tasks.conftest import fast_model
    from warehouse.query import WarehouseQuery
    from warehouse.writer import EpisodeWriter

    assert isinstance(scripted_model, ScriptedModel)
    url = f"http://pypi.test:{index.port}/packages/{WHEEL}"
    scripted_model.push(
        tool_reply("execute_bash", {"command": f"curl -sf -o /tmp/a.whl {url}"}),
        tool_reply("execute_bash", {"command": f"curl -sf -o /tmp/b.whl {url}"}),
        tool_reply("submit", {}),
    )
    task = Task(id="t", domain="chem", problem_statement="get it", ground_truth="x")
    with _open(limits, test_run_id, "warm-view") as sb:  # in the cache before the episode
        assert sb.exec(f"curl -sf -o /dev/null {url}").exit_code == 0
    with _open(limits, test_run_id, "view") as sb, EpisodeWriter(tmp_path) as writer:
        result = run_episode(
            task, fast_model(scripted_model), recorder=writer, sandbox=sb, run_id="cache-run"
        )
    assert result.record.termination == "submitted"
    with WarehouseQuery(tmp_path) as q:
        rows = q.rows("SELECT turn_index, result, cache_hit FROM egress ORDER BY time")
    assert [(r[0], r[2]) for r in rows] == [(0, True), (1, True)], rows
    assert all("HIT" in r[1] for r in rows)
