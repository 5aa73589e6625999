"""An LLM judge stand-in on loopback: an OpenAI-compatible ``/v1/chat/completions`` endpoint that answers
verifiers' reference judge (``verifiers.v1.judges.ReferenceJudge``, whose prompt fences the task, the
reference answer and the response in that order) with "yes" when the response's first integer is the
reference, else "no". What a real judge model would say of a sums task, without a model: the tests and
``benchmarks/verifiers_task.py --judge`` call it through verifiers' own judge client.

``mode``: "judge" (the verdict), "approve" ("yes" to everything), "hang" (no answer for ``hang_s``),
"nonsense" (neither label).
``delay_s``: each answer's latency (a hosted judge's is about a second). ``calls``: every request's
Authorization header and body, in order; ``most_in_flight``: the most requests answered at once.
"""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_INTEGER = re.compile(r"-?\d+")


def verdict(prompt: str) -> str:
    """ "yes" when the response block's first integer is the reference block's text, else "no"."""
    blocks = prompt.split("```")  # [intro, task, between, reference, between, response, closing]
    reference, response = blocks[3].strip(), blocks[5].strip()
    got = _INTEGER.search(response)
    return "yes" if got is not None and got.group() == reference else "no"


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a hung answer never holds the close
    request_queue_size = 1024  # a learner's burst of calls is queued, not refused (the default is 5)


class LoopbackJudge:
    """The endpoint, served from a thread of this process until :meth:`close` (a context manager)."""

    def __init__(self, mode: str = "judge", hang_s: float = 30.0, delay_s: float = 0.0) -> None:
        self.mode, self.hang_s, self.delay_s = mode, hang_s, delay_s
        self.calls: list[dict[str, Any]] = []
        self.in_flight = self.most_in_flight = 0
        self._lock = threading.Lock()
        judge = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with judge._lock:
                    judge.calls.append({"auth": self.headers.get("Authorization"), "body": body})
                    judge.in_flight += 1
                    judge.most_in_flight = max(judge.most_in_flight, judge.in_flight)
                try:
                    time.sleep(judge.hang_s if judge.mode == "hang" else judge.delay_s)
                    if judge.mode != "hang":
                        self._answer(body)
                finally:
                    with judge._lock:
                        judge.in_flight -= 1

            def _answer(self, body: dict[str, Any]) -> None:
                said = {"nonsense": "perhaps", "approve": "yes"}.get(judge.mode)
                said = said or verdict(body["messages"][-1]["content"])
                reply = {
                    "id": "c", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": said}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }  # fmt: skip
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = _Server(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, name="loopback-judge", daemon=True).start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> LoopbackJudge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
