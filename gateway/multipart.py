"""vLLM's audio routes (``/v1/audio/transcriptions``, ``/v1/audio/translations``): their
multipart/form-data bodies, read for what kvgate needs and rewritten for the pool.

The body is read as any proxied body (`server.max_body_bytes` bounds it; it is not parsed as
JSON). kvgate reads its form fields -- ``model`` (required, as OpenAI's API has it),
``stream`` and ``response_format`` -- and sends the parts on as they came, but for three:
``model`` becomes the pool's served name; a client's ``cache_salt`` is never passed (vLLM's
transcription request has no such field, so no salt is set either; with
``tenancy.client_salt: reject`` it is a 400, as elsewhere); a client's ``priority`` is
dropped where the tenant's tier decides it. A body that is not a form kvgate can read (no
boundary, no closing delimiter, a part without its name) and one without ``model`` are
OpenAI-shaped 400s. Only JSON answers are relayed (``response_format`` ``json`` or
``verbose_json``): the relay takes a 200 that is not JSON for a broken replica, so
``text``, ``srt`` and ``vtt`` are refused with a 400 rather than charged to the replica.
"""

from __future__ import annotations

import re

from gateway.asgi import Headers
from gateway.body import ClientPriorityMode, ClientSaltMode, ParsedBody, lax_bool
from gateway.errors import BadRequest

__all__ = ["FORM_KINDS", "FORM_ROUTES", "Form", "declared_form", "parse_form"]

FORM_ROUTES = {"/v1/audio/transcriptions": "transcription",
               "/v1/audio/translations": "translation"}
FORM_KINDS = frozenset(FORM_ROUTES.values())
# the `boundary` parameter itself: anchored at a parameter's start, so that another one whose
# name ends in "boundary" (`xboundary=...`) is not read as it; any length is taken here so
# that one past RFC 2046's 70 characters gets a 400 saying so, not "unclosed"
_BOUNDARY = re.compile(r'(?:^|;)\s*boundary\s*=\s*(?:"([^"]*)"|([^;\s"]*))', re.IGNORECASE)
_MAX_BOUNDARY = 70  # RFC 2046 5.1.1
# one parameter of a Content-Disposition, a quoted value read whole (a `;` or `name=` inside
# a quoted filename is the filename's, not a parameter: read as one, a part named
# `cache_salt` was taken for another and sent on)
_PARAM = re.compile(rb';\s*([^=;\s]+)\s*=\s*(?:"((?:[^"\\]|\\.)*)"|([^;\s]*))')
_JSON_FORMATS = frozenset({"json", "verbose_json"})
_READ = frozenset({"model", "stream", "response_format"})  # small fields kvgate reads


class Form:
    """A form body split into its parts: (name, the part's header bytes, its content)."""

    __slots__ = ("boundary", "content_type", "parts")

    def __init__(self, boundary: bytes, content_type: str,
                 parts: list[tuple[str, bytes, bytes]]) -> None:
        self.boundary, self.content_type, self.parts = boundary, content_type, parts

    def field(self, name: str) -> str | None:
        """The first text value of field `name` (None: absent or not UTF-8)."""
        for part, _, content in self.parts:
            if part == name:
                try:
                    return content.decode("utf-8")
                except UnicodeDecodeError:
                    return None
        return None

    def rewrite(self, served: str, client_salt: ClientSaltMode,
                client_priority: ClientPriorityMode) -> bytes:
        """The body sent upstream (the same boundary: the Content-Type passes as sent)."""
        out: list[bytes] = []
        for name, head, content in self.parts:
            if name == "cache_salt":
                if client_salt == "reject":
                    raise BadRequest("cache_salt is set by the gateway and must not be sent",
                                     param="cache_salt")
                continue
            if name == "priority" and client_priority == "drop":
                continue
            if name == "model":
                content = served.encode("utf-8")
            out += [b"--", self.boundary, b"\r\n", head, b"\r\n\r\n", content, b"\r\n"]
        out += [b"--", self.boundary, b"--\r\n"]
        return b"".join(out)


def declared_form(headers: Headers) -> Form:
    """A form not read yet: its Content-Type as sent (its boundary is case-sensitive; ""
    when none was sent), for `parse_form` once the body is in."""
    declared = ""
    for key, value in headers:
        if key == b"content-type":
            declared = value.decode("latin-1")
    return Form(b"", declared, [])


def parse_form(body: bytes, declared: str) -> tuple[Form, ParsedBody]:
    """The form and what the rest of the path reads of it (400 `BadRequest` when it is not a
    form kvgate can read, or names no model)."""
    if not declared.lower().lstrip().startswith("multipart/form-data"):
        raise BadRequest("This route takes a multipart/form-data body (an audio `file` and "
                         "its `model`), as OpenAI's audio API does.")
    found = _BOUNDARY.search(declared)
    if found is None:
        raise BadRequest("The multipart/form-data body has no boundary in its Content-Type.")
    boundary = (found.group(1) or found.group(2) or "").encode("latin-1")
    if not 0 < len(boundary) <= _MAX_BOUNDARY:
        raise BadRequest(f"The multipart/form-data boundary must be 1 to {_MAX_BOUNDARY} "
                         f"characters (RFC 2046); this one has {len(boundary)}.")
    form = Form(boundary, declared, _split(body, boundary))
    model = form.field("model")
    if model is None and any(name == "model" for name, _, _ in form.parts):
        raise BadRequest("`model` must be UTF-8 text.", param="model")
    if not model:
        raise BadRequest("`model` is required: send it as a form field beside the file.",
                         param="model")
    fmt = form.field("response_format")
    if fmt is not None and fmt not in _JSON_FORMATS:
        raise BadRequest(f"kvgate relays this route's JSON answers only: use response_format "
                         f"json or verbose_json (not `{fmt[:40]}`).", param="response_format")
    sent = form.field("stream")
    stream = False if sent is None else lax_bool(sent)
    if stream is None:
        raise BadRequest("`stream` must be a boolean.", param="stream")
    data = {name: form.field(name) for name in _READ if form.field(name) is not None}
    return form, ParsedBody(data, model, stream, 0, generates=True)


def _split(body: bytes, boundary: bytes) -> list[tuple[str, bytes, bytes]]:
    """The parts of a multipart body (RFC 7578): each its name, header bytes and content."""
    delimiter = b"--" + boundary
    end = body.find(b"\r\n" + delimiter + b"--")  # (the CRLF before it is the delimiter's)
    start = body.find(delimiter)
    if start < 0 or end < 0 or end < start:
        raise BadRequest("The multipart/form-data body is malformed: its boundary delimiters "
                         "are missing or unclosed.")
    chunks = body[start + len(delimiter):end].split(b"\r\n" + delimiter)
    parts = []
    for chunk in chunks:
        head, sep, content = chunk.removeprefix(b"\r\n").partition(b"\r\n\r\n")
        name = _part_name(head) if sep else None
        if name is None:
            raise BadRequest("The multipart/form-data body is malformed: a part has no "
                             "Content-Disposition name.")
        parts.append((name, head, content))
    if not parts:
        raise BadRequest("The multipart/form-data body has no parts.")
    return parts


def _part_name(head: bytes) -> str | None:
    for line in head.split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-disposition":
            for found in _PARAM.finditer(value):
                if found.group(1).lower() == b"name":
                    sent = found.group(2) if found.group(2) is not None else found.group(3)
                    return sent.decode("utf-8", "replace")
    return None
