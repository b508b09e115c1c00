"""A local HTTP server answering as the model hub does (``model_info`` and friends): a test points
huggingface_hub at it (``HF_ENDPOINT`` for a fresh interpreter, ``huggingface_hub.constants.ENDPOINT``
in-process) to exercise the real client against the hub's answers, with no network."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class HubHandler(http.server.BaseHTTPRequestHandler):
    """Answers every GET with ``status``; 404 carries the hub's ``X-Error-Code: RepoNotFound`` (what
    huggingface_hub turns into RepositoryNotFoundError)."""

    status = 404

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(self.status)
        if self.status == 404:
            self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "Repository not found"}')

    def log_message(self, *args: object) -> None:
        pass


@contextmanager
def fake_hub(status: int = 404) -> Iterator[tuple[str, type[HubHandler]]]:
    """Serve on a free local port; yields the endpoint URL and the handler class (set its ``status`` to
    change the answer while it runs)."""
    handler = type("Hub", (HubHandler,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()
