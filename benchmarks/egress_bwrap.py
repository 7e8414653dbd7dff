"""The bwrap backend's way to the egress proxy (network allowlist): what its relay costs, and
that it lets nothing else through, measured in the same run.

    .venv/bin/python benchmarks/egress_bwrap.py [--mb 50] [--reps 7] [--starts 8]

Every "outside" is a listener this script starts on the host's 127.0.0.1 (a static file
server and a probe); the sandbox reaches them only through its relay and squid.

Figures:
  direct_p50_s              a --mb file fetched by curl on the host, straight from the server
  host_tunnel_p50_s         the same through squid's CONNECT tunnel, curl on the host
  sandbox_tunnel_p50_s      the same from inside a bwrap sandbox: relay + squid's tunnel
  relay_ratio               sandbox_tunnel / host_tunnel: what the relay's hop adds
  sandbox_download_ratio    sandbox_tunnel / direct: the whole way out vs no proxy at all
  start_none_p50_s / start_allowlist_p50_s   a sandbox's start with network none vs allowlist
  denied_blocked / denied_tried   forbidden paths tried from the sandbox and refused (goal: all)
  recorded_ratio            proxy requests found in the sandbox's records / made (goal 1.0)
Rounds are interleaved (one warm-up first), medians. The last line is one JSON object.
(benchmarks/egress.py measures squid itself and its cache on the docker backend.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import SandboxConfig, SandboxLimits, bwrap_egress, egress, open_sandbox  # noqa: E402

RUN_ID = "bench-egress-bwrap"

# (name, shell command inside the sandbox; exit status 0 = it got through)
FORBIDDEN = [
    ("not_listed", "curl -sf -o /dev/null http://notallowed.test/"),
    ("https_connect_not_listed", "curl -sf -o /dev/null https://notallowed.test/"),
    ("metadata_ip", "curl -sf -o /dev/null http://169.254.169.254/latest/"),
    ("host_loopback_other_port", "curl -sf --noproxy '' -o /dev/null http://127.0.0.1:{probe}/"),
]
FORBIDDEN_DIRECT = [  # never reach the proxy (no route): not in its log
    ("direct_tcp_host_probe", "timeout 5 bash -c 'echo > /dev/tcp/127.0.0.1/{probe}'"),
    ("direct_tcp_squid_port", "timeout 5 bash -c 'echo > /dev/tcp/127.0.0.1/{squid}'"),
    (
        "udp_dns",
        'timeout 5 python3 -c "import socket; s=socket.socket(2,2); s.settimeout(2);'
        " s.sendto(b'x',('127.0.0.1',53)); s.recv(9)\"",
    ),
    ("dns_lookup", "timeout 10 getent hosts outside.test"),
]


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def host_curl(url: str, proxy: str | None) -> float:
    argv = ["curl", "-sf", "-o", "/dev/null", "-w", "%{time_total}"]
    argv += ["-x", proxy, "--proxytunnel"] if proxy else ["--noproxy", "*"]
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--starts", type=int, default=8)
    args = ap.parse_args()
    from sandflow.host import apply_host_settings

    apply_host_settings()  # SANDFLOW_* settings, handed to the libraries as the CLI does
    why = bwrap_egress.unavailable()
    if why:
        sys.exit(f"egress_bwrap benchmark: {why}")
    work = Path(tempfile.mkdtemp(prefix="sandflow-bench-egress-bwrap-"))
    with open(work / "blob.bin", "wb") as f:
        f.write(os.urandom(args.mb << 20))
    port, probe_port = free_port(), free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    probe = socket.socket()
    probe.bind(("127.0.0.1", probe_port))
    probe.listen(8)
    probe.setblocking(False)
    lim = SandboxLimits(memory_mb=1024, network="allowlist", egress_allow=(f"127.0.0.1:{port}",))
    ep = bwrap_egress.endpoint_for(lim)
    try:
        time.sleep(1.0)
        fig = run(args, ep, lim, port, probe_port)
        try:
            probe.accept()
            fig["probe_reached"] = True
        except BlockingIOError:
            fig["probe_reached"] = False
    finally:
        bwrap_egress.teardown(ep)
        server.kill()
        server.wait()
        probe.close()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    fig["pass"] = fig["denied_blocked"] == fig["denied_tried"] and fig["recorded_ratio"] == 1.0
    fig["pass"] = fig["pass"] and not fig["probe_reached"]
    print(json.dumps(fig))


def run(
    args: argparse.Namespace, ep: egress.Endpoint, lim: SandboxLimits, port: int, probe_port: int
) -> dict[str, object]:
    proxy = ep.proxy_url
    url = f"http://127.0.0.1:{port}/blob.bin"
    cfg = SandboxConfig(backend="bwrap", run_id=RUN_ID, episode_id="relay", limits=lim)
    direct: list[float] = []
    host: list[float] = []
    inside: list[float] = []
    with open_sandbox(cfg) as sb:
        t0 = time.time()
        for i in range(args.reps + 1):  # round 0 warms up
            a = host_curl(f"{url}?d={i}", None)
            b = host_curl(f"{url}?h={i}", proxy)
            r = sb.exec(
                f"curl -sf --noproxy '' --proxytunnel -o /dev/null -w '%{{time_total}}' "
                f"'{url}?s={i}'",
                timeout=300,
            )
            c = float(r.stdout) if r.exit_code == 0 else float("nan")
            if i:
                direct.append(a)
                host.append(b)
                inside.append(c)
        made = args.reps + 1
        blocked = 0
        fmt = {"probe": probe_port, "squid": ep.port}
        for name, cmd in FORBIDDEN + FORBIDDEN_DIRECT:
            refused = sb.exec(cmd.format(**fmt), timeout=60).exit_code != 0
            blocked += refused
            print(f"  {name:28s} {'refused' if refused else 'GOT THROUGH'}")
        made += len(FORBIDDEN)
        time.sleep(0.5)
        records = sb.egress_records(t0)  # type: ignore[attr-defined]
    starts: dict[str, list[float]] = {"none": [], "allowlist": []}
    none = SandboxLimits(memory_mb=1024, network="none")
    for i in range(args.starts + 1):
        for name, limits in (("none", none), ("allowlist", lim)):
            start_cfg = SandboxConfig(
                backend="bwrap", run_id=RUN_ID, episode_id=f"s{i}", limits=limits
            )
            t = time.perf_counter()
            box = open_sandbox(start_cfg)
            if i:
                starts[name].append(time.perf_counter() - t)
            box.close()
    tried = len(FORBIDDEN) + len(FORBIDDEN_DIRECT)
    relay_ratio = p50(inside) / p50(host)
    print(
        f"{args.mb} MB: direct {p50(direct):.3f}s, host tunnel {p50(host):.3f}s, sandbox (relay +"
        f" tunnel) {p50(inside):.3f}s -> relay {relay_ratio:.2f}x; denied {blocked}/{tried},"
        f" recorded {len(records)}/{made}; start none {p50(starts['none']):.3f}s, allowlist"
        f" {p50(starts['allowlist']):.3f}s"
    )
    return {
        "benchmark": "egress_bwrap",
        "download_mb": args.mb,
        "direct_p50_s": round(p50(direct), 4),
        "host_tunnel_p50_s": round(p50(host), 4),
        "sandbox_tunnel_p50_s": round(p50(inside), 4),
        "relay_ratio": round(relay_ratio, 3),
        "sandbox_download_ratio": round(p50(inside) / p50(direct), 3),
        "start_none_p50_s": round(p50(starts["none"]), 4),
        "start_allowlist_p50_s": round(p50(starts["allowlist"]), 4),
        "denied_blocked": blocked,
        "denied_tried": tried,
        "recorded_ratio": round(len(records) / made, 3),
    }


if __name__ == "__main__":
    main()
