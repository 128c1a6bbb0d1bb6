"""A real S3-compatible server on 127.0.0.1 for turboio's tests: moto's server (complete: multipart
uploads, If-Match on GET, 206 ranges), behind a WSGI layer that injects faults on request.

    python tests/support/s3_server.py [--port 0]

prints ``PORT <n>`` once it listens and serves until its standard input closes (so a test that
dies takes its server with it). Any access key is accepted unless one is required (below).

Control endpoints (plain HTTP, not S3):

- ``POST /__faults`` with a JSON object sets the faults (every field optional; the object replaces
  the previous one): ``slowdown_every`` N: every Nth GET is answered ``503 SlowDown``;
  ``error_every`` N: every Nth GET is ``500 InternalError``; ``truncate_every`` N: every Nth GET
  sends its headers and half its body, then drops the connection; ``delay_ms``: added to every
  request; ``require_key``: requests signed with another access key id get ``403
  InvalidAccessKeyId``; ``down``: every request is answered ``503`` forever.
- ``GET /__stats``: ``{"gets": n, "get_bytes": n, "puts": n, "requests": n}`` since the last
  ``POST /__faults`` (GET bodies as sent, counted by the layer).
"""

import argparse
import json
import logging
import sys
import threading
import time

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from werkzeug.serving import make_server

try:  # moto >= 5.2.5 keeps header names with underscores only with its own handler
    from moto.moto_server.threaded_moto_server import MotoRequestHandler
except ImportError:  # pragma: no cover
    MotoRequestHandler = None


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.set({})

    def set(self, faults):
        with self.lock:
            self.faults = dict(faults)
            self.gets = self.get_bytes = self.puts = self.requests = 0

    def stats(self):
        with self.lock:
            return {"gets": self.gets, "get_bytes": self.get_bytes, "puts": self.puts, "requests": self.requests}


def s3_error(start_response, status, code, message):
    body = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"
    start_response(status, [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
    return [body.encode()]


def with_faults(inner, state):
    def app(environ, start_response):
        path = environ.get("PATH_INFO", "")
        method = environ.get("REQUEST_METHOD", "")
        if path == "/__faults" and method == "POST":
            n = int(environ.get("CONTENT_LENGTH") or 0)
            state.set(json.loads(environ["wsgi.input"].read(n) or b"{}"))
            start_response("200 OK", [("Content-Type", "application/json")])
            return [b"{}"]
        if path == "/__stats":
            body = json.dumps(state.stats()).encode()
            start_response("200 OK", [("Content-Type", "application/json")])
            return [body]
        with state.lock:
            f = state.faults
            state.requests += 1
            if method == "GET":
                state.gets += 1
            if method == "PUT":
                state.puts += 1
            n = state.gets
        if f.get("delay_ms"):
            time.sleep(f["delay_ms"] / 1000)
        if f.get("down"):
            return s3_error(start_response, "503 Service Unavailable", "ServiceUnavailable", "down")
        key = f.get("require_key")
        if key and f"Credential={key}/" not in environ.get("HTTP_AUTHORIZATION", ""):
            return s3_error(
                start_response, "403 Forbidden", "InvalidAccessKeyId",
                "The AWS Access Key Id you provided does not exist in our records.",
            )
        is_get = method == "GET" and path.count("/") >= 2
        if is_get and f.get("slowdown_every") and n % f["slowdown_every"] == 0:
            return s3_error(start_response, "503 Slow Down", "SlowDown", "Please reduce your request rate.")
        if is_get and f.get("error_every") and n % f["error_every"] == 0:
            return s3_error(start_response, "500 Internal Server Error", "InternalError", "We encountered an internal error.")
        chunks = inner(environ, start_response)
        body = b"".join(chunks)
        if hasattr(chunks, "close"):
            chunks.close()
        if is_get:
            with state.lock:
                state.get_bytes += len(body)
        if is_get and f.get("truncate_every") and n % f["truncate_every"] == 0 and len(body) > 1:

            def cut():
                yield body[: len(body) // 2]
                raise ConnectionAbortedError("turboio test server: body cut short on purpose")

            return cut()
        return [body]

    return app


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    state = State()
    app = with_faults(DomainDispatcherApplication(create_backend_app), state)
    kwargs = {"threaded": True}
    if MotoRequestHandler is not None:
        kwargs["request_handler"] = MotoRequestHandler
    server = make_server("127.0.0.1", args.port, app, **kwargs)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    print(f"PORT {server.server_port}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.shutdown()


if __name__ == "__main__":
    main()
