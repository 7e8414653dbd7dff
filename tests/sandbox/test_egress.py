"""Network policy `allowlist` on both backends: the egress proxy lets through what is
listed, refuses everything else, and records every request against its sandbox.

Every "outside" here is a listener this test starts itself: a package index (pypiserver)
and probe listeners on 127.0.0.1, probe listeners on the egress network's gateway address
(docker: the host side of the docker network the test's policy creates), and a second
sandbox. A bwrap sandbox's namespace has only its own loopback: what it tries "directly"
(the host's 127.0.0.1 probes, squid's own port, a peer) lands there and is refused.
Names the proxy resolves come from the policy's own hosts file (egress_hosts), so no test
traffic reaches any other address; "forbidden" addresses (169.254.169.254, 10.99.0.1) are
refused by the proxy before it connects, which is what the test checks.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from sandbox import (
    SandboxConfig,
    SandboxLimits,
    bwrap_egress,
    egress,
    egress_firewall,
    open_sandbox,
)
from sandbox.bwrap_backend import BwrapSandbox
from sandbox.common import SANDBOX_UID
from sandbox.docker_backend import DockerSandbox
from sandbox.netpolicy import EgressPolicy, PolicyError, parse_entry

EgressBox = DockerSandbox | BwrapSandbox


def proxy_unavailable(backend: str) -> str | None:
    """Why the egress proxy cannot run on `backend` here (docker also needs the firewall)."""
    return egress.unavailable() if backend == "docker" else bwrap_egress.unavailable()


pytestmark = pytest.mark.skipif(
    proxy_unavailable("bwrap") is not None, reason=str(proxy_unavailable("bwrap"))
)

WHEEL = "sfegress_probe-1.0-py3-none-any.whl"


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def build_wheel(folder: Path, payload_bytes: int = 0) -> Path:
    """A minimal pure-Python wheel (what `pip wheel` would make for a one-module package)."""
    path = folder / WHEEL
    files = {
        "sfegress_probe/__init__.py": "VALUE = 'installed through the egress proxy'\n",
        "sfegress_probe/blob.bin": "x" * payload_bytes,
        "sfegress_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: sfegress-probe\nVersion: 1.0\n",
        "sfegress_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: sandflow-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "sfegress_probe-1.0.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr("sfegress_probe-1.0.dist-info/RECORD", record)
    return path


def start_index(folder: Path) -> tuple[subprocess.Popen[bytes], int]:
    """pypiserver serving `folder` on 127.0.0.1 (a real package index, local)."""
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pypiserver",
            "run",
            "-i",
            "127.0.0.1",
            "-p",
            str(port),
            str(folder),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    for _ in range(100):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, port
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError("pypiserver did not start")


class Probe:
    """A TCP or UDP listener that counts what reaches it (it must stay at zero)."""

    def __init__(self, host: str, port: int = 0, udp: bool = False) -> None:
        self.hits = 0
        kind = socket.SOCK_DGRAM if udp else socket.SOCK_STREAM
        self.sock = socket.socket(socket.AF_INET, kind)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = int(self.sock.getsockname()[1])
        if not udp:
            self.sock.listen(8)
        self.sock.settimeout(0.2)
        self.udp = udp
        self.stop = False
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        while not self.stop:
            try:
                if self.udp:
                    self.sock.recvfrom(4096)
                else:
                    conn, _ = self.sock.accept()
                    conn.close()
                self.hits += 1
            except OSError:
                continue

    def close(self) -> None:
        self.stop = True
        self.sock.close()


@pytest.fixture(scope="module")
def index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    folder = tmp_path_factory.mktemp("index")
    build_wheel(folder)
    proc, port = start_index(folder)
    yield port
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def limits(index: int) -> SandboxLimits:
    return SandboxLimits(
        memory_mb=512,
        pids=128,
        tmp_size_mb=256,
        network="allowlist",
        egress_allow=(f"pypi.test:{index}", f"127.0.0.1:{index}", "meta.test", "lan.test:80"),
        egress_hosts=("pypi.test=127.0.0.1", "meta.test=169.254.169.254", "lan.test=10.99.0.1"),
    )


def start_proxy(backend: str, limits: SandboxLimits) -> egress.Endpoint:
    why = proxy_unavailable(backend)
    if why:
        pytest.skip(why)
    if backend == "bwrap":
        return bwrap_egress.endpoint_for(limits)
    from sandbox.engine import docker_client

    return egress.endpoint_for(docker_client().api, limits)


def stop_proxy(backend: str, ep: egress.Endpoint) -> None:
    if backend == "bwrap":
        bwrap_egress.teardown(ep)
        return
    from sandbox.engine import docker_client

    egress.teardown(docker_client().api, ep)


@pytest.fixture(scope="module")
def endpoint(limits: SandboxLimits, backend: str) -> Iterator[egress.Endpoint]:
    """The policy's shared proxy on `backend` (the conftest's backend: both, in turn)."""
    ep = start_proxy(backend, limits)
    yield ep
    stop_proxy(backend, ep)


@pytest.fixture
def open_box(
    limits: SandboxLimits, endpoint: egress.Endpoint, test_run_id: str, backend: str
) -> Iterator[Callable[[str], EgressBox]]:
    opened: list[EgressBox] = []

    def open_(episode: str) -> EgressBox:
        cfg = SandboxConfig(
            backend=backend,
            run_id=test_run_id,
            episode_id=episode,
            limits=limits,
        )
        sb = open_sandbox(cfg)
        assert isinstance(sb, DockerSandbox | BwrapSandbox)
        opened.append(sb)
        return sb

    yield open_
    for sb in opened:
        sb.close()


def test_pip_install_goes_through_the_proxy_and_is_recorded(
    open_box: Callable[[str], EgressBox], index: int
) -> None:
    sb = open_box("pip")
    t0 = time.time()
    r = sb.exec(
        f"pip install --no-cache-dir --trusted-host pypi.test"
        f" --index-url http://pypi.test:{index}/simple/ sfegress-probe"
        " && python -c 'import sfegress_probe; print(sfegress_probe.VALUE)'",
        timeout=120,
    )
    assert r.exit_code == 0, r.stdout + r.stderr
    assert "installed through the egress proxy" in r.stdout
    # urllib and curl need nothing configured either
    r = sb.exec(
        f"python -c \"import urllib.request as u; print(u.urlopen('http://pypi.test:{index}/simple/').status)\""
        f" && curl -sf -o /dev/null -w '%{{http_code}}' http://pypi.test:{index}/simple/sfegress-probe/"
    )
    assert r.exit_code == 0 and r.stdout.split() == ["200", "200"], r.stdout + r.stderr
    records = sb.egress_records(t0)
    wheel = [x for x in records if x.url.endswith(WHEEL)]
    assert len(wheel) == 1, records
    w = wheel[0]
    assert (w.method, w.host, w.port, w.status, w.allowed) == ("GET", "pypi.test", index, 200, True)
    assert w.rule == f"allow: pypi.test:{index}"
    assert w.bytes_in > 500 and w.bytes_out > 50 and w.server == "127.0.0.1"
    assert t0 - 1 <= w.time <= time.time() + 1
    assert all(x.client == sb.egress_address for x in records)
    assert len(records) >= 4  # index page, wheel, urllib, curl


PROBE_SCRIPT = r"""
import json, os, socket, sys, urllib.request, urllib.error
out = {}
# explicitly through the proxy: the sandbox's no_proxy sends 127.0.0.1 to its own loopback
os.environ.pop("no_proxy", None); os.environ.pop("NO_PROXY", None)
via_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({"http": os.environ["http_proxy"]}))
def http(name, url):
    try:
        out[name] = via_proxy.open(url, timeout=10).status
    except urllib.error.HTTPError as e:
        out[name] = e.code
    except Exception as e:
        out[name] = type(e).__name__
def tcp(name, host, port):
    try:
        socket.create_connection((host, port), timeout=3).close(); out[name] = "connected"
    except Exception as e:
        out[name] = type(e).__name__
def udp(name, host, port, payload=b"ping"):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    try:
        s.sendto(payload, (host, port)); s.recvfrom(512); out[name] = "answered"
    except Exception as e:
        out[name] = type(e).__name__
def dns(name, host):
    try:
        out[name] = socket.getaddrinfo(host, 80)[0][4][0]
    except Exception as e:
        out[name] = type(e).__name__
cfg = json.loads(sys.argv[1])
http("not_listed", "http://notallowed.test/")
http("allowed_name_forbidden_addr", "http://meta.test/latest/meta-data/")
http("allowed_name_private_addr", "http://lan.test/")
http("metadata_ip", "http://169.254.169.254/latest/meta-data/")
http("metadata_ip_as_mapped_v6", "http://[::ffff:169.254.169.254]/latest/meta-data/")
http("host_loopback_other_port", "http://127.0.0.1:%d/" % cfg["loop_port"])
http("listed_name_other_port", "http://pypi.test:%d/" % cfg["loop_port"])
http("other_sandbox_via_proxy", "http://%s:%d/" % (cfg["peer"], cfg["peer_port"]))
tcp("direct_tcp_gateway", cfg["gw"], cfg["gw_tcp"])
tcp("direct_tcp_proxy_host_other_port", cfg["gw"], 22)
tcp("direct_tcp_other_sandbox", cfg["peer"], cfg["peer_port"])
udp("udp_gateway", cfg["gw"], cfg["gw_udp"])
q = b"\x12\x34\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\x07outside\x04test\x00\x00\x01\x00\x01"
udp("dns_direct_gateway", cfg["gw"], 53, q)
dns("dns_via_engine_resolver", "outside.test")
if cfg.get("squid_port"):  # bwrap: squid's own port on the host's loopback, named directly
    tcp("direct_tcp_squid", "127.0.0.1", cfg["squid_port"])
out["interfaces"] = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").readlines()[2:])
out["routes"] = open("/proc/net/route").read().splitlines()[1:]
print(json.dumps(out))
"""


def test_every_forbidden_path_is_refused(
    open_box: Callable[[str], EgressBox], endpoint: egress.Endpoint, index: int, backend: str
) -> None:
    """docker: the gateway is the host's side of the egress network. bwrap: 127.0.0.1 is the
    host's loopback (where squid and the probes listen) as the sandbox would name it, which
    in its own namespace is its own loopback: the same probes, and squid's port, refused."""
    loop_probe = Probe("127.0.0.1")  # a host service on 127.0.0.1 that is not listed
    gw_tcp = Probe(endpoint.gateway)  # a host service on the bridge address (bwrap: loopback)
    gw_udp = Probe(endpoint.gateway, udp=True)
    dns_probe = Probe(endpoint.gateway, 53, udp=True)  # where the engine's resolver forwards
    probes = [loop_probe, gw_tcp, gw_udp, dns_probe]
    try:
        peer = open_box("peer")
        peer.exec("nohup python -m http.server 8000 --bind 0.0.0.0 >/dev/null 2>&1 &")
        if backend == "bwrap":  # the peer's address is the host's: a listener squid could reach
            probes.append(Probe(peer.egress_address, 8000))
        up = peer.exec(
            "for i in $(seq 50); do curl -s --noproxy '*' -o /dev/null -w '%{http_code}' "
            "http://127.0.0.1:8000/ && break; sleep 0.2; done"
        )
        assert up.stdout.endswith("200"), up
        sb = open_box("attacker")
        t0 = time.time()
        cfg = {
            "loop_port": loop_probe.port,
            "gw": endpoint.gateway,
            "gw_tcp": gw_tcp.port,
            "gw_udp": gw_udp.port,
            "peer": peer.egress_address,
            "peer_port": 8000,
            "squid_port": endpoint.port if backend == "bwrap" else 0,
        }
        sb.write_file("probe.py", PROBE_SCRIPT)
        r = sb.exec(f"python probe.py '{json.dumps(cfg)}'", timeout=90)
        assert r.exit_code == 0, r.stderr
        out = json.loads(r.stdout)
        for name in (
            "not_listed",
            "allowed_name_forbidden_addr",
            "allowed_name_private_addr",
            "metadata_ip",
            "metadata_ip_as_mapped_v6",
            "host_loopback_other_port",
            "listed_name_other_port",
            "other_sandbox_via_proxy",
        ):
            assert out[name] == 403, (name, out)
        for name in (
            "direct_tcp_gateway",
            "direct_tcp_proxy_host_other_port",
            "direct_tcp_other_sandbox",
        ):
            assert out[name] in ("ConnectionRefusedError", "TimeoutError", "OSError"), (name, out)
        for name in ("udp_gateway", "dns_direct_gateway"):
            assert out[name] != "answered", (name, out)
        assert out["dns_via_engine_resolver"] == "gaierror", out
        if backend == "bwrap":  # nothing in its namespace but its own loopback, no route
            assert out["interfaces"] == ["lo"] and out["routes"] == [], out
            assert out["direct_tcp_squid"] == "ConnectionRefusedError", out
        time.sleep(0.5)
        assert [p.hits for p in probes] == [0] * len(probes)  # nothing reached any listener
        # every request the proxy refused is recorded, denied, with the rule that refused it
        # (the proxy's records: a URL; refusals of direct connections, where recorded, have none)
        proxied = [x for x in sb.egress_records(t0) if x.url]
        rules = {(x.host, x.port): x.rule for x in proxied if not x.allowed}
        assert rules[("notallowed.test", 80)] == "deny: not in allowlist"
        assert rules[("meta.test", 80)] == "deny: meta.test resolves to a forbidden address"
        assert rules[("lan.test", 80)] == "deny: lan.test:80 resolves to a forbidden address"
        assert rules[("169.254.169.254", 80)] == "deny: forbidden address 169.254.0.0/16"
        assert (
            rules[("127.0.0.1", loop_probe.port)]
            == f"deny: port {loop_probe.port} not allowed for 127.0.0.1"
        )
        assert (
            rules[("pypi.test", loop_probe.port)]
            == f"deny: port {loop_probe.port} not allowed for pypi.test"
        )
        assert rules[(peer.egress_address, 8000)].startswith("deny: forbidden address")
        denied = [x for x in proxied if not x.allowed]
        assert len(denied) == 8, denied  # one record per refused request
        metadata = [x.rule for x in denied if "169.254" in x.host or "ffff" in x.host]
        assert metadata == ["deny: forbidden address 169.254.0.0/16"] * 2  # plain + v6-mapped
        assert peer.egress_records(t0) == []  # another sandbox's requests are not its own
        if backend == "docker":  # the host firewall's refusals are recorded too
            fw = [x for x in sb.egress_records(t0) if x.result == egress_firewall.RESULT]
            gw = endpoint.gateway
            assert {
                ("TCP", gw, gw_tcp.port),
                ("TCP", gw, 22),
                ("TCP", peer.egress_address, 8000),
                ("UDP", gw, gw_udp.port),
                ("UDP", gw, 53),  # straight to the gateway, and the engine's resolver's
            } <= {(x.method, x.host, x.port) for x in fw}, fw
            assert all((x.allowed, x.rule) == (False, egress_firewall.RULE) for x in fw)
    finally:
        for p in probes:
            p.close()


def test_policy_entries_are_checked_with_clear_errors() -> None:
    assert parse_entry("*.pythonhosted.org:443").matches_host("files.pythonhosted.org")
    assert parse_entry("*.pythonhosted.org").matches_host("pythonhosted.org")
    assert not parse_entry("pypi.org").matches_host("evilpypi.org")
    assert parse_entry("10.0.0.0/8:80,8000-8010").matches_port(8005)
    assert not parse_entry("[::1]:80").matches_port(443)
    for bad, why in [
        ("pypi.org:0", "outside 1-65535"),
        ("a b", "not a hostname"),
        ("x:port", "not a port"),
    ]:
        with pytest.raises(PolicyError, match=why):
            parse_entry(bad)
    with pytest.raises(ValueError, match="egress_allow is set but network is 'none'"):
        SandboxLimits(egress_allow=("pypi.org",))
    with pytest.raises(ValueError, match="'bad host'"):
        SandboxLimits(network="allowlist", egress_allow=("bad host",))
    # one proxy per distinct policy, the same for the same entries in any order
    a = EgressPolicy.build("allowlist", ["a.org", "b.org"])
    assert a.key == EgressPolicy.build("allowlist", ["b.org", "a.org"]).key
    assert a.key != EgressPolicy.build("open", []).key


HOLD_SCRIPT = r"""
import socket, sys, time
held = []
for _ in range(int(sys.argv[1])):
    held.append(socket.create_connection(("127.0.0.1", 808), timeout=5))
open("/tmp/held", "w").write(str(len(held)))
time.sleep(600)
"""


GARBAGE_SCRIPT = r"""
import socket
s = socket.create_connection(("127.0.0.1", 808), timeout=10)
s.sendall(b"\x00\xff" * 500 + b"\r\n\r\n")
print(s.recv(64))
"""


@pytest.mark.parametrize("backend", ["bwrap"], indirect=True)
def test_bwrap_relay_is_out_of_the_sandboxs_reach_and_bounded(
    open_box: Callable[[str], EgressBox], index: int
) -> None:
    """The in-namespace listener belongs to no process of the sandbox: its port cannot be
    bound, `kill -9 -1` does not touch it; a flood of connections is held to MAX_CONNS
    (the rest wait in the kernel's backlog), then service resumes; garbage reaches squid
    (which refuses it) and nothing else; closing the sandbox closes it all."""
    sb = open_box("relay")
    assert isinstance(sb, BwrapSandbox) and sb.tap is not None
    tap = sb.tap
    curl = f"curl -s -o /dev/null -w '%{{http_code}}' http://pypi.test:{index}/simple/"
    squat = (
        "python3 -c \"import socket\nfor a in ('127.0.0.1', '0.0.0.0'):\n"
        " s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)\n"
        " try: s.bind((a, 808)); print('bound')\n"
        ' except OSError as e: print(type(e).__name__)"'
    )
    r = sb.exec(squat)
    assert r.stdout.split() == ["PermissionError", "PermissionError"], r
    r = sb.exec("kill -9 -1; sleep 1")  # every process the sandbox user can signal
    assert sb.exec(curl).stdout == "200"
    # a flood: MAX_CONNS are relayed, the listener pauses, the rest wait; then it resumes
    sb.write_file("hold.py", HOLD_SCRIPT)
    n, before, t_flood = bwrap_egress.MAX_CONNS + 8, tap.accepted, time.time()
    sb.exec(f"nohup python3 hold.py {n} >/tmp/hold.log 2>&1 & echo $! > /tmp/hold.pid")
    for _ in range(100):
        if tap.accepted - before >= bwrap_egress.MAX_CONNS and tap.paused:
            break
        time.sleep(0.1)
    assert len(tap.conns) == bwrap_egress.MAX_CONNS and tap.paused, (len(tap.conns), tap.paused)
    held = sb.exec(
        "for i in $(seq 50); do [ -s /tmp/held ] && break; sleep 0.1; done; cat /tmp/held"
    )
    assert held.stdout == str(n), held  # the rest held by the kernel's backlog, not served
    sb.exec("kill $(cat /tmp/hold.pid)")
    for _ in range(100):
        if not tap.conns and not tap.paused:
            break
        time.sleep(0.1)
    assert not tap.conns and not tap.paused and tap.accepted - before == n
    assert sb.exec(curl).stdout == "200"
    # raw garbage goes to squid, which refuses it; nothing else hears it
    sb.write_file("garbage.py", GARBAGE_SCRIPT)
    r = sb.exec("python3 garbage.py")
    assert r.stdout.startswith("b'HTTP/1.1 400"), r
    # connections that made no request are recorded, but as no request: not allowed
    time.sleep(0.3)
    rules = [x.rule for x in sb.egress_records(t_flood) if not x.allowed]
    assert rules.count("deny: not a request (error:transaction-end-before-headers)") == n
    assert rules.count("deny: not a request (error:invalid-request)") == 1
    source, listener = tap.source, tap.listener
    sb.close()
    assert tap.closed and not tap.conns and listener.fileno() == -1
    with socket.socket() as s:  # the source address is free for the next sandbox
        s.bind((source, bwrap_egress.RESERVE_PORT))


UNPRIVILEGED_SCRIPT = r"""
import json, os, sys, time
from sandbox import SandboxConfig, SandboxLimits, bwrap_egress, open_sandbox
rootfs, index = sys.argv[1], int(sys.argv[2])
lim = SandboxLimits(
    memory_mb=1024,
    network="allowlist",
    egress_allow=("pypi.test:%d" % index, "127.0.0.1:%d" % index),
    egress_hosts=("pypi.test=127.0.0.1",),
)
ep = bwrap_egress.endpoint_for(lim)
out = {"uid": os.geteuid(), "state_dir": str(ep.state_dir)}
try:
    sb = open_sandbox(SandboxConfig(backend="bwrap", image=rootfs, limits=lim))
    t0 = time.time()
    sb.write_file("squat.py", "import socket\ntry:\n    socket.socket().bind(('127.0.0.1', 808))\n    print('bound')\nexcept OSError as e:\n    print(type(e).__name__)\n")
    r = sb.exec(
        "id -u; curl -s -o /dev/null -w '%%{http_code} ' http://pypi.test:%d/simple/;" % index
        + " curl -s -o /dev/null -w '%{http_code} ' http://notallowed.test/;"
        + " python3 squat.py; tail -n +3 /proc/net/dev | cut -d: -f1"
    )
    out["exec"] = r.stdout.split()
    time.sleep(0.3)
    out["records"] = [
        [x.host, x.status, x.allowed, x.rule, x.client == sb.egress_address]
        for x in sb.egress_records(t0)
    ]
    sb.close()
    out["closed"] = sb.tap.closed
finally:
    bwrap_egress.teardown(ep)
print(json.dumps(out))
"""


def test_bwrap_egress_works_for_an_unprivileged_user(sandbox_rootfs: str, index: int) -> None:
    """Unprivileged bubblewrap (uid 1000, user namespaces): a child process joins the user
    namespace that owns the sandbox's network namespace, binds the listener and hands it
    back; the user's own squid (its own state folder) relays and records the same way.

    Run in a private mount namespace where the rootfs is bind-mounted where uid 1000 can
    reach it, with the system python3 (root's interpreter is not uid 1000's to run)."""
    python = "/usr/bin/python3"
    site = Path(sys.prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    probe = subprocess.run(
        [python, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True, text=True
    )
    if probe.stdout.strip() != str(tuple(sys.version_info[:2])):
        pytest.skip(
            f"{python} is not Python {sys.version_info[:2]} (needed for the venv's packages)"
        )
    userns = subprocess.run(
        ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "--"]
        + ["bwrap", "--unshare-user", "--unshare-net", "--ro-bind", "/", "/", "true"],
        capture_output=True,
    )
    if userns.returncode != 0:
        pytest.skip("unprivileged user namespaces are not available here")
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here (unshare -m) to lend the rootfs to uid 1000")
    folder = Path(tempfile.mkdtemp(prefix="sandflow-unpriv-"))  # pytest's folders are root's
    try:
        mnt, script = folder / "rootfs", folder / "script.py"
        mnt.mkdir()
        script.write_text(UNPRIVILEGED_SCRIPT)
        for p in (folder, mnt, script):
            p.chmod(0o755)
        root = Path(__file__).resolve().parents[2]
        env = f"PATH=/usr/sbin:/usr/bin:/bin HOME=/tmp PYTHONPATH={root}:{site / 'site-packages'}"
        inner = (
            f"mount --bind {sandbox_rootfs} {mnt} && exec env -i {env} setpriv --reuid=1000"
            f" --regid=1000 --clear-groups -- {python} {script} {mnt} {index}"
        )
        proc = subprocess.run(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", inner],
            cwd="/tmp",
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(folder)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["uid"] == 1000 and out["state_dir"].startswith("/var/tmp/sandflow-egress-1000/")
    # the host's uid 1000 outside, the sandbox user inside (its user namespace maps one to the other)
    assert out["exec"] == [str(SANDBOX_UID), "200", "403", "PermissionError", "lo"], out
    records = {(r[0], r[1]): r[2:] for r in out["records"]}
    assert records[("pypi.test", 200)] == [True, f"allow: pypi.test:{index}", True], out
    assert records[("notallowed.test", 403)] == [False, "deny: not in allowlist", True], out
    assert out["closed"] is True


def test_episode_turns_carry_their_requests_into_the_egress_view(
    open_box: Callable[[str], EgressBox], index: int, scripted_model: object, tmp_path: Path
) -> None:
    """A scripted model pip-installs in one turn, is refused in the next: the warehouse's
    `egress` view has each request with its run, episode and turn."""
    from datasets_prep.task import Task
    from tasks.loop import run_episode
    from tests.scripted_model import ScriptedModel, tool_reply
    from tests.tasks.conftest import fast_model
    from warehouse.query import WarehouseQuery
    from warehouse.writer import EpisodeWriter

    assert isinstance(scripted_model, ScriptedModel)
    pip = (
        "pip install -q --no-cache-dir --trusted-host pypi.test "
        f"--index-url http://pypi.test:{index}/simple/ sfegress-probe"
    )
    scripted_model.push(
        tool_reply("execute_bash", {"command": "echo no network here"}),
        tool_reply("execute_bash", {"command": pip}),
        tool_reply("execute_bash", {"command": "curl -s -o /dev/null http://notallowed.test/"}),
        # no command rule sees the network here; the traffic does
        tool_reply("execute_bash", {"command": "python3 /testbed/documents/fetch.py"}),
        tool_reply("submit", {}),
    )
    sb = open_box("episode")
    fetch = f"import urllib.request as u\nu.urlopen('http://pypi.test:{index}/simple/').read()\n"
    task = Task(
        id="t",
        domain="chem",
        problem_statement="install it",
        ground_truth="x",
        input_files={"fetch.py": fetch},
    )
    with EpisodeWriter(tmp_path) as writer:
        result = run_episode(
            task, fast_model(scripted_model), recorder=writer, sandbox=sb, run_id="egress-run"
        )
    assert result.record.termination == "submitted"
    with WarehouseQuery(tmp_path) as q:
        rows = q.rows(
            "SELECT turn_index, method, host, port, status, allowed, rule, bytes_in, url "
            "FROM egress ORDER BY time"
        )
        by_turn = q.rows("SELECT turn_index, count(*) FROM egress GROUP BY ALL ORDER BY 1")
    assert {r[0] for r in rows} == {1, 2, 3}, rows  # turn 0 made no request
    wheel = [r for r in rows if r[8] and r[8].endswith(WHEEL)]
    assert len(wheel) == 1 and wheel[0][:6] == (1, "GET", "pypi.test", index, 200, True)
    assert wheel[0][6] == f"allow: pypi.test:{index}" and wheel[0][7] > 500
    denied = [r for r in rows if not r[5]]
    assert [(r[0], r[2], r[4], r[6]) for r in denied] == [
        (2, "notallowed.test", 403, "deny: not in allowlist")
    ]
    assert by_turn[1] == (2, 1)
    # the external_resource label comes from the traffic where there was traffic
    from analysis.metrics import turn_labels, usage_call_rows
    from warehouse import Warehouse

    data = Warehouse(tmp_path).load_run("egress-run")
    caps = {r["turn_index"]: r["capabilities"] for r in turn_labels(data)}
    assert "external_resource" not in caps[0]
    assert "external_resource" in caps[3]  # python3 fetch.py: computation by its command alone
    traffic = [r for r in usage_call_rows(data) if r["tool"] == "egress"]
    assert [(r["turn_index"], r["capability"]) for r in traffic] == [
        (1, "external_resource"),
        (3, "external_resource"),
    ]
    assert traffic[1]["detail"] == f"egress: 1 requests (pypi.test:{index})"


def test_settle_waits_for_the_proxys_log_with_a_marker_no_sandbox_sees(
    open_box: Callable[[str], EgressBox], index: int, endpoint: egress.Endpoint
) -> None:
    """The episode settles the proxy before each turn's read: a request of its own that
    squid refuses at its first rule, whose line follows those of the requests that ended
    before it. The marker is the host's, never in a sandbox's records."""
    sb = open_box("settle")
    t0 = time.time()
    r = sb.exec(f"curl -s -o /dev/null -w '%{{http_code}}' http://pypi.test:{index}/simple/")
    assert r.stdout == "200", r.stdout + r.stderr
    assert sb.egress_settle()
    records = sb.egress_records(t0, time.time())
    assert [(x.host, x.status) for x in records] == [("pypi.test", 200)], records
    log = (endpoint.state_dir / "access.log").read_text(errors="replace").splitlines()
    marks = [line for line in log if "/squid-internal-mgr/sandflow-settle-" in line]
    parsed = [egress.parse_line(line, EgressPolicy.build("allowlist", ())) for line in marks]
    assert parsed and all(x and x.status == 403 and not x.allowed for x in parsed), marks[-3:]
    assert all(x and x.client != sb.egress_address for x in parsed)
    assert not any("sandflow-settle" in x.url for x in sb.egress_records(t0))


def test_settle_is_bounded_when_the_proxy_does_not_answer(backend: str, index: int) -> None:
    """A stopped squid (its own policy here, so no other test waits on it) makes settle
    return False at its bound; the caller reads what is there and goes on."""
    import signal

    from sandbox.procs import read_pid

    limits = SandboxLimits(network="allowlist", egress_allow=(f"stopped.test:{index}",))
    ep = start_proxy(backend, limits)
    master = read_pid(ep.state_dir / "squid.pid")
    assert master
    # squid's master and its worker, which does the work
    squids = [master] + [
        int(d.name)
        for d in Path("/proc").iterdir()
        if d.name.isdigit() and _ppid(d) == master
    ]
    try:
        assert egress.settle(ep, timeout=5.0)  # a live one answers
        for pid in squids:
            os.kill(pid, signal.SIGSTOP)
        try:
            assert egress.settle(ep, timeout=0.3) is False
        finally:
            for pid in squids:
                os.kill(pid, signal.SIGCONT)
        assert egress.settle(ep, timeout=5.0)
    finally:
        stop_proxy(backend, ep)


def _ppid(proc: Path) -> int | None:
    try:  # the field after the command's closing parenthesis
        return int((proc / "stat").read_text().rpartition(")")[2].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def test_network_spec_per_run_and_per_task() -> None:
    """One string carries the policy (a flag, SANDFLOW_NETWORK, a task's metadata.network);
    a task's metadata overrides the run's policy for its episodes."""
    from datasets_prep.task import Task
    from tasks.episode import End as _End
    from tasks.opening import sandbox_config as _sandbox_config
    from tasks.records import EpisodeRecord

    lim = SandboxLimits(network="allowlist:pypi.org *.pythonhosted.org:443;10.0.0.0/8:80,8080")
    assert lim.network == "allowlist"
    assert lim.egress_allow == ("pypi.org", "*.pythonhosted.org:443", "10.0.0.0/8:80,8080")
    run_cfg = SandboxConfig(limits=SandboxLimits(network="none", memory_mb=300))
    record = EpisodeRecord(
        run_id="r",
        episode_id="e",
        task_id="t",
        domain="d",
        mode="sandbox",
        model="m",
        started_at=datetime.now(UTC),
    )

    def task(**meta: object) -> Task:
        return Task(id="t", domain="d", problem_statement="p", ground_truth="g", metadata=meta)

    assert _sandbox_config(run_cfg, record, task()).limits.network == "none"
    cfg = _sandbox_config(run_cfg, record, task(network="allowlist:files.example.org:443"))
    assert (cfg.limits.network, cfg.limits.egress_allow) == (
        "allowlist",
        ("files.example.org:443",),
    )
    assert cfg.limits.memory_mb == 300 and cfg.episode_id == "e"
    assert _sandbox_config(run_cfg, record, task(network="open")).limits.network == "open"
    with pytest.raises(_End) as bad:
        _sandbox_config(run_cfg, record, task(network="allowlist:bad|host"))
    assert "task t: metadata.network" in str(bad.value.error) and "bad|host" in str(bad.value.error)


def test_log_reading_is_incremental_per_sandbox_and_bounded(tmp_path: Path) -> None:
    """The shared access log is read from a per-sandbox cursor: each turn reads what came
    since; a line squid is still writing waits; other addresses' lines are not ours."""
    ep = egress.Endpoint("n", "10.0.0.1", 13128, tmp_path)
    policy = EgressPolicy.build("allowlist", ["pypi.test:80"])
    log = tmp_path / "access.log"

    def line(t: float, client: str, host: str = "pypi.test", url: str = "http://pypi.test/") -> str:
        return f"{t:.3f} {client} GET {host} 80 200 100 2000 TCP_MISS 127.0.0.1 {url}\n"

    log.write_text(line(90, "10.0.0.2"))
    cursor = egress.LogCursor.at_end(ep)  # a sandbox created now: older lines are not its own
    with open(log, "a") as f:
        f.write(line(101, "10.0.0.2") + line(102, "10.0.0.3") + line(103, "10.0.0.2", "x.test"))
        f.write("104.000 10.0.0.2 GET pypi.test 80 200 1")  # squid is still writing this one
    turn1 = egress.read_records(ep, policy, egress.Window("10.0.0.2", 100, 103, cursor))
    assert [(r.time, r.host, r.rule) for r in turn1] == [
        (101.0, "pypi.test", "allow: pypi.test:80")
    ]
    turn2 = egress.read_records(ep, policy, egress.Window("10.0.0.2", 103, 200, cursor))
    assert [(r.host, r.allowed) for r in turn2] == [("x.test", True)]  # status came from squid
    with open(log, "a") as f:
        f.write("00 2000 TCP_MISS 127.0.0.1 http://pypi.test/late\n")
        f.write(line(105, "10.0.0.2", url="http://pypi.test/" + "a" * 100_000))
    turn3 = egress.read_records(ep, policy, egress.Window("10.0.0.2", 200, 300, cursor))
    assert turn3 == []
    late = egress.read_records(ep, policy, egress.Window("10.0.0.2", 103, 300, egress.LogCursor()))
    assert [r.time for r in late] == [103.0, 104.0, 105.0]
    assert len(late[2].url) == egress.MAX_FIELD  # every field from the log is bounded


def test_open_mode_still_refuses_forbidden_addresses_and_the_proxy_itself(
    backend: str, test_run_id: str
) -> None:
    """`open` lets any name through, never a forbidden address nor squid's own manager."""
    lim = SandboxLimits(memory_mb=512, network="open", egress_hosts=("loop.test=127.0.0.1",))
    ep = start_proxy(backend, lim)
    try:
        cfg = SandboxConfig(
            backend=backend,
            run_id=test_run_id,
            episode_id="open",
            limits=lim,
        )
        with open_sandbox(cfg) as sb:
            t0 = time.time()
            urls = [
                f"http://sandflow-egress:{ep.port}/squid-internal-mgr/info",
                f"http://{ep.gateway}:{ep.port}/squid-internal-mgr/info",
                "http://loop.test:8080/",
                "http://169.254.169.254/",
            ]
            for u in urls:  # all through the proxy (bwrap: its 127.0.0.1 is in no_proxy)
                r = sb.exec(f"curl -s --noproxy '' -o /dev/null -w '%{{http_code}}' '{u}'")
                assert r.stdout == "403", (u, r)
            time.sleep(0.3)
            records = sb.egress_records(t0)  # type: ignore[attr-defined]
            assert len(records) == 4 and not any(x.allowed for x in records)
            assert all(x.rule.startswith("deny: forbidden address") for x in records)
    finally:
        stop_proxy(backend, ep)


def test_the_egress_network_has_its_mtu_and_an_older_one_is_replaced_once_unused(
    monkeypatch: pytest.MonkeyPatch, test_run_id: str
) -> None:
    """docker: the sandbox's egress interface has EGRESS_MTU (why: docs/sandbox.md, Speed).
    A network made by an earlier version (docker's default 1500) is kept while a sandbox is
    on it, and replaced (squid restarted on the new gateway, old rules gone) by the next
    start of its policy once none is."""
    why = proxy_unavailable("docker")
    if why:
        pytest.skip(why)
    from sandbox.engine import docker_client

    api = docker_client().api
    lim = SandboxLimits(memory_mb=256, network="allowlist", egress_allow=("mtu-upgrade.test:80",))
    cfg = SandboxConfig(backend="docker", run_id=test_run_id, episode_id="mtu", limits=lim)
    mtu_of = lambda ep: api.inspect_network(ep.network)["Options"].get(  # noqa: E731
        "com.docker.network.driver.mtu"
    )
    monkeypatch.setattr(egress, "EGRESS_MTU", 1500)  # as an earlier version made it
    ep = old = egress.endpoint_for(api, lim)
    try:
        assert mtu_of(old) == "1500"
        with open_sandbox(cfg) as sb:
            monkeypatch.undo()
            assert sb.exec("cat /sys/class/net/eth0/mtu").stdout.strip() == "1500"
            ep = egress.endpoint_for(api, lim)  # a sandbox is on it: kept as it is
            assert (ep.network, ep.gateway, mtu_of(ep)) == (old.network, old.gateway, "1500")
        ep = egress.endpoint_for(api, lim)
        assert mtu_of(ep) == str(egress.EGRESS_MTU)
        with socket.create_connection((ep.gateway, ep.port), timeout=5):
            pass  # squid listens on the new network's gateway
        if ep.gateway != old.gateway:
            accept = [
                "INPUT",
                "-i",
                egress.BRIDGE_PREFIX + ep.network[len(egress.NETWORK_PREFIX) :],
            ]
            accept += ["-d", old.gateway, "-p", "tcp", "--dport", str(old.port), "-j", "ACCEPT"]
            assert subprocess.run(["iptables", "-C", *accept], capture_output=True).returncode
        with open_sandbox(cfg) as sb:
            assert sb.exec("cat /sys/class/net/eth0/mtu").stdout.strip() == str(egress.EGRESS_MTU)
            r = sb.exec("curl -s -o /dev/null -w '%{http_code}' http://not-listed.test/")
            assert r.stdout == "403"  # through the restarted squid, refused by its rules
    finally:
        egress.teardown(api, ep)
