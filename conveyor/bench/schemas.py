"""A battery of JSON schemas, each with a request that asks for it: the structured-outputs tests
and benchmark share it. Together they cover nested objects, arrays with min/max items, enums,
const, anyOf, $defs/$ref, string patterns, formats and lengths, integer and number ranges, and
required, optional and forbidden extra fields. Every string, array and number is bounded, so that
a complete answer always fits the benchmark's max_tokens."""

from __future__ import annotations

_NAME = {"type": "string", "minLength": 1, "maxLength": 40}

BATTERY: list[tuple[str, dict, str]] = [
    ("person", {
        "type": "object", "additionalProperties": False,
        "properties": {"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"]},
     "Describe a person with a name and an age."),
    ("optional_fields", {
        "type": "object",
        "properties": {"title": _NAME, "subtitle": _NAME, "pages": {"type": "integer",
                                                                   "minimum": 1, "maximum": 2000}},
        "required": ["title"]},
     "Describe a book: its title, and if you like its subtitle and page count."),
    ("enum", {
        "type": "object", "additionalProperties": False,
        "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                       "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]},
     "Classify the sentiment of: 'I loved this film.'"),
    ("array_bounds", {
        "type": "object", "additionalProperties": False,
        "properties": {"colours": {"type": "array", "items": _NAME, "minItems": 2,
                                   "maxItems": 4}},
        "required": ["colours"]},
     "List a few colours."),
    ("nested", {
        "type": "object", "additionalProperties": False,
        "properties": {"company": _NAME, "address": {
            "type": "object", "additionalProperties": False,
            "properties": {"street": _NAME, "city": _NAME,
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"]}},
        "required": ["company", "address"]},
     "Give a company and its postal address."),
    ("array_of_objects", {
        "type": "object", "additionalProperties": False,
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "additionalProperties": False,
            "properties": {"product": _NAME, "quantity": {"type": "integer", "minimum": 1,
                                                          "maximum": 99},
                           "price": {"type": "number", "exclusiveMinimum": 0,
                                     "maximum": 1000}},
            "required": ["product", "quantity", "price"]}}},
        "required": ["items"]},
     "Write a short shopping list with quantities and prices."),
    ("any_of", {
        "type": "object", "additionalProperties": False,
        "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999999},
                                        {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}]},
                       "note": {"anyOf": [_NAME, {"type": "null"}]}},
        "required": ["id", "note"]},
     "Give an identifier (a number or a code like ABC-123) and a note."),
    ("formats", {
        "type": "object", "additionalProperties": False,
        "properties": {"email": {"type": "string", "format": "email", "maxLength": 40},
                       "birthday": {"type": "string", "format": "date"},
                       "website": {"type": "string", "format": "uri", "maxLength": 40}},
        "required": ["email", "birthday", "website"]},
     "Give an email address, a birthday and a website for a made-up person."),
    ("const_and_bool", {
        "type": "object", "additionalProperties": False,
        "properties": {"version": {"const": 2}, "enabled": {"type": "boolean"},
                       "mode": {"enum": ["fast", "safe"]}},
        "required": ["version", "enabled", "mode"]},
     "Write a settings object."),
    ("integer_ranges", {
        "type": "object", "additionalProperties": False,
        "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                       "month": {"type": "integer", "minimum": 1, "maximum": 12},
                       "day": {"type": "integer", "minimum": 1, "maximum": 31}},
        "required": ["year", "month", "day"]},
     "Give the date of a famous event as year, month and day."),
    ("string_lengths", {
        "type": "object", "additionalProperties": False,
        "properties": {"code": {"type": "string", "minLength": 4, "maxLength": 4},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "maxItems": 5}},
        "required": ["code", "tags"]},
     "Give a four-character code and some short tags."),
    ("top_level_array", {
        "type": "array", "minItems": 3, "maxItems": 3,
        "items": {"type": "integer", "minimum": -50, "maximum": 50}},
     "Give three integers between -50 and 50 as a JSON array."),
    ("tree_by_ref", {  # $defs and $ref, two levels deep
        "$defs": {"leaf": {"type": "object", "additionalProperties": False,
                           "properties": {"label": _NAME}, "required": ["label"]},
                  "node": {"type": "object", "additionalProperties": False,
                           "properties": {"label": _NAME, "children": {
                               "type": "array", "maxItems": 3,
                               "items": {"$ref": "#/$defs/leaf"}}},
                           "required": ["label", "children"]}},
        "$ref": "#/$defs/node"},
     "Describe a small family: a parent and their children."),
    ("deep_required", {
        "type": "object", "additionalProperties": False,
        "properties": {"order": {"type": "object", "additionalProperties": False, "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 10**9},
            "customer": {"type": "object", "additionalProperties": False, "properties": {
                "name": _NAME, "vip": {"type": "boolean"}}, "required": ["name", "vip"]},
            "status": {"enum": ["new", "paid", "shipped"]}},
            "required": ["id", "customer", "status"]}},
        "required": ["order"]},
     "Describe an online order."),
]
