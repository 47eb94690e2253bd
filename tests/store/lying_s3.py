"""An S3-compatible server that lies: an HTTP proxy in front of the session's real moto server
that, per ``mode``, ignores ``Range`` (answers 200 with the whole object), serves another
range of the same length (the object's first bytes), drops ``If-None-Match`` (a conditional
write replaces the key), lists keys outside
the prefix asked for, hands out continuation tokens that loop (A, B, A, B, ...: never the
same twice in a row, which botocore's own check misses), or redirects every request to
itself. Every other request passes through unchanged."""

from __future__ import annotations

import http.client
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlencode, urlsplit


class LyingS3:
    """``mode``: "honest", "ignores-range", "shifts-range", "ignores-if-none-match",
    "lists-outside-prefix" (adds ``foreign_key``, a
    whole key of the bucket), "loops-tokens" (``pages`` counts the listings it looped) or
    "redirects" (307 to the same URL; ``redirects`` counts them)."""

    def __init__(self, upstream_port: int, *, foreign_key: str = "other-run/v00000009/x") -> None:
        self.mode = "honest"
        self.foreign_key = foreign_key
        self.pages = 0
        self.redirects = 0
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
                elif listing and proxy.mode == "lists-outside-prefix":
                    extra = (
                        b"<Contents><Key>"
                        + proxy.foreign_key.encode()
                        + b"</Key><Size>1</Size><StorageClass>STANDARD</StorageClass></Contents>"
                    )
                    data = re.sub(rb"(</ListBucketResult>)", extra + rb"\1", data)
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
