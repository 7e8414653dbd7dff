"""Host side of the helper protocol, over any byte transport (docker attach socket, pipes).

The helper (sandbox/_helper.py) runs as PID 1 inside the sandbox. Each message is one
JSON header line, optionally followed by `len` raw bytes. Requests are strictly one at a
time per sandbox (a lock), so no multiplexing is needed: any message that is not the
answer to the request in flight is a protocol violation.

Whatever arrives here comes out of a sandbox, so every read is bounded before anything is
allocated: a header line by `max_header` (derived from the output cap), a payload by what
the message may carry (nothing, or one data frame of at most CHUNK_MAX), a streamed
answer by its total and its deadline. A violation is a ProtocolError (a SandboxError):
the sandbox is removed at once, never waited on.
"""

from __future__ import annotations

import json
import marshal
import sys
import threading
import time
from collections.abc import Iterator
from importlib import resources
from typing import Any, Protocol

from sandbox.base import SandboxError

# The image's python3 announces its bytecode tag, then reads the helper from stdin: as
# code compiled on the host when the tags match (compiling the helper in the sandbox costs
# tens of ms of every start), else as source. The command line stays short and the image
# needs nothing installed. -I -S: isolated, no site (fast).
BOOTSTRAP = (
    "import sys,marshal;i=sys.stdin.buffer;o=sys.stdout.buffer;"
    "o.write(sys.implementation.cache_tag.encode()+b'\\n');o.flush();"
    "h=i.readline().split();b=i.read(int(h[1]));"
    "exec(marshal.loads(b) if h[0]==b'code' else compile(b,'sandflow-helper','exec'))"
)
BOOT_ARGV = ["python3", "-I", "-S", "-c", BOOTSTRAP]
_CODE: bytes | None = None


def helper_source() -> bytes:
    return resources.files("sandbox").joinpath("_helper.py").read_bytes()


def boot_payload(sandbox_tag: bytes) -> bytes:
    """The helper for a sandbox python whose cache tag is `sandbox_tag`."""
    global _CODE
    if sandbox_tag.strip() == sys.implementation.cache_tag.encode():
        if _CODE is None:
            _CODE = marshal.dumps(compile(helper_source(), "sandflow-helper", "exec"))
        return b"code %d\n" % len(_CODE) + _CODE
    src = helper_source()
    return b"src %d\n" % len(src) + src


class TransportClosed(Exception):
    """The byte stream ended: the sandbox's PID 1 exited (container died or was removed)."""


def recv_some(sock: Any, timeout: float, eof: str) -> bytes:
    """Up to 1 MiB from a socket within `timeout` (b"" when none came); TransportClosed,
    saying `eof`, when the stream ended (the docker attach stream, a fork's side channel)."""
    sock.settimeout(max(timeout, 0.001))
    try:
        chunk: bytes = sock.recv(1 << 20)
    except TimeoutError:
        return b""
    except OSError as e:
        raise TransportClosed(str(e)) from None
    if not chunk:
        raise TransportClosed(eof)
    return chunk


class ProtocolError(SandboxError):
    """The helper's channel carried something the protocol does not allow.

    The helper is out of the sandbox user's reach, so this means a broken or subverted
    helper: the sandbox is removed, nothing it sent is used, and the episode is retried.
    """


class Transport(Protocol):
    def send(self, data: bytes) -> None: ...

    def recv(self, timeout: float) -> bytes:
        """Some bytes (b"" when none arrived within `timeout`); TransportClosed at EOF."""
        ...

    def diagnostics(self) -> str:
        """The helper's own stderr tail, for error messages."""
        ...

    def close(self) -> None: ...


class BulkListener(Protocol):
    """One offer of a side channel for a fork's bytes (sandbox/bulk.py, Listener)."""

    name: str

    def accept(self) -> Transport: ...

    def close(self) -> None: ...


class BulkOffer(Protocol):
    """Where a sandbox can offer a fork's side channel (sandbox/bulk.py, BulkDir)."""

    enabled: bool

    def listen(self) -> BulkListener | None: ...


# Bounds on what the host reads from a sandbox before it allocates anything.
MIN_HEADER_BYTES = 1 << 20
CHUNK_MAX = 1 << 20  # the helper's biggest data frame (sandbox/_helper.py CHUNK_MAX)
BOOT_LINE_MAX = 256  # the sandbox python's cache tag line
STREAM_IDLE_S = 60.0  # a stream that sends nothing for this long is stalled
BULK_ACK_S = 30.0  # a helper saying whether it reached the side channel


def header_limit(output_cap_bytes: int) -> int:
    """The longest header line an exec result can need: two capped streams, JSON-escaped.

    Each output byte can become a 6-byte escape (\\ufffd for an undecodable byte), plus the
    notices the helper adds; anything longer is not a result the helper could have sent.
    """
    return max(MIN_HEADER_BYTES, 12 * output_cap_bytes + 65536)


class HelperClient:
    """Request/response over a Transport, with host-side deadlines and bounds on every read."""

    def __init__(
        self, transport: Transport, name: str, *, max_header: int = MIN_HEADER_BYTES
    ) -> None:
        self.transport = transport
        self.name = name
        self.max_header = max_header
        self.buf = bytearray()
        self.lock = threading.Lock()
        self._next_id = 0
        self.guard: dict[str, Any] = {}  # what the helper reported about its own protection

    # -- reading ---------------------------------------------------------------
    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        try:
            self.buf += self.transport.recv(remaining)
        except TransportClosed:
            raise SandboxError(
                f"sandbox {self.name}: its init process exited (the container died or was "
                f"removed){self._diag()}"
            ) from None

    def _diag(self) -> str:
        d = self.transport.diagnostics().strip()
        return f"; helper said: {d[-800:]}" if d else ""

    def _violation(self, what: str) -> ProtocolError:
        return ProtocolError(
            f"sandbox {self.name}: protocol violation on the helper's channel: {what}; "
            "nothing it sent was used and the sandbox was removed"
        )

    def _line(self, deadline: float, limit: int) -> bytes:
        """One header line of at most `limit` bytes; never buffers more than that looking."""
        scanned = 0
        while (i := self.buf.find(b"\n", scanned)) < 0:
            scanned = len(self.buf)
            if scanned > limit:
                raise self._violation(f"a header line longer than {limit} bytes")
            self._fill(deadline)
        if i > limit:
            raise self._violation(f"a header line of {i} bytes (limit {limit})")
        line = bytes(self.buf[:i])
        del self.buf[: i + 1]
        return line

    def read_message(
        self, deadline: float, *, max_payload: int = 0, payload_deadline: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """One header and its payload; `len` is checked against `max_payload` before reading."""
        line = self._line(deadline, self.max_header)
        try:
            header = json.loads(line)
        except ValueError:
            raise self._violation(f"a header that is not JSON ({line[:80]!r})") from None
        if not isinstance(header, dict):
            raise self._violation(f"a header that is not an object ({line[:80]!r})")
        n = header.get("len", 0)
        if n is None:
            n = 0
        if type(n) is not int or n < 0:
            raise self._violation(f"a payload length that is not a count ({n!r})")
        if n > max_payload:
            raise self._violation(
                f"a payload of {n} bytes where at most {max_payload} may follow this message"
            )
        limit = payload_deadline if payload_deadline is not None else deadline + STREAM_IDLE_S
        while len(self.buf) < n:
            self._fill(limit)
        with memoryview(self.buf) as view:
            payload = bytes(view[:n])  # one copy (a slice of the bytearray would be two)
        del self.buf[:n]
        return header, payload

    def _expect(self, header: dict[str, Any], rid: int) -> None:
        """Only the answer to the request in flight (or the lifetime notice) may arrive."""
        if header.get("expired") and header.get("id") == -1:
            raise SandboxExpiredSignal
        if header.get("id") != rid:
            raise self._violation(
                f"a message for request {header.get('id')!r} while {rid} was in flight"
            )

    # -- requests --------------------------------------------------------------
    def boot(self, timeout: float) -> dict[str, Any]:
        """Hand the helper to the sandbox's python and wait for its ready line."""
        deadline = time.monotonic() + timeout
        try:
            tag = self._line(deadline, BOOT_LINE_MAX)
        except TimeoutError:
            raise SandboxError(
                f"sandbox {self.name}: python3 did not start within {timeout:.0f}s{self._diag()}"
            ) from None
        try:
            self.transport.send(boot_payload(tag))
        except (OSError, TransportClosed) as e:
            raise SandboxError(
                f"sandbox {self.name}: cannot reach python3 ({e}){self._diag()}"
            ) from None
        return self.wait_ready(max(1.0, deadline - time.monotonic()))

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        try:
            header, _ = self.read_message(time.monotonic() + timeout)
        except TimeoutError:
            raise SandboxError(
                f"sandbox {self.name}: the helper did not start within {timeout:.0f}s{self._diag()}"
            ) from None
        if not header.get("ready"):
            raise SandboxError(f"sandbox {self.name}: unexpected first message {header!r}")
        if header.get("dumpable") != 0:
            raise SandboxError(
                f"sandbox {self.name}: the helper could not protect its channel "
                f"(dumpable={header.get('dumpable')!r}){self._diag()}"
            )
        self.guard = {k: header.get(k) for k in ("privsep", "dumpable", "uid")}
        return header

    def _send(self, msg: dict[str, Any], payload: bytes) -> int:
        self._next_id += 1
        msg = {**msg, "id": self._next_id}
        if payload:
            msg["len"] = len(payload)
        data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
        try:
            self.transport.send(data)
            if payload:
                self.transport.send(payload)
        except (OSError, TransportClosed) as e:
            raise SandboxError(f"sandbox {self.name}: cannot reach the helper ({e})") from None
        return self._next_id

    def request(
        self, msg: dict[str, Any], payload: bytes = b"", *, timeout: float
    ) -> tuple[dict[str, Any], bytes]:
        """Send one request and wait for its answer; TimeoutError past `timeout`."""
        with self.lock:
            rid = self._send(msg, payload)
            header, body = self.read_message(time.monotonic() + timeout)
            self._expect(header, rid)
            return header, body

    def upload(self, msg: dict[str, Any], *, bulk: BulkOffer | None = None) -> Upload:
        """Send a request whose payload follows in chunks of unknown total (a fork's archive,
        passed on as the parent sends it: the host never holds it whole); the answer is
        read by `Upload.end`. Holds the channel until then. `bulk`: offer the helper a side
        channel for the chunks (sandbox/bulk.py); it first answers whether it took it."""
        listener = bulk.listen() if bulk is not None else None
        self.lock.acquire()
        try:
            self._next_id += 1
            rid = self._next_id
            head = {**msg, "id": rid, "chunked": 1}
            if listener is not None:
                head["bulk"] = listener.name
            self._raw_send(json.dumps(head, separators=(",", ":")).encode() + b"\n")
            side = None
            if listener is not None and bulk is not None:
                side = self._bulk_ack(rid, listener, bulk)
        except BaseException:
            if listener is not None:
                listener.close()
            self.lock.release()
            raise
        return Upload(self, rid, side)

    def _bulk_ack(self, rid: int, listener: BulkListener, bulk: BulkOffer) -> Transport | None:
        """The helper's answer to a side channel offer: the connection, or None (not taken)."""
        header, _ = self.read_message(time.monotonic() + BULK_ACK_S)
        self._expect(header, rid)
        took = header.get("bulk")
        if took == 1:
            try:
                return listener.accept()
            except OSError:
                raise self._violation("it said it reached the side channel but did not") from None
        listener.close()
        if took == 0:
            bulk.enabled = False  # not offered again: this helper cannot reach it
            return None
        if header.get("ok") is False:  # refused before reading anything: still in step
            raise SandboxError(f"sandbox {self.name}: {str(header.get('error'))[:300]}")
        raise self._violation(f"an unexpected answer to a side channel offer ({header!r:.200})")

    def _raw_send(self, data: bytes) -> None:
        try:
            self.transport.send(data)
        except (OSError, TransportClosed) as e:
            raise SandboxError(f"sandbox {self.name}: cannot reach the helper ({e})") from None

    def stream(
        self,
        msg: dict[str, Any],
        *,
        max_total: int,
        deadline_s: float,
        bulk: BulkOffer | None = None,
    ) -> StreamReply:
        """Send a request answered by data frames; iterate the returned reply for them.
        `bulk`: offer the helper a side channel for the frames (sandbox/bulk.py)."""
        listener = bulk.listen() if bulk is not None else None
        if listener is not None:
            msg = {**msg, "bulk": listener.name}
        self.lock.acquire()
        try:
            rid = self._send(msg, b"")
        except BaseException:
            if listener is not None:
                listener.close()
            self.lock.release()
            raise
        reply = StreamReply(self, rid, max_total, time.monotonic() + deadline_s)
        if listener is not None and bulk is not None:
            reply.offered = (bulk, listener)
        return reply


class StreamReply:
    """The data frames of one streamed answer, then its final header (`.final`).

    Holds the client's lock until the final header was read (or the reply was closed):
    the channel carries one request at a time. Bounded: every frame by CHUNK_MAX, the
    total by `max_total`, the whole by `deadline`, and each wait for data by STREAM_IDLE_S.
    """

    def __init__(self, client: HelperClient, rid: int, max_total: int, deadline: float) -> None:
        self.client = client
        self.rid = rid
        self.max_total = max_total
        self.deadline = deadline
        self.received = 0
        self.final: dict[str, Any] | None = None
        self._locked = True
        self.offered: tuple[BulkOffer, BulkListener] | None = None  # a side channel offer
        self.side: HelperClient | None = None  # the side channel the helper took

    def __iter__(self) -> Iterator[bytes]:
        while self.final is None:
            chunk = self._next()
            if chunk is not None:
                yield chunk

    def _next(self) -> bytes | None:
        c = self.client
        now = time.monotonic()
        if now > self.deadline:
            raise TimeoutError
        header, body = (self.side or c).read_message(
            min(self.deadline, now + STREAM_IDLE_S),
            max_payload=CHUNK_MAX,
            payload_deadline=min(self.deadline, now + STREAM_IDLE_S),
        )
        c._expect(header, self.rid)
        if "bulk" in header:
            self._take_side(header, body)
            return None
        if self.offered is not None:  # the helper answers here: it did not reach the side
            bulk, listener = self.offered
            self.offered = None
            listener.close()
            bulk.enabled = False
        if header.get("data"):
            self.received += len(body)
            if self.received > self.max_total:
                raise c._violation(f"more than {self.max_total} bytes in one answer")
            return body
        if body:
            raise c._violation("a final message with a payload")
        self.final = header
        self._release()
        return None

    def finish(self) -> dict[str, Any]:
        """Read to the end (discarding data nobody consumed); the final header."""
        while self.final is None:
            self._next()
        return self.final

    def _take_side(self, header: dict[str, Any], body: bytes) -> None:
        """The helper's {"bulk": 1}: the rest of the answer comes over the side channel."""
        c = self.client
        if self.offered is None or header.get("bulk") != 1 or body or len(header) != 2:
            raise c._violation(f"an unexpected side channel message ({header!r:.200})")
        _, listener = self.offered
        self.offered = None
        try:
            transport = listener.accept()
        except OSError:
            raise c._violation("it said it reached the side channel but did not") from None
        self.side = HelperClient(transport, c.name, max_header=c.max_header)

    def _release(self) -> None:
        if self.offered is not None:
            self.offered[1].close()
            self.offered = None
        if self.side is not None:
            self.side.transport.close()
        if self._locked:
            self._locked = False
            self.client.lock.release()

    def abandon(self) -> None:
        """Give up on the channel without reading on (the caller removes the sandbox)."""
        self._release()


CHUNK_END = (0).to_bytes(4, "big")
CHUNK_ABORT = (0xFFFFFFFF).to_bytes(4, "big")  # sandbox/_helper.py FORK_ABORT


class Upload:
    """A chunked payload in flight (sandbox/_helper.py ChunkedReader): `send` each chunk,
    then `end` (or `end(abort=True)`: the helper stops and answers an error)."""

    def __init__(self, client: HelperClient, rid: int, side: Transport | None = None) -> None:
        self.client = client
        self.rid = rid
        self.side = side  # the chunks go over the side channel the helper took (else stdin)
        self._locked = True

    def _put(self, data: bytes) -> None:
        if self.side is None:
            self.client._raw_send(data)
            return
        try:
            self.side.send(data)
        except (OSError, TransportClosed) as e:
            raise SandboxError(
                f"sandbox {self.client.name}: cannot reach the helper ({e})"
            ) from None

    def send(self, chunk: bytes) -> None:
        if not 0 < len(chunk) < 0xFFFFFFFF:
            raise ValueError(f"a chunk of {len(chunk)} bytes")
        self._put(len(chunk).to_bytes(4, "big"))
        self._put(chunk)

    def end(self, *, abort: bool = False, timeout: float) -> dict[str, Any]:
        """The terminator, then the helper's answer; TimeoutError past `timeout`."""
        c = self.client
        try:
            self._put(CHUNK_ABORT if abort else CHUNK_END)
            header, _ = c.read_message(time.monotonic() + timeout)
            c._expect(header, self.rid)
            return header
        finally:
            self.release()

    def release(self) -> None:
        """Give the channel back (after `end`, or when the sandbox is being removed)."""
        if self.side is not None:
            self.side.close()
        if self._locked:
            self._locked = False
            self.client.lock.release()


class SandboxExpiredSignal(Exception):
    """The helper reported that the sandbox's lifetime ran out."""
