#!/usr/bin/env python3
"""Subscriber sink for the HA drill (Python 3.11 standard library only).

Answers every POST with 200 and appends one JSON line per request it received to
the record file: when, the Idempotency-Key and webhook-id headers, the attempt
number, and the drill's own delivery id read from the body (the gateway delivers
the original body, so the body is how a delivery is tied back to the webhook the
load generator sent).

Lines are flushed one by one, so report.py can read the file while the sink runs.

    sink.py --listen 127.0.0.1:18090 --out sink.jsonl
"""

import argparse
import json
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Recorder:
    def __init__(self, path):
        self._f = open(path, "a", buffering=1, encoding="utf-8")
        self._lock = threading.Lock()
        self.count = 0

    def record(self, row):
        line = json.dumps(row, separators=(",", ":"))
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()
            self.count += 1


class SinkServer(ThreadingHTTPServer):
    daemon_threads = True
    # socketserver's default listen backlog is 5. When the gateway releases a backlog
    # after an outage it opens hundreds of connections at once; with a full accept
    # queue the kernel drops handshakes and the client's retransmissions (1, 2, 4,
    # 8 s ...) deliver requests 15 s late, after the gateway gave up on them: those
    # show up as duplicates caused by the sink, not by the gateway.
    request_queue_size = 1024


def make_handler(recorder):
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive, as a real subscriber would: the gateway reuses connections.
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            try:
                delivery_id = json.loads(body).get("delivery_id")
            except (ValueError, AttributeError):
                delivery_id = None
            recorder.record({
                "t": time.time(),
                "key": self.headers.get("Idempotency-Key"),
                "webhook_id": self.headers.get("webhook-id"),
                "attempt": self.headers.get("webhook-attempt"),
                "delivery_id": delivery_id,
            })
            self._answer(200, b"ok")

        def do_GET(self):
            # GET /count: how many requests were received (a liveness check).
            self._answer(200, str(recorder.count).encode())

        def _answer(self, status, payload):
            self.send_response(status)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, fmt, *args):  # one line per request would drown the log
            pass

    return Handler


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--listen", required=True, help="host:port")
    ap.add_argument("--out", required=True, help="JSON-lines record file")
    args = ap.parse_args()
    host, port = args.listen.rsplit(":", 1)

    server = SinkServer((host, int(port)), make_handler(Recorder(args.out)))
    # SIGTERM ends serve_forever from another thread (shutdown() blocks the caller).
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print(f"sink listening on {args.listen}, recording to {args.out}", file=sys.stderr, flush=True)
    server.serve_forever(poll_interval=0.2)


if __name__ == "__main__":
    main()
