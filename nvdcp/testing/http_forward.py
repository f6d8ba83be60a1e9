"""A forwarding HTTP handler: the plumbing that nvdcp's test proxies share.

The proxies between an S3 client and a real server (:mod:`nvdcp.testing.corrupting_proxy`,
which damages bytes in transit, and the fault proxy of tests/s3/s3_testkit.py, which answers
with errors, resets and cut bodies) each decide what to do with a request; reading the request
body (plain or chunked), sending it upstream on a connection kept per handler thread, and writing
an answer are the same for both and live here.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

#: Hop-by-hop headers: they describe one connection, so a proxy neither forwards nor returns them.
HOP_HEADERS = frozenset({"connection", "keep-alive", "transfer-encoding", "expect", "proxy-connection", "upgrade", "te"})

#: An upstream answer: status, headers (hop-by-hop and Content-Length removed), body, and the
#: Content-Length it stated (a HEAD answer states the object's size with no body).
Answer = tuple[int, list[tuple[str, str]], bytes, int | None]


class ForwardingHandler(BaseHTTPRequestHandler):
    """Every method goes to :meth:`handle_request`, which subclasses define; :meth:`read_body`,
    :meth:`forward` and :meth:`reply` do the HTTP work. Quiet (no request log)."""

    protocol_version = "HTTP/1.1"
    _local = threading.local()  # one upstream connection per handler thread

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.handle_request()

    do_PUT = do_POST = do_DELETE = do_HEAD = do_GET

    def handle_request(self) -> None:
        raise NotImplementedError

    def read_body(self) -> bytes:
        """The request's body, de-chunked when it came with ``Transfer-Encoding: chunked``."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def forward(self, host: str, port: int, body: bytes, timeout: float = 60.0) -> Answer:
        """Send this request (method, path, end-to-end headers, ``body``) to ``host:port`` and read
        the whole answer. A failed exchange drops the thread's connection and raises ``OSError``
        or ``http.client.HTTPException``."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(host, port, timeout=timeout)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
        headers["Content-Length"] = str(len(body))
        try:
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            self._local.conn = None
            raise
        length = resp.getheader("Content-Length")
        out = [(k, v) for k, v in resp.getheaders() if k.lower() not in HOP_HEADERS | {"content-length"}]
        return resp.status, out, data, int(length) if length is not None else None

    def reply(self, status: int, headers: list[tuple[str, str]], data: bytes, length: int | None = None) -> None:
        """Answer with ``data`` (no body for HEAD); ``length``: the Content-Length to state when
        it is not ``len(data)`` (a HEAD answer's object size, or a body to be cut short)."""
        self.send_response(status)
        for k, v in headers:
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data) if length is None else length))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        self.wfile.flush()


__all__ = ["HOP_HEADERS", "Answer", "ForwardingHandler"]
