"""Request bodies off the wire: JSON for generations, multipart for edits, as typed fields plus uploads.

Every failure is a 400 :class:`APIError` naming the field (pydantic's first error, starlette's
multipart limits, a file where text belongs and the reverse).
"""

from __future__ import annotations

import difflib
import json

from fastapi import Request
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from ditq.serve.errors import APIError, bad_field
from ditq.serve.schemas import ImageRequest
from ditq.serve.validation import Upload

__all__ = ["parse_form", "parse_json"]

_IMAGE_FIELDS = ("image", "image[]")
_MASK_FIELDS = ("mask", "mask[]")


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


async def parse_json(request: Request) -> ImageRequest:
    try:
        payload = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_field("body", f"not valid JSON ({error})") from None
    if not isinstance(payload, dict):
        raise bad_field("body", "expected a JSON object")
    try:
        return ImageRequest.model_validate(payload)
    except ValidationError as error:
        raise _validation_error(error) from None


async def parse_form(request: Request, max_images: int) -> tuple[ImageRequest, list[Upload]]:
    """Multipart form -> typed fields plus the uploaded images ('image' and 'image[]', in order)."""
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_field("body", "/v1/images/edits takes multipart/form-data")
    try:
        form = await request.form(max_files=max_images + 2, max_fields=64)
    except (HTTPException, MultiPartException) as error:  # starlette's limits, or a malformed body
        message = error.detail if isinstance(error, HTTPException) else error.message
        too_many_files = "files" in str(message).lower()
        raise bad_field("image" if too_many_files else "body", str(message)) from None
    fields: dict[str, str] = {}
    uploads: list[Upload] = []
    for key, value in form.multi_items():
        if isinstance(value, UploadFile):
            if key in _MASK_FIELDS:
                raise bad_field(
                    "mask",
                    "the served pipeline takes no mask (inpainting is not supported)",
                    code="unsupported_parameter",
                )
            if key not in _IMAGE_FIELDS:
                raise bad_field(key, "unexpected file; images go in 'image' or 'image[]'")
            uploads.append(Upload(key, value.filename or "", await value.read()))
        elif key in _IMAGE_FIELDS or key in _MASK_FIELDS:
            raise bad_field(key, "must be a file upload, not a text field")
        elif key in fields:
            raise bad_field(key, "given more than once")
        else:
            fields[key] = value
    await form.close()
    try:
        return ImageRequest.model_validate(fields), uploads
    except ValidationError as error:
        raise _validation_error(error) from None
