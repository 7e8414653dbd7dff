"""The egress firewall's refusals, recorded (docker backend, network allowlist / open).

A direct connection from a sandbox (raw TCP to an address, UDP, DNS to a resolver) never
reaches the proxy: the host firewall rejects it (sandbox/egress.py). So that it is still
seen, the firewall also hands each refused packet's headers to netfilter's log (an iptables
`NFLOG` rule just before the rejecting ones), and one logging daemon per host, Debian's
`ulogd2` (the netfilter project's own; operators already run it), writes them as JSON
lines to FIREWALL_LOG. The episode's reader attributes a line to a sandbox by its
source address on the policy's bridge, exactly as it does the proxy's access log.

Bounded on every side, because a hostile sandbox controls how many packets it sends:
- the kernel logs at most LOG_PER_SOURCE per second per source address (burst
  LOG_BURST) and LOG_PER_POLICY per second per policy's bridge; what is over the limit
  is still refused, only not logged, and counted: `counts()` reads the rules' packet
  counters (refused vs logged), so a report can say how many refusals went unrecorded;
- only the first SNAP_BYTES of a packet are copied to the daemon (headers, no payload);
- the reader reads at most MAX_READ_BYTES per call from its cursor, skips a line longer
  than MAX_LINE, bounds every field, and returns at most MAX_RECORDS;
- the file is rotated past MAX_LOG_FILE when the next sandbox of any policy starts (one
  old generation kept): at the logging limit that is hours of a sustained flood.
The header fields come from the sandbox's packets, but its source address cannot be
forged: sandboxes have no CAP_NET_RAW, and the line's interface and prefix are the
kernel's.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sandbox import log_tail, settings
from sandbox.procs import pid_file_alive, read_pid, stop_pid

SNAP_BYTES = 128  # copied per packet: IPv4 + TCP/UDP headers, never the payload
LOG_PER_SOURCE = "5/second"
LOG_BURST = 20
LOG_PER_POLICY = "50/second"
LOG_POLICY_BURST = 100
MAX_READ_BYTES = 16 << 20  # per read call
MAX_LOG_FILE = 64 << 20  # past this the log is rotated (one old generation kept)
MAX_LINE = 4096
MAX_RECORDS = 10_000
RULE = "deny: direct connection (firewall)"
RESULT = "FIREWALL_REFUSED"
_PROTOCOLS = {1: "ICMP", 6: "TCP", 17: "UDP", 58: "ICMPV6", 132: "SCTP"}


def state_dir(root: Path) -> Path:
    return root / "firewall"


def log_path(root: Path) -> Path:
    """The one JSON-lines file every policy's refusals go to (the daemon is per host)."""
    return state_dir(root) / "refused.json"


def unavailable() -> str | None:
    if shutil.which("ulogd") is None or not _plugin_dir():
        return (
            "recording the egress firewall's refusals needs Debian's ulogd2 and ulogd2-json: "
            "`apt-get install -y ulogd2 ulogd2-json` (or scripts/setup.sh)"
        )
    return None


def _plugin_dir() -> str | None:
    for d in sorted(glob.glob("/usr/lib/*/ulogd")) + ["/usr/lib/ulogd"]:
        if os.path.exists(os.path.join(d, "ulogd_output_JSON.so")):
            return d
    return None


def log_rule(bridge: str, chain: str) -> list[str]:
    """The NFLOG rule for packets arriving from `bridge` that the next rules refuse:
    rate-limited per source and per bridge, headers only, prefixed with the bridge's name."""
    return [
        "iptables",
        chain,
        "-i",
        bridge,
        "-m",
        "hashlimit",
        "--hashlimit-upto",
        LOG_PER_SOURCE,
        "--hashlimit-burst",
        str(LOG_BURST),
        "--hashlimit-mode",
        "srcip",
        "--hashlimit-name",
        bridge.replace("-", "")[:15],
        "-m",
        "limit",
        "--limit",
        LOG_PER_POLICY,
        "--limit-burst",
        str(LOG_POLICY_BURST),
        "-j",
        "NFLOG",
        "--nflog-group",
        str(settings.current().egress_nflog_group),
        "--nflog-prefix",
        bridge,
        "--nflog-size",
        str(SNAP_BYTES),
    ]


def _conf(root: Path) -> str:
    plugins = _plugin_dir() or "/usr/lib/x86_64-linux-gnu/ulogd"
    d = state_dir(root)
    names = ("inppkt_NFLOG", "raw2packet_BASE", "filter_IFINDEX", "filter_IP2STR", "output_JSON")
    lines = ["[global]", f'logfile="{d}/ulogd.log"', "loglevel=5"]
    lines += [f'plugin="{plugins}/ulogd_{n}.so"' for n in names]
    lines += [
        "stack=log1:NFLOG,base1:BASE,ifi1:IFINDEX,ip2str1:IP2STR,json1:JSON",
        "",
        "[log1]",
        f"group={settings.current().egress_nflog_group}",
        # hand over each packet at once: the kernel's default batches up to 100 packets or
        # 1 s, and a refusal logged after its turn was read would land in no turn
        "netlink_qthreshold=1",
        "netlink_qtimeout=1",
        "",
        "[json1]",
        "sync=1",
        f'file="{log_path(root)}"',
        "",
    ]
    return "\n".join(lines)


def _alive(pid_file: Path) -> bool:
    return pid_file_alive(pid_file, comm="ulogd")


def ensure_logger(root: Path) -> None:
    """The host's logging daemon for the firewall's refusals, started on first use (an
    flock makes concurrent starters wait). Like squid it outlives the process; idle it is
    one sleeping process. Raises RuntimeError naming why it could not start."""
    d = state_dir(root)
    d.mkdir(parents=True, exist_ok=True)
    pid_file = d / "ulogd.pid"
    with open(d / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conf = d / "ulogd.conf"
        if _alive(pid_file):
            if conf.is_file() and conf.read_text() == _conf(root):
                _rotate_if_big(root, pid_file)
                return
            stop_logger(root)  # started by an older version with another config
        conf.write_text(_conf(root))
        log_path(root).touch()
        proc = subprocess.run(
            ["ulogd", "-d", "-c", str(d / "ulogd.conf"), "-p", str(pid_file)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        for _ in range(50):
            if _alive(pid_file):
                return
            time.sleep(0.1)
        tail = ""
        with contextlib.suppress(OSError):
            tail = (d / "ulogd.log").read_text(errors="replace")[-400:]
        raise RuntimeError(
            f"the firewall's logger (ulogd) did not start: {proc.stderr.strip()[:300]} {tail}"
        )


def _rotate_if_big(root: Path, pid_file: Path) -> None:
    """Keep the log bounded on disk: past MAX_LOG_FILE it becomes `refused.json.1` (the
    previous one dropped) and the daemon reopens a new one (SIGHUP). A reader whose cursor
    is past the new file's end starts it from the top (egress_firewall.read)."""
    path = log_path(root)
    try:
        if path.stat().st_size <= MAX_LOG_FILE:
            return
        os.replace(path, path.with_name(path.name + ".1"))
        path.touch()
        os.kill(int(pid_file.read_text().strip()), signal.SIGHUP)
    except (OSError, ValueError):
        return


def stop_logger(root: Path) -> None:
    """Stop the host's logging daemon (nothing else uses it)."""
    pid_file = state_dir(root) / "ulogd.pid"
    pid = read_pid(pid_file)
    if pid is not None and _alive(pid_file):
        stop_pid(pid, timeout_s=5.0)


@dataclass
class Refusal:
    """One refused packet from the firewall's log (every field bounded)."""

    time: float
    bridge: str
    client: str
    protocol: str
    dest: str
    port: int
    length: int


def _text(v: Any, limit: int = 64) -> str:
    return v[:limit] if isinstance(v, str) else ""


def _num(v: Any) -> int:
    return max(0, min(v, 1 << 31)) if isinstance(v, int) and not isinstance(v, bool) else 0


def _time(obj: dict[str, Any]) -> float | None:
    sec, usec = obj.get("oob.time.sec"), obj.get("oob.time.usec")
    if isinstance(sec, int) and not isinstance(sec, bool) and 0 < sec < 1 << 40:
        return sec + (_num(usec) % 1_000_000) / 1e6
    stamp = obj.get("timestamp")
    if isinstance(stamp, str) and len(stamp) <= 40:
        with contextlib.suppress(ValueError):
            return datetime.fromisoformat(stamp).timestamp()
    return None


def _address(v: Any) -> str:
    text = _text(v, 64)
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        return ""


def parse(line: bytes) -> Refusal | None:
    """One JSON line of the daemon's, or None when it is not a refusal we can read."""
    if len(line) > MAX_LINE:
        return None
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    t = _time(obj)
    client = _address(obj.get("src_ip"))
    if t is None or not client:
        return None
    proto = _num(obj.get("ip.protocol"))
    return Refusal(
        time=t,
        bridge=_text(obj.get("oob.prefix"), 32),
        client=client,
        protocol=_PROTOCOLS.get(proto, f"IP/{proto}"),
        dest=_address(obj.get("dest_ip")) or "-",
        port=port if (port := _num(obj.get("dest_port"))) <= 65535 else 0,
        length=_num(obj.get("ip.totlen")),
    )


def read(
    path: Path, bridge: str, client: str, since: float, until: float | None, cursor: list[int]
) -> list[Refusal]:
    """The refusals logged for `client` on `bridge` in [since, until), from `cursor[0]`
    on (moved past the lines logged before `since`: sandbox/log_tail.py, shared with the
    access log's reader)."""
    out, cursor[0] = log_tail.read_since(
        path,
        cursor[0],
        since=since,
        parse=parse,
        time_of=lambda r: r.time,
        keep=lambda r: (
            r.bridge == bridge and r.client == client and (until is None or r.time < until)
        ),
        max_bytes=MAX_READ_BYTES,
        max_records=MAX_RECORDS,
    )
    return out


def counts(bridge: str) -> dict[str, int]:
    """Packets from `bridge` the firewall refused, and how many of them it logged (the
    rest went over the log's rate limit: refused all the same, not recorded)."""
    refused = logged = 0
    for chain in ("INPUT", "DOCKER-USER"):
        proc = subprocess.run(
            ["iptables", "-L", chain, "-v", "-x", "-n"], capture_output=True, text=True, timeout=30
        )
        for line in proc.stdout.splitlines():
            cols = line.split()
            if len(cols) < 7 or bridge not in cols[5:7] or not cols[0].isdigit():
                continue
            if cols[2] == "NFLOG":
                logged += int(cols[0])
            elif cols[2] == "REJECT" and cols[5] == bridge:  # from the bridge, not to it
                refused += int(cols[0])
    return {"refused": refused, "logged": logged, "not_logged": max(0, refused - logged)}
