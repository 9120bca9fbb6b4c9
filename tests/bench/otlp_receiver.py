"""An OTLP/HTTP traces receiver for the tracing benchmark, in a process of its own.

Answers every ``POST /v1/traces`` as a collector does (200, an empty
``ExportTraceServiceResponse``) and counts the spans it received; ``GET
/count`` returns ``{"spans": N}``, and ``GET /spans`` the first
``KEPT_SPANS`` spans (name, trace id, span id, parent span id, hex). Run by
``tests/bench/tracing.py`` and ``tests/test_tracing_otlp.py``; not alone.
"""

from __future__ import annotations

import argparse
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

KEPT_SPANS = 1000
_lock = threading.Lock()
_spans = 0
_kept: list[dict[str, str]] = []


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        global _spans
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        request = ExportTraceServiceRequest.FromString(body)
        spans = [
            span
            for resource in request.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
        with _lock:
            _spans += len(spans)
            _kept.extend(
                {
                    "name": span.name,
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                }
                for span in spans[: max(0, KEPT_SPANS - len(_kept))]
            )
        answer = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def do_GET(self) -> None:
        with _lock:
            shown: object = list(_kept) if self.path == "/spans" else {"spans": _spans}
        answer = json.dumps(shown).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *_: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Receiver).serve_forever()


if __name__ == "__main__":
    main()
