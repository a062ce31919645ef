"""25 JSON schemas for the structured-output tests: nested objects, bounded arrays, enums,
patterns, anyOf, required and optional keys, numbers with ranges. Strings, arrays and numbers are
bounded so a small model's output always completes within the tests' token budget."""

from __future__ import annotations

from typing import Any

S = {"type": "string", "maxLength": 12}

SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": S}, "required": ["name"], "additionalProperties": False},
    {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["age"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": S}, "required": ["ok"],
     "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -10, "maximum": 10},
        "y": {"type": "integer", "minimum": -10, "maximum": 10}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999},
                                                       {"type": "string", "pattern": "^[a-z]{3}$"}]}},
     "required": ["id"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9}, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {
        "name": S, "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
        "required": ["name", "email"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"a": S, "b": S, "c": S}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"],
     "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"},
                                         "qty": {"type": "integer", "minimum": 1, "maximum": 5}},
        "required": ["sku", "qty"], "additionalProperties": False}}},
     "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"temp": {"type": "number", "minimum": -50, "maximum": 50},
                                      "unit": {"enum": ["C", "F"]}},
     "required": ["temp", "unit"], "additionalProperties": False},
    {"type": "object", "properties": {"answer": {"anyOf": [{"type": "boolean"}, {"type": "null"}]}},
     "required": ["answer"], "additionalProperties": False},
    {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
     "required": ["matrix"], "additionalProperties": False},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["date"], "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "event"}, "name": S}, "required": ["kind", "name"],
     "additionalProperties": False},
    {"type": "object", "properties": {"meta": {"type": "object", "properties": {
        "version": {"type": "integer", "minimum": 1, "maximum": 3},
        "inner": {"type": "object", "properties": {"flag": {"type": "boolean"}}, "required": ["flag"],
                  "additionalProperties": False}},
        "required": ["version", "inner"], "additionalProperties": False}},
     "required": ["meta"], "additionalProperties": False},
    {"type": "string", "enum": ["yes", "no"]},
    {"type": "object", "properties": {"ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10}},
     "required": ["ratio"], "additionalProperties": False},
    {"type": "object", "properties": {"names": {"type": "array", "items": {"enum": ["ann", "bob", "cy"]},
                                                "minItems": 1, "maxItems": 3}},
     "required": ["names"], "additionalProperties": False},
    {"type": "object", "properties": {"title": {"type": "string", "minLength": 2, "maxLength": 10},
                                      "pages": {"type": "integer", "minimum": 1, "maximum": 500}},
     "required": ["title", "pages"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["r"],
         "additionalProperties": False},
        {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 9},
                                          "h": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["w", "h"], "additionalProperties": False}]}},
     "required": ["shape"], "additionalProperties": False},
]

assert len(SCHEMAS) == 25
