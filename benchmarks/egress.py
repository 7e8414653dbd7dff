"""The egress proxy (network allowlist) against a direct download, measured in the same run.

    .venv/bin/python benchmarks/egress.py [--mb 50] [--reps 5] [--sandboxes 20]

Every "outside" is a listener this script starts on 127.0.0.1 (a static file server and a
pypiserver with a wheel it builds); the sandboxes reach them only through the proxy.

Figures:
  proxy_download_ratio  a --mb file fetched by curl on the host through the egress proxy's
                        CONNECT tunnel (how every HTTPS download, PyPI's included, crosses it)
                        vs directly from the same server (p50s, interleaved)   target <= 1.3
  proxy_http_forward_ratio  the same over plain-HTTP forwarding (squid parses the reply; shown)
  sandbox_download_s    the same file fetched inside a sandbox through the proxy (shown)
  allowed_ok            allowed requests from a sandbox that succeeded / tried
  denied_blocked / denied_tried   forbidden paths tried from a sandbox and refused (goal: all)
  recorded_ratio        proxy requests recorded for the sandbox / proxy requests it made (goal 1.0)
  cache_hit_ratio       --sandboxes sandboxes `pip install` the same wheel: share of the
                        wheel's requests the proxy served from its cache (ideal (n-1)/n)
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sandbox import SandboxConfig, SandboxLimits, egress, open_sandbox  # noqa: E402
from sandbox.engine import docker_client  # noqa: E402
from tests.sandbox.test_egress import WHEEL, build_wheel, start_index  # noqa: E402

RUN_ID = "bench-egress"

# (name, how to try it from inside the sandbox, refused?) -- shell commands; exit 0 = got through
FORBIDDEN = [
    ("not_listed", "curl -sf -o /dev/null http://notallowed.test/"),
    ("allowed_name_to_metadata", "curl -sf -o /dev/null http://meta.test/latest/"),
    ("metadata_ip", "curl -sf -o /dev/null http://169.254.169.254/latest/"),
    ("host_loopback_other_port", "curl -sf --noproxy '' -o /dev/null http://127.0.0.1:{other}/"),
    ("listed_name_other_port", "curl -sf -o /dev/null http://pypi.test:{other}/"),
    ("https_connect_not_listed", "curl -sf -o /dev/null https://notallowed.test/"),
]
FORBIDDEN_DIRECT = [  # never reach the proxy: not in its log
    ("direct_tcp_gateway", "timeout 5 bash -c 'echo > /dev/tcp/{gw}/{other}'"),
    ("direct_tcp_proxy_host_ssh", "timeout 5 bash -c 'echo > /dev/tcp/{gw}/22'"),
    (
        "udp_dns_gateway",
        "timeout 5 python3 -c \"import socket; s=socket.socket(2,2); s.settimeout(2); s.sendto(b'x',('{gw}',53)); s.recv(9)\"",
    ),
    ("dns_engine_resolver", "timeout 10 getent hosts outside.test"),
]


def p50(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def curl_time(url: str, proxy: str | None, tunnel: bool = False) -> float:
    argv = ["curl", "-sf", "-o", "/dev/null", "-w", "%{time_total}"]
    argv += ["-x", proxy] if proxy else ["--noproxy", "*"]
    argv += ["--proxytunnel"] if tunnel else []
    out = subprocess.run([*argv, url], capture_output=True, text=True, timeout=300, check=True)
    return float(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--mb", type=int, default=50)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--sandboxes", type=int, default=20)
    ap.add_argument("--concurrency", type=int, default=4)
    args = ap.parse_args()
    why = egress.unavailable()
    if why:
        sys.exit(f"egress benchmark: {why}")

    work = Path(tempfile.mkdtemp(prefix="sandflow-bench-egress-"))
    (work / "files").mkdir()
    blob = work / "files" / "blob.bin"
    with open(blob, "wb") as f:
        f.write(os.urandom(args.mb << 20))
    (work / "index").mkdir()
    build_wheel(work / "index", payload_bytes=2 << 20)
    files_port = 0
    procs: list[subprocess.Popen[bytes]] = []
    try:
        index_proc, index_port = start_index(work / "index")
        procs.append(index_proc)
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            files_port = s.getsockname()[1]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "http.server", str(files_port), "--bind", "127.0.0.1"],
                cwd=work / "files",
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        time.sleep(1.0)
        limits = SandboxLimits(
            memory_mb=512,
            pids=128,
            tmp_size_mb=256,
            network="allowlist",
            egress_allow=(
                f"pypi.test:{index_port}",
                f"127.0.0.1:{index_port},{files_port}",
                "meta.test",
            ),
            egress_hosts=("pypi.test=127.0.0.1", "meta.test=169.254.169.254"),
        )
        api = docker_client().api
        ep = egress.endpoint_for(api, limits)
        host_proxy = ep.proxy_url
        try:
            fig = run(args, ep, limits, host_proxy, files_port, index_port)
        finally:
            egress.teardown(api, ep)
    finally:
        for p in procs:
            p.kill()
            p.wait()
        subprocess.run(["rm", "-rf", str(work)], check=False)
    print(json.dumps(fig))


def run(
    args: argparse.Namespace,
    ep: egress.Endpoint,
    limits: SandboxLimits,
    host_proxy: str,
    files_port: int,
    index_port: int,
) -> dict[str, Any]:
    direct, proxied, forwarded = [], [], []
    url = f"http://127.0.0.1:{files_port}/blob.bin"
    for i in range(args.reps):  # interleaved, so machine load hits all three alike
        direct.append(curl_time(f"{url}?d={i}", None))
        proxied.append(curl_time(f"{url}?t={i}", host_proxy, tunnel=True))
        forwarded.append(curl_time(f"{url}?f={i}", host_proxy))
    ratio = p50(proxied) / p50(direct)
    fwd_ratio = p50(forwarded) / p50(direct)
    print(
        f"download {args.mb} MB: direct p50 {p50(direct):.3f}s, proxy tunnel p50 "
        f"{p50(proxied):.3f}s -> {ratio:.2f}x (target <= 1.3); plain-HTTP forwarding "
        f"{p50(forwarded):.3f}s -> {fwd_ratio:.2f}x"
    )

    cfg = SandboxConfig(run_id=RUN_ID, episode_id="probe", limits=limits)
    with open_sandbox(cfg) as sb:
        assert hasattr(sb, "egress_records")
        t0 = time.time()
        r = sb.exec(
            f"curl -sf --noproxy '' -o /dev/null -w '%{{time_total}}' http://127.0.0.1:{files_port}/blob.bin?s=1",
            timeout=300,
        )
        sandbox_dl = float(r.stdout) if r.exit_code == 0 else float("nan")
        allowed = [
            f"curl -sf -o /dev/null http://pypi.test:{index_port}/simple/",
            f"python3 -c \"import urllib.request as u; u.urlopen('http://pypi.test:{index_port}/simple/sfegress-probe/')\"",
            f"pip download -q --no-deps --no-cache-dir -d /tmp/dl --trusted-host pypi.test --index-url http://pypi.test:{index_port}/simple/ sfegress-probe",
        ]
        allowed_ok = sum(sb.exec(c, timeout=120).exit_code == 0 for c in allowed)
        proxied_made = 1 + 1 + 1 + 2  # blob, index page, urllib, pip: index page + wheel
        fmt = {"other": 9, "gw": ep.gateway}
        blocked = 0
        for name, cmd in FORBIDDEN + FORBIDDEN_DIRECT:
            res = sb.exec(cmd.format(**fmt), timeout=60)
            ok = res.exit_code != 0
            blocked += ok
            print(f"  {name:28s} {'refused' if ok else 'GOT THROUGH'}")
        proxied_made += len(FORBIDDEN)
        time.sleep(0.5)
        records = sb.egress_records(t0)  # type: ignore[attr-defined]
    tried = len(FORBIDDEN) + len(FORBIDDEN_DIRECT)
    print(
        f"allowed {allowed_ok}/{len(allowed)}, denied {blocked}/{tried}, recorded {len(records)}/{proxied_made}"
    )

    # the shared download cache: n sandboxes install the same wheel
    since = time.time()
    pip = (
        "pip install -q --no-cache-dir --trusted-host pypi.test "
        f"--index-url http://pypi.test:{index_port}/simple/ sfegress-probe"
    )

    def install(i: int) -> tuple[bool, list[egress.EgressRecord]]:
        c = SandboxConfig(run_id=RUN_ID, episode_id=f"cache-{i}", limits=limits)
        with open_sandbox(c) as box:
            res = box.exec(pip, timeout=180)
            ok = res.exit_code == 0
            if not ok:
                print(f"  install {i} failed: {(res.stdout + res.stderr)[-300:]}")
            time.sleep(0.2)
            return ok, box.egress_records(since)  # type: ignore[attr-defined]

    t = time.perf_counter()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(install, range(args.sandboxes)))
    installs_s = time.perf_counter() - t
    wheel_reqs = [x for _, recs in results for x in recs if x.url.endswith(WHEEL)]
    hits = sum("HIT" in x.result for x in wheel_reqs)
    installed = sum(ok for ok, _ in results)
    hit_ratio = hits / len(wheel_reqs) if wheel_reqs else 0.0
    print(
        f"{args.sandboxes} sandboxes installed the same wheel ({installed} ok, {installs_s:.1f}s): "
        f"{hits}/{len(wheel_reqs)} wheel requests from the proxy's cache"
    )
    return {
        "benchmark": "egress",
        "download_mb": args.mb,
        "direct_p50_s": round(p50(direct), 4),
        "proxy_p50_s": round(p50(proxied), 4),
        "proxy_download_ratio": round(ratio, 3),
        "proxy_http_forward_p50_s": round(p50(forwarded), 4),
        "proxy_http_forward_ratio": round(fwd_ratio, 3),
        "sandbox_download_s": round(sandbox_dl, 4),
        "allowed_ok": allowed_ok,
        "allowed_tried": len(allowed),
        "denied_blocked": blocked,
        "denied_tried": tried,
        "recorded_ratio": round(len(records) / proxied_made, 3),
        "cache_sandboxes": args.sandboxes,
        "cache_installs_ok": installed,
        "cache_wheel_requests": len(wheel_reqs),
        "cache_hit_ratio": round(hit_ratio, 3),  # 0: the cache is off (docs/sandbox.md)
        "cache_ideal_ratio": round((args.sandboxes - 1) / args.sandboxes, 3),
        "target_download_ratio": 1.3,
        "pass": ratio <= 1.3 and blocked == tried and len(records) == proxied_made,
    }


if __name__ == "__main__":
    main()
