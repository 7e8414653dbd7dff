"""The egress proxy of the `allowlist` / `open` network policies (docker backend).

Layout, per (engine host, policy): one docker network created `--internal` with inter-
container traffic off (`enable_icc=false`), and one squid (Debian's) on the host listening
only on that network's gateway address. Sandboxes of that policy join the network and get
`HTTP(S)_PROXY` pointing at it, so pip, apt, curl and urllib work unchanged. Host firewall
rules (iptables, inserted first in INPUT and DOCKER-USER) make the proxy the only thing a
sandbox can reach: from the network's bridge, TCP to the proxy port is accepted and every
other packet to the host (other ports, DNS, UDP, ICMP) and every forwarded packet (direct
connections to any address, other sandboxes, other networks) is rejected. squid itself
refuses what the policy does not allow, checking the address after resolution
(sandbox/netpolicy.py). No TLS interception: HTTPS is a CONNECT tunnel to an allowed
host:port, recorded with its byte counts.

Shared, not per sandbox: every sandbox of a policy on this host uses the same network and
the same squid (a squid per distinct policy, so no sandbox can use a laxer policy's proxy:
each listens on its own network's gateway, which other networks' bridges cannot reach).
They outlive the process that started them (like docker networks); `teardown` removes them.

Every request is one line in `access.log` (time, client address, method, host:port, URL
where visible, status, bytes each way); `records_for` reads the lines of one sandbox's
address in a time window, bounded, and names the rule behind each decision.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import secrets
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox import egress_firewall, log_tail, settings
from sandbox.base import SandboxError
from sandbox.netpolicy import EgressPolicy, squid_rules
from sandbox.procs import pid_file_alive, read_pid, stop_pid

log = logging.getLogger("sandflow.sandbox.egress")


def state_root() -> Path:
    """Where the proxies' state lives (HostSettings.egress_dir; default /var/tmp/sandflow-egress)."""
    return settings.current().egress_dir or settings.DEFAULT_EGRESS_DIR


PROXY_PORT = 13128  # not 3128: a distribution squid started by its package may hold that
NETWORK_PREFIX = "sandflow-egress-"
BRIDGE_PREFIX = "sfeg-"
LOG_FORMAT = "%ts.%03tu %>a %rm %>rd %>rP %>Hs %>st %<st %Ss %<a %ru"
MAX_LOG_BYTES = 64 << 20  # the most of one access log read per call
MAX_RECORDS = 10_000  # per sandbox and window
MAX_FIELD = 2048
START_TIMEOUT_S = 20.0
SETTLE_TIMEOUT_S = 2.0  # the most one settle() waits for the proxy's log to catch up
# The sandbox <-> proxy leg never leaves the host (an internal bridge, one hop to the
# gateway), so it gets loopback-sized packets: at docker's default 1500 every 64 KB squid
# relays crosses the bridge as ~45 segments with their ACKs and wake-ups, which measured
# here as the largest share of a tunnel's cost (50 MB through the CONNECT tunnel: 1.64-1.69x
# a direct download at 1500, 1.18-1.20x at this MTU, same sandbox, interleaved;
# docs/sandbox.md). Nothing on it is routed onward, so no path-MTU question arises.
EGRESS_MTU = 65520
MAX_OBJECT_MB = 2048  # the largest file cached (CUDA wheels approach 2 GB)
# package files are named by their version: a URL ending so is treated as unchanged for a day
PACKAGE_FILES = (
    r"\.(whl|tar\.gz|tgz|tar\.bz2|tar\.xz|zip|egg|deb|udeb|rpm|conda|gem|crate|jar)(\?.*)?$"
)


@dataclass(frozen=True)
class Endpoint:
    """Where the sandboxes of a policy meet its proxy."""

    network: str  # docker network name
    gateway: str  # the host's address on it: squid listens here
    port: int
    state_dir: Path

    @property
    def proxy_url(self) -> str:
        return f"http://{self.gateway}:{self.port}"

    def sandbox_env(self) -> dict[str, str]:
        """What makes pip, apt, curl, wget, git and urllib use the proxy unasked."""
        url = self.proxy_url
        env = {}
        for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ftp_proxy"):
            env[k] = url
        env["no_proxy"] = env["NO_PROXY"] = "localhost,127.0.0.1,::1"
        env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
        return env


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise SandboxError(f"network policy allowlist: {argv[0]} is not installed") from None
    if check and proc.returncode != 0:
        raise SandboxError(
            f"network policy allowlist: {' '.join(argv)} failed: {proc.stderr.strip()[:300]}"
        )
    return proc


def unavailable() -> str | None:
    """Why the egress proxy cannot run here, or None."""
    if shutil.which("squid") is None:
        return "the egress proxy needs Debian's squid: `apt-get install -y squid` (or scripts/setup.sh)"
    if shutil.which("iptables") is None:
        return "the egress proxy needs iptables on the docker host"
    if os.geteuid() != 0:
        return "the egress proxy (host firewall rules, squid on the docker bridge) needs root"
    return egress_firewall.unavailable()


def _rules(bridge: str, gateway: str, port: int) -> list[list[str]]:
    """Host firewall rules for one egress bridge, in the order they must apply."""
    rej_tcp = ["-j", "REJECT", "--reject-with", "tcp-reset"]
    return [
        [
            "iptables",
            "INPUT",
            "-i",
            bridge,
            "-d",
            gateway,
            "-p",
            "tcp",
            "--dport",
            str(port),
            "-j",
            "ACCEPT",
        ],
        # what the next rules refuse is logged first (rate-limited; egress_firewall.py)
        egress_firewall.log_rule(bridge, "INPUT"),
        ["iptables", "INPUT", "-i", bridge, "-p", "tcp", *rej_tcp],
        ["iptables", "INPUT", "-i", bridge, "-j", "REJECT"],
        egress_firewall.log_rule(bridge, "DOCKER-USER"),
        ["iptables", "DOCKER-USER", "-i", bridge, "-p", "tcp", *rej_tcp],
        ["iptables", "DOCKER-USER", "-i", bridge, "-j", "REJECT"],
        ["iptables", "DOCKER-USER", "-o", bridge, "-j", "REJECT"],
        ["ip6tables", "INPUT", "-i", bridge, "-j", "REJECT"],
        ["ip6tables", "FORWARD", "-i", bridge, "-j", "REJECT"],
    ]


def _install_rules(bridge: str, gateway: str, port: int) -> None:
    rules = [r for r in _rules(bridge, gateway, port) if shutil.which(r[0]) is not None]
    present = [_run([t, "-C", c, *spec], check=False).returncode == 0 for t, c, *spec in rules]
    if any(present) and not all(present):
        _reinstall_rules(bridge, gateway, port)
        return
    # insert in reverse at position 1 of each chain: the first rule ends up first
    for (tool, chain, *spec), there in zip(reversed(rules), reversed(present), strict=True):
        if there:
            continue
        if chain == "DOCKER-USER" and _run([tool, "-L", chain, "-n"], check=False).returncode != 0:
            _run([tool, "-N", chain])
            _run([tool, "-I", "FORWARD", "1", "-j", chain])
        _run([tool, "-I", chain, "1", *spec])


def _reinstall_rules(bridge: str, gateway: str, port: int) -> None:
    """Rules of an older layout (set up by an earlier version) replaced in order, with no
    moment where the bridge is open: a blanket refusal goes first and leaves last."""
    guards = [
        ["iptables", chain, "-i", bridge, "-j", "REJECT", "--reject-with", "icmp-admin-prohibited"]
        for chain in ("INPUT", "DOCKER-USER")
    ]
    for tool, chain, *spec in guards:
        _run([tool, "-I", chain, "1", *spec])
    try:
        for tool, chain, *spec in _rules(bridge, gateway, port):
            if shutil.which(tool) is None:
                continue
            while _run([tool, "-C", chain, *spec], check=False).returncode == 0:
                _run([tool, "-D", chain, *spec], check=False)
        for tool, chain, *spec in reversed(_rules(bridge, gateway, port)):
            if shutil.which(tool) is not None:
                _run([tool, "-I", chain, "1", *spec])
    finally:
        for tool, chain, *spec in guards:
            _run([tool, "-D", chain, *spec], check=False)


def _remove_rules(bridge: str, gateway: str, port: int) -> None:
    for tool, chain, *spec in _rules(bridge, gateway, port):
        if shutil.which(tool) is None:
            continue
        while _run([tool, "-C", chain, *spec], check=False).returncode == 0:
            _run([tool, "-D", chain, *spec], check=False)


def _squid_conf(
    policy: EgressPolicy, ep_dir: Path, gateway: str, port: int, hosts_file: Path | None
) -> str:
    conf = [
        f"http_port {gateway}:{port}",
        f"pid_filename {ep_dir}/squid.pid",
        f"logformat sandflow {LOG_FORMAT}",
        f"access_log stdio:{ep_dir}/access.log sandflow",
        f"cache_log {ep_dir}/cache.log",
        "cache_store_log none",
        "logfile_rotate 0",
        "buffered_logs off",
        f"coredump_dir {ep_dir}",
        "visible_hostname sandflow-egress",
        "shutdown_lifetime 1 seconds",
        "forwarded_for delete",
        "httpd_suppress_version_string on",
        *_cache_conf(ep_dir),
        # read ahead of a slow client far enough that a download streams (default 16 KB)
        "read_ahead_gap 4 MB",
        # a socket buffer of 1 MB: a tunnel's reads are whole 64 KB chunks (squid's size)
        # instead of 64 KB + the rest of ~93 KB, a quarter fewer reads and waits per byte
        "tcp_recv_bufsize 1 MB",
    ]
    if hosts_file is not None:
        conf.append(f"hosts_file {hosts_file}")
    return "\n".join(c for c in conf if c) + "\n" + squid_rules(policy)


def _cache_conf(ep_dir: Path) -> list[str]:
    """The shared download cache: one disk store per policy, hits for every sandbox of it.

    Why every revalidation is a full fetch (the conditional headers are removed from what
    squid sends upstream): squid 5.7 applies a 304 reply's `Content-Length` to the stored
    object (squid bug 5538), and servers such as Python's wsgiref (pypiserver's default)
    send `Content-Length: 0` with a 304, so the next hit served the cached wheel with
    zero bytes (pip: hash mismatch). Any client can force a revalidation (`Cache-Control:
    max-age=0`), so without this one sandbox could empty a file for all the others.
    Nothing private is shared: requests with credentials or cookies, and replies that set
    a cookie, are not stored."""
    cache_mb = settings.current().egress_cache_mb  # disk, under the policy's state folder
    if cache_mb <= 0:
        return ["cache deny all", "cache_mem 8 MB"]
    return [
        f"cache_dir aufs {ep_dir}/cache {cache_mb} 16 16",  # 256 folders: quick to create
        f"maximum_object_size {MAX_OBJECT_MB} MB",
        "cache_mem 64 MB",
        "maximum_object_size_in_memory 1 MB",
        "collapsed_forwarding on",  # concurrent misses of one URL: one upstream fetch
        "request_header_access If-Modified-Since deny all",
        "request_header_access If-None-Match deny all",
        "acl sf_credentials req_header Authorization .",
        "acl sf_cookie req_header Cookie .",
        "acl sf_sets_cookie rep_header Set-Cookie .",
        "cache deny sf_credentials",
        "cache deny sf_cookie",
        "store_miss deny sf_sets_cookie",
        f"refresh_pattern -i {PACKAGE_FILES} 1440 100% 525600 override-lastmod",
        "refresh_pattern . 0 20% 4320",
    ]


def _wait_listening(host: str, port: int, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.1)
    return False


def ensure(api: Any, policy: EgressPolicy, hosts: dict[str, str] | None = None) -> Endpoint:
    """The endpoint of `policy` on the engine behind `api`: network, rules and squid, started
    on first use (an flock makes concurrent starters wait for one another).

    `hosts` (name -> address) is a hosts file for the proxy's resolver: what tests use to
    give a local listener a name; it is part of the policy's identity.
    """
    why = unavailable()
    if why:
        raise SandboxError(f"network policy {policy.mode!r}: {why}")
    import docker.errors

    key = state_key(policy, hosts)
    ep_dir = state_root() / key
    ep_dir.mkdir(parents=True, exist_ok=True)
    name, bridge = NETWORK_PREFIX + key, BRIDGE_PREFIX + key
    with open(ep_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            net = api.inspect_network(name)
        except docker.errors.NotFound:
            net = None
        if net is not None and _outdated(net) and _retire(api, net, ep_dir, bridge):
            net = None
        if net is None:
            net = api.create_network(
                name,
                driver="bridge",
                internal=True,
                options={
                    "com.docker.network.bridge.enable_icc": "false",
                    "com.docker.network.driver.mtu": str(EGRESS_MTU),
                    "com.docker.network.bridge.name": bridge,
                },
                labels={"sandflow.egress": key},
            )
            net = api.inspect_network(net["Id"])
        gateway = _gateway(net)
        if not gateway:
            raise SandboxError(f"egress network {name}: the engine gave it no gateway address")
        try:
            egress_firewall.ensure_logger(state_root())
        except RuntimeError as exc:
            raise SandboxError(f"network policy {policy.mode!r}: {exc}") from None
        _install_rules(bridge, gateway, PROXY_PORT)
        if not pid_file_alive(ep_dir / "squid.pid"):
            start_squid(policy, ep_dir, gateway, PROXY_PORT, hosts)
    return Endpoint(name, gateway, PROXY_PORT, ep_dir)


def _gateway(net: dict[str, Any]) -> str:
    configs = (net.get("IPAM") or {}).get("Config") or []
    gateway = next((c.get("Gateway") for c in configs if c.get("Gateway")), "")
    return str(gateway).split("/")[0]


def _outdated(net: dict[str, Any]) -> bool:
    """An egress network made by an earlier version (docker's default MTU, not ours)."""
    return (net.get("Options") or {}).get("com.docker.network.driver.mtu") != str(EGRESS_MTU)


def _retire(api: Any, net: dict[str, Any], ep_dir: Path, bridge: str) -> bool:
    """Remove an outdated egress network with its squid and rules, so the caller makes it
    anew, when no sandbox is on it; False (kept, working as before) while one is. The
    caller holds `ep_dir`'s lock. squid keeps its cache across the restart."""
    import docker.errors

    if net.get("Containers"):
        return False
    try:
        api.remove_network(net["Id"])
    except docker.errors.APIError:  # a sandbox joined since: the next start tries again
        return False
    log.info("egress network %s: replaced (made by an earlier version)", net.get("Name"))
    stop_squid(ep_dir, drop_cache=False)  # it listened on the old network's gateway
    if old_gateway := _gateway(net):
        _remove_rules(bridge, old_gateway, PROXY_PORT)
    return True


def state_key(policy: EgressPolicy, hosts: dict[str, str] | None) -> str:
    """The id of a proxy's state folder: the policy's key, plus its hosts file when given."""
    if not hosts:
        return policy.key
    import hashlib

    return hashlib.sha256((policy.key + repr(sorted(hosts.items()))).encode()).hexdigest()[:10]


def start_squid(
    policy: EgressPolicy, ep_dir: Path, address: str, port: int, hosts: dict[str, str] | None
) -> None:
    """Write the config of `policy` into `ep_dir` and start squid listening on address:port;
    returns once it accepts connections. The caller holds `ep_dir`'s lock (both backends:
    docker's proxy listens on its network's gateway, bwrap's on the host's loopback)."""
    hosts_file = None
    if hosts:
        hosts_file = ep_dir / "hosts"
        hosts_file.write_text("".join(f"{a} {n}\n" for n, a in hosts.items()))
    (ep_dir / "squid.conf").write_text(_squid_conf(policy, ep_dir, address, port, hosts_file))
    for f in ("access.log", "cache.log"):
        (ep_dir / f).touch()
    with contextlib.suppress(KeyError, OSError):
        import pwd

        proxy = pwd.getpwnam("proxy")
        for f in ("access.log", "cache.log"):
            os.chown(ep_dir / f, proxy.pw_uid, proxy.pw_gid)
        os.chown(ep_dir, proxy.pw_uid, proxy.pw_gid)
    service = squid_service(ep_dir)
    for stale in Path("/dev/shm").glob(f"{service}-*"):  # left by a squid of ours that died
        stale.unlink(missing_ok=True)  # (the caller holds the lock and its pid is gone)
    if settings.current().egress_cache_mb > 0 and not (ep_dir / "cache" / "00").is_dir():
        _init_cache(ep_dir, service)
    _run(["squid", "-n", service, "-f", str(ep_dir / "squid.conf")])
    if not _wait_listening(address, port, START_TIMEOUT_S):
        tail = (ep_dir / "cache.log").read_text(errors="replace")[-600:]
        raise SandboxError(f"egress proxy in {ep_dir} did not start: {tail}")


def squid_service(ep_dir: Path) -> str:
    """squid's service name for the proxy in `ep_dir`: it names the shared-memory segments
    (collapsed forwarding, the cache's index), so every squid on the host needs its own."""
    return "sf" + re.sub(r"[^A-Za-z0-9]", "", ep_dir.name)[:30]


def _init_cache(ep_dir: Path, service: str) -> None:
    """Create the cache store's folders (`squid -z`, in the foreground) before the start."""
    cache = ep_dir / "cache"
    cache.mkdir(exist_ok=True)
    with contextlib.suppress(KeyError, OSError):
        import pwd

        proxy = pwd.getpwnam("proxy")
        os.chown(cache, proxy.pw_uid, proxy.pw_gid)
    _run(["squid", "-n", service, "-N", "-z", "-f", str(ep_dir / "squid.conf")])


def teardown(api: Any, endpoint: Endpoint) -> None:
    """Stop the proxy, drop the rules and the network (its sandboxes must be gone)."""
    import docker.errors

    stop_squid(endpoint.state_dir)
    bridge = BRIDGE_PREFIX + endpoint.network[len(NETWORK_PREFIX) :]
    _remove_rules(bridge, endpoint.gateway, endpoint.port)
    for _ in range(50):  # its sandboxes' containers may still be going (auto-remove)
        try:
            api.remove_network(endpoint.network)
            return
        except docker.errors.NotFound:
            return
        except docker.errors.APIError:
            time.sleep(0.2)
    log.warning("egress network %s: still in use, left in place", endpoint.network)


def stop_squid(ep_dir: Path, drop_cache: bool = True) -> None:
    """Stop the squid whose pid file is in `ep_dir` (waits up to 5 s for it to go), and
    drop its download cache: a proxy is stopped by a teardown (tests, benchmarks, an
    operator's cleanup), and a policy nobody runs should not keep gigabytes on disk. A
    running proxy keeps its cache across the processes that use it."""
    pid = read_pid(ep_dir / "squid.pid")
    if pid is not None and not stop_pid(pid, timeout_s=5.0):
        return  # still running after 5 s: its cache stays
    if drop_cache and not pid_file_alive(ep_dir / "squid.pid"):
        shutil.rmtree(ep_dir / "cache", ignore_errors=True)


def container_address(api: Any, container_id: str, network: str) -> str:
    """The sandbox's address on the egress network: how its requests are told apart."""
    info = api.inspect_container(container_id)
    nets = ((info.get("NetworkSettings") or {}).get("Networks")) or {}
    addr = (nets.get(network) or {}).get("IPAddress") or ""
    if not addr:
        raise SandboxError(f"sandbox {container_id[:12]} has no address on {network}")
    return str(addr)


@dataclass(frozen=True)
class EgressRecord:
    """One request as the proxy saw it."""

    time: float
    client: str
    method: str
    host: str
    port: int
    url: str
    status: int
    bytes_out: int  # from the sandbox
    bytes_in: int  # to the sandbox
    result: str  # squid's result code, e.g. TCP_MISS, TCP_MEM_HIT, TCP_DENIED, TCP_TUNNEL
    server: str  # the address connected to ('-' when none)
    allowed: bool
    rule: str

    def as_row(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @property
    def cache_hit(self) -> bool:
        """Served from the shared download cache, without a fetch of its own: a hit, a
        request collapsed onto another sandbox's in-flight fetch of the same URL (squid's
        `_CF_` tag, e.g. TCP_CF_MISS: `collapsed_forwarding on`), or a revalidation that
        found the copy current. The `egress` view's `cache_hit` column says the same."""
        r = self.result
        return "HIT" in r or "_CF_" in r or r == "TCP_REFRESH_UNMODIFIED"


def _int(s: str) -> int:
    try:
        return max(0, min(int(s), 1 << 62))
    except ValueError:
        return 0


def parse_line(line: str, policy: EgressPolicy) -> EgressRecord | None:
    """One access.log line (LOG_FORMAT), or None when it is not one of ours."""
    parts = line.rstrip("\n").split(" ", 10)
    if len(parts) != 11:
        return None
    ts, client, method, host, port, status, out_b, in_b, result, server, url = parts
    try:
        t = float(ts)
    except ValueError:
        return None
    port_n = _int(port) if port != "-" else (443 if method == "CONNECT" else 80)
    # squid logs a connection that never made a request as `error:...` in the URL
    # (transaction-end-before-headers, invalid-request): nothing was fetched, no rule applied
    no_request = url.startswith("error:")
    allowed = "DENIED" not in result and not no_request
    host = host[:MAX_FIELD]
    return EgressRecord(
        time=t,
        client=client[:64],
        method=method[:32],
        host=host,
        port=port_n,
        url=url[:MAX_FIELD],
        status=_int(status),
        bytes_out=_int(out_b),
        bytes_in=_int(in_b),
        result=result[:64],
        server=server[:64],
        allowed=allowed,
        rule=f"deny: not a request ({url[:64]})"
        if no_request
        else policy.explain(host, port_n, allowed),
    )


@dataclass
class LogCursor:
    """Where a sandbox's next read of the shared access log starts, so each turn reads only
    what was logged since (not the whole log, which every sandbox of the policy shares)."""

    pos: int = 0
    firewall_pos: int = 0  # in the firewall's log of refusals (egress_firewall.py)

    @classmethod
    def at_end(cls, endpoint: Endpoint) -> LogCursor:
        cursor = cls(0)
        with contextlib.suppress(OSError):
            cursor.pos = (endpoint.state_dir / "access.log").stat().st_size
        with contextlib.suppress(OSError):
            cursor.firewall_pos = egress_firewall.log_path(state_root()).stat().st_size
        return cursor


@dataclass(frozen=True)
class Window:
    """What one read of the shared logs is after: the lines of address `client` that
    ended in [since, until), read from `cursor` on (None: the log's last MAX_LOG_BYTES).
    The cursor moves past the lines logged before `since`, so a caller's `since` must
    never go back (the episode loop's moves forward turn by turn)."""

    client: str
    since: float
    until: float | None = None
    cursor: LogCursor | None = None

    def holds(self, r: EgressRecord) -> bool:
        return r.client == self.client and (self.until is None or r.time < self.until)


def read_records(endpoint: Endpoint, policy: EgressPolicy, window: Window) -> list[EgressRecord]:
    """The proxy's requests in `window` (squid writes a line when a request ends; a tunnel
    still open is not there yet). At most MAX_LOG_BYTES read and MAX_RECORDS returned per
    call."""
    path = endpoint.state_dir / "access.log"
    cursor = window.cursor
    if cursor is not None:
        start, whole = cursor.pos, True
    else:  # no cursor: the log's last MAX_LOG_BYTES (its first line may be cut)
        try:
            start, whole = max(0, path.stat().st_size - MAX_LOG_BYTES), False
        except OSError:
            return []

    def parse(raw: bytes) -> EgressRecord | None:
        return parse_line(raw.decode("utf-8", "replace"), policy) if raw[:1].isdigit() else None

    out, pos = log_tail.read_since(
        path,
        start,
        since=window.since,
        parse=parse,
        time_of=lambda r: r.time,
        keep=window.holds,
        max_bytes=MAX_LOG_BYTES,
        max_records=MAX_RECORDS,
        from_line_start=whole,
    )
    if cursor is not None:
        cursor.pos = pos
    return out


def settle(endpoint: Endpoint, timeout: float = SETTLE_TIMEOUT_S) -> bool:
    """Return once squid has logged every request that ended before this call: a reader
    that takes its `until` after this misses none of them.

    squid writes a request's line after the client has its reply, so a command that
    fetched something can end before its line is there (under load, by more than a turn).
    The barrier is a request of our own, which squid refuses at its first rule (`deny
    manager`: no name is looked up, nothing leaves the host). squid handles events in
    order, so once that request's line is in the log, the lines of the requests that ended
    before it are too. Its client is the host, never a sandbox's address, so no sandbox's
    records include it. Bounded by `timeout`; False when the log did not show it in time.
    """
    path = endpoint.state_dir / "access.log"
    deadline = time.monotonic() + timeout
    try:
        pos = path.stat().st_size
    except OSError:
        return False
    token = f"sandflow-settle-{secrets.token_hex(8)}".encode()
    request = b"GET http://127.0.0.1/squid-internal-mgr/" + token + b" HTTP/1.0\r\n\r\n"
    try:
        with socket.create_connection((endpoint.gateway, endpoint.port), timeout=timeout) as s:
            s.sendall(request)
            while s.recv(65536) and time.monotonic() < deadline:
                pass  # the refusal; its line is written once squid is done with it
    except OSError as e:
        log.debug("egress settle: the proxy at %s:%s: %s", endpoint.gateway, endpoint.port, e)
        return False
    while True:
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                data = f.read(MAX_LOG_BYTES)
        except OSError:
            return False
        if token in data:
            return True
        pos += data.rfind(b"\n") + 1  # the marker may be in the line being written
        if time.monotonic() >= deadline:
            log.debug("egress settle: no line for the marker within %.1f s", timeout)
            return False
        time.sleep(0.002)


def firewall_records(endpoint: Endpoint, window: Window) -> list[EgressRecord]:
    """The direct connections in `window` that the host firewall refused (docker backend),
    as denied records: protocol in `method`, the address and port tried in `host` /
    `port`, the packet's length in `bytes_out`."""
    if not endpoint.network.startswith(NETWORK_PREFIX):
        return []  # not a docker egress network: no firewall of ours in front of it
    bridge = BRIDGE_PREFIX + endpoint.network[len(NETWORK_PREFIX) :]
    cursor = window.cursor
    at = [cursor.firewall_pos if cursor is not None else 0]
    found = egress_firewall.read(
        egress_firewall.log_path(state_root()), bridge, window.client, window.since, window.until, at
    )
    if cursor is not None:
        cursor.firewall_pos = at[0]
    return [
        EgressRecord(
            time=r.time,
            client=r.client,
            method=r.protocol,
            host=r.dest,
            port=r.port,
            url="",
            status=0,
            bytes_out=r.length,
            bytes_in=0,
            result=egress_firewall.RESULT,
            server="-",
            allowed=False,
            rule=egress_firewall.RULE,
        )
        for r in found
    ]


def records_for(endpoint: Endpoint, policy: EgressPolicy, window: Window) -> list[EgressRecord]:
    """Everything tried in `window`: the proxy's requests and the firewall's refusals, in
    time order."""
    found = read_records(endpoint, policy, window)
    found += firewall_records(endpoint, window)
    return sorted(found, key=lambda r: r.time)[:MAX_RECORDS]


def policy_of(limits: Any) -> EgressPolicy:
    """The egress policy of a sandbox's limits (network 'allowlist' or 'open')."""
    return EgressPolicy.build(limits.network, limits.egress_allow)


def endpoint_for(api: Any, limits: Any) -> Endpoint:
    """The shared proxy endpoint for a sandbox with these limits, started on first use."""
    from sandbox.netpolicy import parse_hosts

    return ensure(api, policy_of(limits), parse_hosts(limits.egress_hosts) or None)
