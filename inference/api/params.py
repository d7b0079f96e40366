"""Query parameters of the REST API: parsed and validated in one place, for filters and pagination.

Every value a client puts in a query string reaches the database only after it was parsed here:

- NUL characters are refused everywhere: PostgreSQL text cannot hold them and psycopg raises
  `ValueError("A string literal cannot contain NUL (0x00) characters")` when the query runs, which
  Django does not turn into anything but a 500.
- Ids must fit a BigAutoField: a number past 64 bits passes `filter()` and fails only when the
  query runs (DataError on PostgreSQL, OverflowError on SQLite).
- Enum filters accept only their TextChoices values (a typo would otherwise answer an empty list
  that looks like "no such objects").
- `limit`/`offset` are strict integers within bounds: DRF's LimitOffsetPagination has no upper bound
  by default, so `?limit=53253501965985038336` reached PostgreSQL as a LIMIT it refuses.

A refusal is DRF's ValidationError, i.e. 400 `{"<parameter>": ["<why>"]}`. The same declarations
produce the OpenAPI parameters (types, enums, bounds) through the filter backend and the paginator,
so what the schema promises is exactly what is checked.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from django.db.models import QuerySet
from rest_framework.exceptions import ValidationError
from rest_framework.filters import BaseFilterBackend
from rest_framework.pagination import LimitOffsetPagination
from rest_framework.request import Request

# The top of a BigAutoField / PostgreSQL bigint (ids and offsets past it can match nothing).
MAX_BIGINT = 2**63 - 1
# Longest text a text filter takes: no column the API filters on is longer.
MAX_TEXT_LENGTH = 200


def refuse(name: str, message: str) -> ValidationError:
    """The 400 naming the parameter `name` (DRF renders `{"name": ["message"]}`)."""
    return ValidationError({name: [message]})


def clean_text(name: str, raw: str, *, max_length: int = MAX_TEXT_LENGTH) -> str:
    """`raw` if it is text PostgreSQL can store and no longer than `max_length`; else a 400."""
    if "\x00" in raw:
        raise refuse(name, "must not contain NUL (0x00) characters")
    if len(raw) > max_length:
        raise refuse(name, f"must be at most {max_length} characters long")
    return raw


def parse_int(name: str, raw: str, low: int, high: int) -> int:
    """`raw` as a decimal integer within [low, high]; else a 400 naming `name` and the range."""
    text = clean_text(name, raw)
    # int() alone would also accept "1_000", " 1" and non-ASCII digits; ids and counts are plain digits.
    digits = text[1:] if text[:1] in "+-" else text
    if not digits.isascii() or not digits.isdigit() or len(digits) > 20:
        raise refuse(name, f"must be an integer from {low} to {high}, got {raw!r}")
    number = int(text)
    if not low <= number <= high:
        raise refuse(name, f"must be an integer from {low} to {high}, got {raw!r}")
    return number


@dataclass(frozen=True)
class QueryParam:
    """A query parameter that filters a list: its name, the ORM lookup it feeds and its description."""

    name: str
    lookup: str
    description: str

    def parse(self, raw: str) -> Any:
        """The value to filter with, or a 400 (subclasses narrow what is accepted)."""
        return clean_text(self.name, raw)

    def schema(self) -> dict[str, Any]:
        """The parameter's OpenAPI schema object."""
        return {"type": "string", "maxLength": MAX_TEXT_LENGTH}

    def openapi(self) -> dict[str, Any]:
        """The parameter as an OpenAPI parameter object."""
        return {
            "name": self.name,
            "in": "query",
            "required": False,
            "description": self.description,
            "schema": self.schema(),
        }


@dataclass(frozen=True)
class IdParam(QueryParam):
    """An integer id (a foreign key's `<field>_id`): 1 to 2**63-1, as the database assigns them."""

    def parse(self, raw: str) -> int:
        """A positive 64-bit integer, else 400."""
        return parse_int(self.name, raw, 1, MAX_BIGINT)

    def schema(self) -> dict[str, Any]:
        """A positive int64."""
        return {"type": "integer", "format": "int64", "minimum": 1, "maximum": MAX_BIGINT}


@dataclass(frozen=True)
class ChoiceParam(QueryParam):
    """One of a TextChoices' values."""

    choices: Sequence[str] = field(default_factory=tuple)

    def parse(self, raw: str) -> str:
        """One of `choices`, else 400 listing them."""
        value = clean_text(self.name, raw)
        if value not in self.choices:
            raise refuse(self.name, f"must be one of {', '.join(self.choices)}, got {raw!r}")
        return value

    def schema(self) -> dict[str, Any]:
        """A string enum."""
        return {"type": "string", "enum": list(self.choices)}


class QueryParamFilterBackend(BaseFilterBackend):
    """Applies the view's `filter_params` (a sequence of QueryParam) that are present in the query.

    DRF runs filter backends for lists and for `get_object()`, and drf-spectacular asks them for the
    list operations' parameters, so declaring a filter once both validates it and documents it.
    """

    def filter_queryset(self, request: Request, queryset: QuerySet, view: Any) -> QuerySet:
        """Filter by every declared parameter that has a non-empty value; a bad value is a 400."""
        params: Sequence[QueryParam] = getattr(view, "filter_params", ())
        for param in params:
            raw = request.query_params.get(param.name)
            if raw in (None, ""):
                continue
            queryset = queryset.filter(**{param.lookup: param.parse(str(raw))})
        return queryset

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        """OpenAPI parameters of the view's `filter_params`."""
        return [param.openapi() for param in getattr(view, "filter_params", ())]


class StrictLimitOffsetPagination(LimitOffsetPagination):
    """`?limit=&offset=` pagination whose bad values are 400s instead of silent defaults or 500s.

    DRF's own class ignores an unparsable limit (answering the default page, so a typo goes
    unnoticed) and caps nothing unless `max_limit` is set; here `limit` is 1..MAX_LIMIT and
    `offset` 0..2**63-1, both documented in the schema.
    """

    # default_limit stays DRF's: settings.REST_FRAMEWORK["PAGE_SIZE"].
    max_limit = 1000

    def get_limit(self, request: Request) -> int:
        """`?limit=` within [1, max_limit], the default when absent; else 400."""
        raw = request.query_params.get(self.limit_query_param)
        if raw in (None, ""):
            return int(self.default_limit)
        return parse_int(self.limit_query_param, str(raw), 1, int(self.max_limit))

    def get_offset(self, request: Request) -> int:
        """`?offset=` within [0, 2**63-1], 0 when absent; else 400."""
        raw = request.query_params.get(self.offset_query_param)
        if raw in (None, ""):
            return 0
        return parse_int(self.offset_query_param, str(raw), 0, MAX_BIGINT)

    def get_schema_operation_parameters(self, view: Any) -> list[dict[str, Any]]:
        """DRF's parameters with the accepted ranges added."""
        bounds: Mapping[str, dict[str, int]] = {
            self.limit_query_param: {"minimum": 1, "maximum": int(self.max_limit)},
            self.offset_query_param: {"minimum": 0, "maximum": MAX_BIGINT},
        }
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            parameter["schema"] = {**parameter["schema"], "format": "int64", **bounds.get(parameter["name"], {})}
        return parameters
