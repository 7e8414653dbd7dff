"""The egress firewall's refusals are recorded (docker backend): a direct connection that
never reaches the proxy (raw TCP, UDP, DNS) is in the sandbox's egress records, denied,
with its protocol and port; a flood of them is bounded and counted, never logged whole.

Every "outside" is a listener this test starts on the gateway address of the docker
network its own policy creates (the host side of that network), and it must count zero.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox import SandboxConfig, SandboxLimits, egress, egress_firewall, open_sandbox
from sandbox.docker_backend import DockerSandbox
from tests.sandbox.test_egress import Probe

pytestmark = [
    pytest.mark.docker,
    pytest.mark.skipif(egress.unavailable() is not None, reason=str(egress.unavailable())),
]


@pytest.fixture(scope="module")
def limits() -> SandboxLimits:
    return SandboxLimits(
        memory_mb=512, pids=128, network="allowlist", egress_allow=("firewall.test:80",)
    )


@pytest.fixture(scope="module")
def endpoint(limits: SandboxLimits, sandbox_image: str) -> Iterator[egress.Endpoint]:
    from sandbox.engine import docker_client

    api = docker_client().api
    ep = egress.endpoint_for(api, limits)
    yield ep
    egress.teardown(api, ep)


@pytest.fixture
def box(
    limits: SandboxLimits, endpoint: egress.Endpoint, test_run_id: str
) -> Iterator[DockerSandbox]:
    sb = open_sandbox(SandboxConfig(run_id=test_run_id, episode_id="fw", limits=limits))
    assert isinstance(sb, DockerSandbox)
    yield sb
    sb.close()


def _bridge(ep: egress.Endpoint) -> str:
    return egress.BRIDGE_PREFIX + ep.network[len(egress.NETWORK_PREFIX) :]


def _wait_records(sb: DockerSandbox, since: float, n: int) -> list[egress.EgressRecord]:
    for _ in range(30):  # the logging daemon writes within milliseconds; allow for load
        recs = [r for r in sb.egress_records(since) if r.result == egress_firewall.RESULT]
        if len(recs) >= n:
            return recs
        time.sleep(0.1)
    return recs


def test_direct_connections_are_refused_and_recorded(
    box: DockerSandbox, endpoint: egress.Endpoint
) -> None:
    tcp = Probe(endpoint.gateway)
    udp = Probe(endpoint.gateway, udp=True)
    try:
        t0 = time.time()
        script = (
            "import socket\n"
            f"try: socket.create_connection(('{endpoint.gateway}', {tcp.port}), timeout=3)\n"
            "except OSError as e: print('tcp', type(e).__name__)\n"
            f"try: socket.create_connection(('{endpoint.gateway}', 22), timeout=3)\n"
            "except OSError as e: print('ssh', type(e).__name__)\n"
            "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1)\n"
            f"s.sendto(b'x', ('{endpoint.gateway}', {udp.port}))\n"
            "try: s.recv(9)\n"
            "except OSError as e: print('udp', type(e).__name__)\n"
        )
        box.write_file("direct.py", script)
        r = box.exec("python3 direct.py; timeout 3 getent hosts outside.test || echo dns refused")
        assert "tcp ConnectionRefusedError" in r.stdout and "ssh ConnectionRefusedError" in r.stdout
        assert "dns refused" in r.stdout, r
        recs = _wait_records(box, t0, 4)
        got = {(x.method, x.host, x.port) for x in recs}
        gw = endpoint.gateway
        assert {
            ("TCP", gw, tcp.port),
            ("TCP", gw, 22),
            ("UDP", gw, udp.port),
            ("UDP", gw, 53),
        } <= got
        assert all(
            (x.allowed, x.rule, x.client) == (False, egress_firewall.RULE, box.egress_address)
            for x in recs
        )
        assert all(t0 - 1 <= x.time <= time.time() + 1 for x in recs)
        assert (tcp.hits, udp.hits) == (0, 0)
        # the proxy still works for it, and its own requests stay the proxy's records
        box.exec("curl -s -o /dev/null http://firewall.test/")
        deadline = time.monotonic() + 15  # the proxy's log line lands within ms; a loaded host is slower
        while True:
            proxied = [x for x in box.egress_records(t0) if x.result != egress_firewall.RESULT]
            if proxied or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(x.host, x.port) for x in proxied] == [("firewall.test", 80)]
    finally:
        tcp.close()
        udp.close()


def test_a_flood_is_refused_bounded_and_counted(
    box: DockerSandbox, endpoint: egress.Endpoint
) -> None:
    """3,000 datagrams in about a second: every one refused, at most the log's burst plus
    its rate recorded, the rest counted as not logged."""
    before = egress_firewall.counts(_bridge(endpoint))
    t0 = time.time()
    flood = (
        "import socket, time\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
        "t = time.time()\n"
        "for i in range(3000):\n"
        f"    s.sendto(b'x' * 64, ('{endpoint.gateway}', 9000 + i % 100))\n"
        "print(round(time.time() - t, 2))\n"
    )
    box.write_file("flood.py", flood)
    r = box.exec("python3 flood.py")
    assert r.exit_code == 0, r
    seconds = float(r.stdout) + 1
    time.sleep(0.5)
    recs = [x for x in box.egress_records(t0) if x.result == egress_firewall.RESULT]
    assert 1 <= len(recs) <= egress_firewall.LOG_BURST + 5 * (time.time() - t0 + seconds), len(recs)
    after = egress_firewall.counts(_bridge(endpoint))
    assert after["refused"] - before["refused"] >= 3000
    assert after["not_logged"] - before["not_logged"] >= 3000 - len(recs) - 50


def test_the_log_reader_bounds_and_attributes_every_line(tmp_path: Path) -> None:
    """Lines are matched by bridge and source address; a forged, broken or huge line is
    skipped; every field is bounded; a half-written line waits."""
    log = tmp_path / "refused.json"

    def line(t: float, **kw: object) -> str:
        obj = {
            "oob.time.sec": int(t),
            "oob.time.usec": int((t % 1) * 1e6),
            "oob.prefix": "sfeg-abc",
            "src_ip": "10.5.0.2",
            "dest_ip": "10.5.0.1",
            "ip.protocol": 6,
            "dest_port": 22,
            "ip.totlen": 60,
        }
        obj.update(kw)
        return json.dumps(obj) + "\n"

    log.write_text(
        line(100.5)
        + line(101, **{"oob.prefix": "sfeg-other"})  # another policy's bridge
        + line(102, src_ip="10.5.0.3")  # another sandbox
        + line(103, dest_port="x" * 100_000)  # a huge line: skipped
        + line(104, **{"ip.protocol": 17, "dest_port": 70000, "ip.totlen": -5})
        + "{not json\n"
        + line(105, dest_ip="not an address", **{"ip.protocol": 250})
        + line(106)[:40]  # still being written
    )
    cursor = [0]
    recs = egress_firewall.read(log, "sfeg-abc", "10.5.0.2", 100, None, cursor)
    assert [(r.time, r.protocol, r.dest, r.port, r.length) for r in recs] == [
        (100.5, "TCP", "10.5.0.1", 22, 60),
        (104.0, "UDP", "10.5.0.1", 0, 0),  # out of range: no port
        (105.0, "IP/250", "-", 22, 60),
    ]
    assert cursor[0] == 0  # nothing before `since`: a later turn may still want these lines
    later = egress_firewall.read(log, "sfeg-abc", "10.5.0.2", 104.5, None, cursor)
    assert [r.time for r in later] == [105.0]
    assert cursor[0] > 0 and cursor[0] < log.stat().st_size  # past the old lines, not the half one
