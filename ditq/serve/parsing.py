"""Request bodies off the wire: JSON for generations, multipart for edits, as typed fields plus uploads.

Every failure is a 4xx :class:`APIError`: 415 for another content type, 400 naming the field otherwise
(pydantic's first error, strict for JSON, whose values carry their types; a form's booleans are 'true' or
'false'; JSON that Python will not read: an integer of more than 4300 digits, nesting
deeper than the interpreter's recursion limit; starlette's multipart limits, a multipart body that ends
before its closing boundary, a file where text belongs and the reverse; a field the endpoint does not take or
the server refuses, by :mod:`ditq.serve.request_fields`). A JSON null is an omitted field, as OpenAI reads it.
"""

from __future__ import annotations

import difflib

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from ditq.jsonfile import JsonRefused, loads
from ditq.serve.errors import APIError, bad_field, unsupported_media_type
from ditq.serve.intake import Upload
from ditq.serve.request_fields import REQUEST_FIELDS, check_fields, refusal
from ditq.serve.schemas import ImageRequest

__all__ = ["parse_form", "parse_json"]

_INT_DIGITS = 4300  # Python's own limit; below it the schema names the field an oversized integer came in
_BOOLEAN_FIELDS = frozenset(
    name for name, field in ImageRequest.model_fields.items() if field.annotation is bool
)


def _validation_error(error: ValidationError) -> APIError:
    """The first pydantic error as a 400 naming its field."""
    first = error.errors()[0]
    param = ".".join(str(part) for part in first["loc"]) or "body"
    if first["type"] == "extra_forbidden":
        known = list(ImageRequest.model_fields)
        close = difflib.get_close_matches(param, known, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        return bad_field(param, f"unknown field{hint}", code="unknown_parameter")
    if first["type"] == "missing":
        return bad_field(param, "is required", code="missing_parameter")
    return bad_field(param, first["msg"])


def _media_type(request: Request) -> str:
    return request.headers.get("content-type", "").split(";", 1)[0].strip().lower()


async def parse_json(request: Request) -> ImageRequest:
    """A JSON body sent as application/json: a browser's cross-site form cannot send that type without
    asking first (CORS), so text/plain JSON is refused."""
    if _media_type(request) != "application/json":
        raise unsupported_media_type("application/json", request.headers.get("content-type", ""))
    try:
        payload = loads(await request.body(), max_int_digits=_INT_DIGITS)
    except JsonRefused as error:  # not JSON, nested too deep, an integer too long, a key twice
        raise bad_field("body", str(error)[:200]) from None
    if not isinstance(payload, dict):
        raise bad_field("body", "expected a JSON object")
    given = {name: value for name, value in payload.items() if value is not None}
    try:  # strict: JSON has its own types, so true is no 1, "2" no 2, 1e18 no integer, "yes" no boolean
        body = ImageRequest.model_validate(given, strict=True)
    except ValidationError as error:
        raise _validation_error(error) from None
    check_fields(body, "generations")
    return body


class _EndCheckingParser(MultiPartParser):
    """Starlette's parser, noting whether the closing boundary arrived (python-multipart's ``on_end``): a body
    cut short parses without error and silently loses the parts after the cut."""

    complete = False

    def on_end(self) -> None:
        self.complete = True


async def parse_form(request: Request, max_images: int) -> tuple[ImageRequest, list[Upload]]:
    """Multipart form -> typed fields plus the uploaded images ('image' and 'image[]', in order).

    Files over 1 MiB are spooled to disk while the body streams in (starlette), so a slow body holds little
    memory; the images are read back as bytes once the whole form is there.
    """
    if _media_type(request) != "multipart/form-data":
        raise unsupported_media_type("multipart/form-data", request.headers.get("content-type", ""))
    parser = _EndCheckingParser(request.headers, request.stream(), max_files=max_images + 2, max_fields=64)
    try:
        form = await parser.parse()
    except MultiPartException as error:  # starlette's limits, or a malformed body
        if "files" in error.message.lower():  # its limit is ours plus room for a mask to be named; say ours
            raise bad_field(
                "image",
                f"more than {max_images + 2} files given, the served pipeline takes at most {max_images}",
            ) from None
        raise bad_field("body", error.message) from None
    if not parser.complete:
        await form.close()
        raise bad_field("body", "the multipart body ends before its closing boundary (truncated)")
    fields: dict[str, str] = {}
    uploads: list[Upload] = []
    for key, value in form.multi_items():
        name = key.partition("[")[0]  # 'image[]' is 'image'; 'svg[model]' is part of 'svg'
        field = REQUEST_FIELDS.get(name)
        if field is not None and field.treatment == "refused" and name != key:
            raise refusal(name)
        if isinstance(value, UploadFile):
            if field is None or not field.upload:
                raise bad_field(key, "unexpected file; images go in 'image' or 'image[]'")
            if field.treatment == "refused":
                raise refusal(name)
            uploads.append(Upload(key, value.filename or "", await value.read()))
        elif field is not None and field.upload:
            raise bad_field(key, "must be a file upload, not a text field")
        elif key in fields:
            raise bad_field(key, "given more than once")
        else:
            fields[key] = value
    await form.close()
    for name, value in fields.items():  # a form's boolean is text: only the words JSON and HTTP clients write
        if name in _BOOLEAN_FIELDS and value.strip().lower() not in ("true", "false"):
            raise bad_field(name, f"expected 'true' or 'false', got '{value[:40]}'")
    values: dict[str, object] = dict(fields)
    if "lora" in fields:  # an object or a list in a form: its JSON text
        try:
            values["lora"] = loads(fields["lora"].encode(), max_int_digits=_INT_DIGITS)
        except JsonRefused as error:
            raise bad_field("lora", f"expected JSON text ({str(error)[:160]})") from None
    try:
        body = ImageRequest.model_validate(values)
    except ValidationError as error:
        raise _validation_error(error) from None
    check_fields(body, "edits")
    return body, uploads
