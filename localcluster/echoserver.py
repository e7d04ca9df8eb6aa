"""A tiny HTTP server used as a pod's container in the cluster smoke tests.

GET /healthz is 200 while ready and 503 after POST /unready (POST /ready restores it);
GET / reports the pod name, pid and environment the harness gave the process.
"""
from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

STATE = {"ready": True}


class Handler(BaseHTTPRequestHandler):
    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._send(200 if STATE["ready"] else 503, STATE)
        else:
            self._send(200, {"pid": os.getpid(), "argv": sys.argv,
                             "env": {k: v for k, v in os.environ.items() if k.startswith(("POD_", "NODE_", "MY_"))}})

    def do_POST(self) -> None:
        STATE["ready"] = self.path == "/ready"
        self._send(200, STATE)

    def log_message(self, *args) -> None:
        pass


if __name__ == "__main__":
    host = os.environ.get("POD_IP", "127.0.0.1")
    port = int(sys.argv[1]) if len(sys.argv) > 1 else 8080
    ThreadingHTTPServer((host, port), Handler).serve_forever()
