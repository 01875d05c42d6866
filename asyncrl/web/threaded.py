"""JSON over the standard library's threaded HTTP server, which `asyncrl serve` and the agent
gateway (`asyncrl.gateway`) run on: a request's JSON body read within a bound, a reply as JSON,
text or server-sent events, errors (`ApiError`) in OpenAI's shape under /v1 and SGLang's
elsewhere. A subclass says what a path does (`route`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler
from typing import Any

log = logging.getLogger(__name__)

Body = dict[str, Any]
"""A request's JSON object."""

MAX_BODY_BYTES = 32 << 20
"""The largest request body read: a batch of long prompts fits many times over (weights never
travel in a body), and parsing one costs a few hundred MB at most."""


class ApiError(Exception):
    """A request the server refuses: HTTP 400 (or `status`); `param` names the offending key."""

    def __init__(
        self, message: str, param: str | None = None, status: HTTPStatus = HTTPStatus.BAD_REQUEST
    ) -> None:
        super().__init__(message)
        self.param = param
        self.status = status


class Stream:
    """A reply sent as server-sent events, one `data:` line per chunk; made in full before the
    headers go out, so that a failure still answers with an error status."""

    def __init__(self, chunks: Iterator[dict[str, Any]]) -> None:
        self.chunks = list(chunks)


class JsonHandler(BaseHTTPRequestHandler):
    """Dispatches GET and POST to `route`: its return value is the reply (an object as JSON, a
    str as text, None as an empty 200, a `Stream` as SSE); an `ApiError` is answered with its
    status, a ValueError with a 400, anything else with a 500 (logged, the server goes on)."""

    def route(self, path: str, body: Body) -> Any:
        raise NotImplementedError

    def do_GET(self) -> None:
        self._dispatch()

    def do_POST(self) -> None:
        self._dispatch()

    def _dispatch(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        openai = "/v1/" in path
        try:
            self._reply(HTTPStatus.OK, self.route(path, self._body()))
        except ApiError as exc:
            self._reply(exc.status, error_body(str(exc), exc.status, exc.param, openai))
        except ValueError as exc:  # JSON that does not parse, a value the engine refuses
            self._reply(HTTPStatus.BAD_REQUEST, error_body(str(exc), 400, None, openai))
        except Exception as exc:  # a bug must answer 500, never take the server down
            log.exception("%s failed", path)
            self._reply(HTTPStatus.INTERNAL_SERVER_ERROR, error_body(repr(exc), 500, None, openai))

    def _body(self) -> Body:
        """The request's JSON object (`{}` without a body), read only when its length is below
        `MAX_BODY_BYTES`: a larger one is refused unread."""
        header = self.headers.get("Content-Length") or "0"
        if not header.isdecimal():  # no sign, no spaces
            raise ApiError(f"Content-Length {header!r} is not a byte count", "Content-Length")
        length = int(header)
        if length > MAX_BODY_BYTES:
            raise ApiError(
                f"the request body ({length} bytes) is over {MAX_BODY_BYTES} bytes",
                "Content-Length",
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
            )
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw.strip() else {}
        except RecursionError:
            raise ApiError("the request body nests too deeply") from None
        if not isinstance(body, dict):
            raise ApiError("the request body must be a JSON object")
        return body

    def _reply(self, status: HTTPStatus, obj: Any) -> None:
        if isinstance(obj, Stream):
            self._stream(obj)
            return
        if obj is None:
            data, kind = b"", "text/plain"
        elif isinstance(obj, str):
            data, kind = obj.encode(), "text/plain"
        else:
            data, kind = json.dumps(obj).encode(), "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, stream: Stream) -> None:
        """Server-sent events as SGLang writes them; the body ends when the connection closes
        (HTTP/1.0), after `data: [DONE]`."""
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        for chunk in stream.chunks:
            self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


def error_body(message: str, code: int, param: str | None, openai: bool) -> dict[str, Any]:
    """OpenAI's error body under /v1, else SGLang's (its `ErrorResponse`)."""
    kind = (
        "not_found_error"
        if code == 404
        else "authentication_error"
        if code == 401
        else "invalid_request_error"
        if code < 500
        else "server_error"
    )
    if openai:
        return {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return {
        "object": "error",
        "message": message,
        "type": "BadRequest" if code == 400 else HTTPStatus(code).phrase.replace(" ", ""),
        "param": param,
        "code": code,
    }
