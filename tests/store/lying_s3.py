"""An S3-compatible server that lies: an HTTP proxy in front of the session's real moto server
that, per ``mode``, ignores ``Range`` (answers 200 with the whole object), serves another
range of the same length (the object's first bytes), drops ``If-None-Match`` (a conditional
write replaces the key), lists keys outside
the prefix asked for, hands out continuation tokens that loop (A, B, A, B, ...: never the
same twice in a row, which botocore's own check misses), redirects every request to
itself, cuts the body of the next error reply short (the connection closes after half of
the announced Content-Length, then a reset), flips a byte of a GET's body, or lists
multipart uploads without their ids. Every other request passes through unchanged."""

from __future__ import annotations

import http.client
import io
import re
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlsplit


class LyingS3:
    """``mode``: "honest", "ignores-range", "shifts-range", "ignores-if-none-match",
    "lists-outside-prefix" (adds ``foreign_key``, a
    whole key of the bucket), "loops-tokens" (``pages`` counts the listings it looped),
    "redirects" (307 to the same URL; ``redirects`` counts them) or "cuts-error-body-once"
    (the next reply of status 400 or more sends half its body, then the connection is reset;
    the mode then returns to "honest"; ``cut`` counts them) or "stalls-error-body-once" (the
    same, with ``stall_s`` seconds between the half body and the reset), "flips-body-once" (the
    next GET answered 200 has its first byte flipped, the length intact, then "honest") or
    "flips-body" (every one; ``flipped`` counts them), "drops-upload-ids" (a listing of
    multipart uploads whose entries have no ``UploadId``)."""

    def __init__(self, upstream_port: int, *, foreign_key: str = "other-run/v00000009/x") -> None:
        self.mode = "honest"
        self.foreign_key = foreign_key
        self.pages = 0
        self.redirects = 0
        self.cut = 0
        self.flipped = 0
        self.stall_s = 1.0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                if proxy.mode == "redirects":
                    proxy.redirects += 1
                    self.rfile.read(int(self.headers.get("Content-Length") or 0))
                    self.send_response(307)
                    self.send_header("Location", f"{proxy.endpoint}{self.path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                parts = urlsplit(self.path)
                query = parse_qs(parts.query, keep_blank_values=True)
                listing = self.command == "GET" and query.get("list-type") == ["2"]
                token = (query.get("continuation-token") or [""])[0]
                headers = {k: v for k, v in self.headers.items()}
                if proxy.mode == "ignores-range":
                    headers.pop("Range", None)
                if proxy.mode == "ignores-if-none-match":
                    headers.pop("If-None-Match", None)
                if proxy.mode == "shifts-range" and "Range" in headers:
                    first, last = map(int, headers["Range"].removeprefix("bytes=").split("-"))
                    headers["Range"] = f"bytes=0-{last - first}"
                if listing and proxy.mode == "loops-tokens":
                    query.pop("continuation-token", None)
                path = parts.path + ("?" + urlencode(query, doseq=True) if query else "")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=30)
                conn.request(self.command, path, body=body or None, headers=headers)
                response = conn.getresponse()
                data = response.read()
                conn.close()
                if listing and proxy.mode == "loops-tokens":
                    proxy.pages += 1
                    nxt = b"B" if token == "A" else b"A"
                    data = data.replace(b"<IsTruncated>false</IsTruncated>", b"")
                    data = data.replace(
                        b"</ListBucketResult>",
                        b"<IsTruncated>true</IsTruncated><NextContinuationToken>"
                        + nxt
                        + b"</NextContinuationToken></ListBucketResult>",
                    )
                elif proxy.mode == "drops-upload-ids" and "uploads" in query:
                    data = re.sub(rb"<UploadId>[^<]*</UploadId>", b"", data)
                elif listing and proxy.mode == "lists-outside-prefix":
                    extra = (
                        b"<Contents><Key>"
                        + proxy.foreign_key.encode()
                        + b"</Key><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>"
                    )
                    data = re.sub(rb"(</ListBucketResult>)", extra + rb"\1", data)
                if (
                    proxy.mode in ("flips-body-once", "flips-body")
                    and self.command == "GET"
                    and response.status == 200
                    and data
                ):
                    proxy.flipped += 1
                    if proxy.mode == "flips-body-once":
                        proxy.mode = "honest"
                    data = bytes([data[0] ^ 0x40]) + data[1:]  # the length intact
                if (
                    proxy.mode in ("cuts-error-body-once", "stalls-error-body-once")
                    and response.status >= 400
                    and self.command != "HEAD"
                    and len(data) > 1
                ):
                    stall = proxy.mode == "stalls-error-body-once"
                    proxy.mode = "honest"
                    proxy.cut += 1
                    self.send_response(response.status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    if stall:
                        time.sleep(proxy.stall_s)
                    # a reset, not a clean close: the client's read of the rest fails
                    self.connection.setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                    self.connection.close()
                    self.close_connection = True
                    self.wfile = io.BytesIO()  # what the handler writes after goes nowhere
                    return
                self.send_response(response.status)
                for name, value in response.getheaders():
                    if name.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(name, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
