"""The request fields' table against what it must match: the docs' table, the schema, and the fields the
official `openai` client sends to each endpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types import image_edit_params, image_generate_params

from ditq.serve.metrics import ServerMetrics
from ditq.serve.request_fields import ENDPOINTS, REQUEST_FIELDS, Endpoint
from ditq.serve.schemas import ImageRequest

DOC = Path(__file__).parents[2] / "docs" / "openai-api.md"
HEADER = ("field", "from", "generations", "edits", "treatment", "how, or why")

# The fields the client's typed parameters name, per endpoint ('stream' is in the streaming variants only).
CLIENT_FIELDS: dict[Endpoint, set[str]] = {
    "generations": {*image_generate_params.ImageGenerateParamsBase.__annotations__, "stream"},
    "edits": {*image_edit_params.ImageEditParamsBase.__annotations__, "stream"},
}


def code_rows() -> list[tuple[str, ...]]:
    return [
        (
            f"`{field.name}`",
            field.origin,
            *("yes" if endpoint in field.endpoints else "no" for endpoint in ENDPOINTS),
            field.treatment,
            field.how,
        )
        for field in REQUEST_FIELDS.values()
    ]


def doc_rows() -> list[tuple[str, ...]]:
    """The rows of the table whose header is HEADER (a cell holds no '|')."""
    rows: list[tuple[str, ...]] = []
    inside = False
    for line in DOC.read_text().splitlines():
        cells = tuple(cell.strip() for cell in line.strip().strip("|").split("|"))
        if not line.startswith("|"):
            inside = False
        elif cells == HEADER:
            inside = True
        elif inside and set(line) - set("|- "):
            rows.append(cells)
    return rows


def test_the_docs_table_is_the_code_table() -> None:
    expected = "\n".join("| " + " | ".join(row) + " |" for row in code_rows())
    assert doc_rows() == code_rows(), (
        f"{DOC.name}'s table differs from REQUEST_FIELDS; it should read:\n{expected}"
    )


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_every_field_the_openai_client_sends_is_in_the_table(endpoint: Endpoint) -> None:
    openai_fields = {
        name
        for name, field in REQUEST_FIELDS.items()
        if field.origin == "OpenAI" and endpoint in field.endpoints
    }
    assert openai_fields == CLIENT_FIELDS[endpoint]


def test_the_schema_holds_every_field_but_the_uploads() -> None:
    assert set(ImageRequest.model_fields) == {n for n, f in REQUEST_FIELDS.items() if not f.upload}


def test_a_metrics_label_outside_the_table_is_refused() -> None:
    metrics = ServerMetrics()
    metrics.count_ignored(["quality", "quality", "user"])
    with pytest.raises(ValueError, match="fixed set"):
        metrics.count_ignored(['x"} 1\nforged'])
    lines = [line for line in metrics.render().splitlines() if line.startswith("ditq_ignored_fields_total")]
    assert lines == [
        'ditq_ignored_fields_total{field="quality"} 2',
        'ditq_ignored_fields_total{field="user"} 1',
    ]
