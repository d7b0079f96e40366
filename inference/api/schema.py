"""OpenAPI schema generation of the REST API: drf-spectacular's AutoSchema plus the error answers.

drf-spectacular documents only the success answer of each operation, so a client (or schemathesis'
status-code conformance check) would meet 400, 401 and 404 answers the schema never mentions. They
are added here from what the operation has, not per view:

- 400 when the operation takes query parameters or a request body: DRF's ValidationError body,
  `{"<parameter or field>": ["<why>", ...]}` (or `{"detail": "..."}` for an unparsable body);
- 401 when the operation requires authentication (every one but those that allow anonymous access);
- 404 when the path names an object (`{id}`).
"""
from __future__ import annotations

from typing import Any

from drf_spectacular.openapi import AutoSchema

# Inline schemas: DRF's error bodies are free-form objects, the most a schema can promise about them.
VALIDATION_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "The parameters or fields at fault, each with its reasons "
    "(`detail` when the body itself could not be parsed).",
    "additionalProperties": {
        "oneOf": [{"type": "array", "items": {"type": "string"}}, {"type": "string"}, {"type": "object"}]
    },
}
DETAIL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"detail": {"type": "string"}},
    "required": ["detail"],
}


class PlatformAutoSchema(AutoSchema):
    """AutoSchema whose operations also document the 400, 401 and 404 answers they can give."""

    def get_operation(
        self, path: str, path_regex: str, path_prefix: str, method: str, registry: Any
    ) -> dict[str, Any] | None:
        """The operation as drf-spectacular builds it, with the error answers it lacks added."""
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        responses: dict[str, Any] = operation["responses"]
        locations = {parameter.get("in") for parameter in operation.get("parameters", [])}
        errors: dict[str, tuple[str, dict[str, Any]]] = {}
        if "query" in locations or "requestBody" in operation:
            errors["400"] = ("A query parameter or a field of the body is invalid.", VALIDATION_ERROR_SCHEMA)
        security = operation.get("security")
        if security and {} not in security:
            errors["401"] = ("Authentication credentials were not provided or are invalid.", DETAIL_SCHEMA)
        if "path" in locations:
            errors["404"] = ("No object with this id.", DETAIL_SCHEMA)
        for code, (description, schema) in errors.items():
            responses.setdefault(
                code, {"description": description, "content": {"application/json": {"schema": schema}}}
            )
        return operation
