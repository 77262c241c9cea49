"""Why bytes are not HTTP/1.1, in the 400 the HTTP guard answers (`gateway.httpguard`).

The 400 said "The request is not valid HTTP/1.1." whatever was wrong: a client written by
hand (a shell script's `printf`, a test harness, an embedded HTTP stack) was left to guess
between a bare LF, a duplicated `Content-Length` and a space in its path. The parser's own
reason (llhttp's fixed text, never the client's bytes) is named, in words for the cases such
clients meet most.
"""

from __future__ import annotations

__all__ = ["not_http_message"]

BASE = "The request is not valid HTTP/1.1"

# llhttp's reasons, where its words would not tell a client what to change
_PLAIN = {
    "Invalid method encountered": "the request line does not start with a method (bytes "
    "after a body longer than its Content-Length read as a next request, or TLS spoken to "
    "this plain-HTTP port)",
    "Expected HTTP/, RTSP/ or ICE/": "the request line is not METHOD PATH HTTP/1.1 (a space "
    "in the path must be sent as %20)",
    "Duplicate Content-Length": "Content-Length is given more than once",
    "Unexpected whitespace after header value": "a header line is continued on the next line "
    "(obsolete line folding)",
}


def not_http_message(reason: str) -> str:
    """The 400's message for the parser's error `reason` (empty: none given)."""
    if not reason:
        return f"{BASE}."
    if "CR" in reason:  # a line ended in a bare LF: the usual hand-written mistake
        return f"{BASE}: HTTP/1.1 lines end in CRLF (\\r\\n), not a bare LF ({reason})."
    return f"{BASE}: {_PLAIN.get(reason, reason)}."
