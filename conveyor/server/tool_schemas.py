"""Tool schemas as constraints: ``tool_choice`` into the structured-outputs spec the request is
held to, under OpenAI's ``strict`` rule (an object lists its properties: unlisted ones refused
where the schema does not allow them). ``required`` is an array of calls that ends the request
when it closes (at most ``MAX_PARALLEL_CALLS``), or where the model ends its turn after a whole
call; a named function that function's arguments (as vLLM)."""

from __future__ import annotations

import json

from conveyor.server.protocol import ChatCompletionRequest

MAX_PARALLEL_CALLS = 16  # the array's bound: a model stuck repeating a call ends there
# Whitespace between a call's JSON tokens: a space, or a line break and an indent, as
# llama.cpp's JSON grammars allow it; free whitespace let a small model spend its every token
# on it and return no call
CALL_WHITESPACE = r"(?: |\n[ \t]{0,20})"


def _arguments_schema(tool) -> dict:
    """A tool's arguments schema as its constraint: OpenAI's ``strict`` (unlisted properties
    refused where the schema does not allow them) unless the tool says ``strict: false``."""
    schema = tool.function.parameters or {"type": "object"}
    return schema if tool.function.strict is False else strict_schema(schema)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_ONE = ("additionalProperties", "items", "additionalItems", "contains",
               "unevaluatedItems")
# schemas that hold for the same value as the one they sit in: an object's parts, when they
# name properties, are fragments of it, closed by it rather than each on its own
_SAME_VALUE = ("allOf", "anyOf", "oneOf", "then", "else")


def _objectish(schema) -> bool:
    kind = schema.get("type") if isinstance(schema, dict) else None
    return (kind == "object" or (isinstance(kind, list) and "object" in kind)
            or isinstance(schema, dict) and isinstance(schema.get("properties"), dict))


def strict_schema(schema, _fragment: bool = False):
    """A copy of a JSON schema in which every object schema that does not state
    ``additionalProperties`` has it false (OpenAI's ``strict``): in ``properties``, ``items``,
    ``prefixItems``, ``anyOf``/``oneOf``/``allOf``, ``$defs`` and the rest; not under ``not``
    or ``if``, where it would change what they let through. Parts of an object that hold for
    the object itself (``allOf``'s always, ``anyOf``/``oneOf``'s beside its own
    ``properties``) stay open, and the object closes over their properties and its own
    together. The argument is not modified."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: strict_schema(v) for k, v in out[key].items()}
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), dict):
            out[key] = strict_schema(out[key])
    for key in ("items", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    own = isinstance(out.get("properties"), dict)
    parts: list = []
    for key in _SAME_VALUE:
        value = out.get(key)
        fragment = key not in ("anyOf", "oneOf") or own
        if isinstance(value, list):
            out[key] = [strict_schema(s, fragment) for s in value]
            parts += out[key]
        elif isinstance(value, dict):
            out[key] = strict_schema(value, fragment)
            parts.append(out[key])
    objectish = _objectish(out) or any(_objectish(p) for p in out.get("allOf") or [])
    stated = "additionalProperties" in out or "unevaluatedProperties" in out
    if _fragment or stated or not objectish:
        return out
    props = out["properties"] if own else {}
    names = [n for p in parts if isinstance(p, dict) and isinstance(p.get("properties"), dict)
             for n in p["properties"] if n not in props]
    if names and (own or "properties" not in out):  # the parts' properties are the object's
        out["properties"] = {**props, **dict.fromkeys(names, {})}
    out["additionalProperties"] = False
    return out


_VALUES = ("const", "enum", "default", "examples")  # data, not schemas


def _moved(schema, pointer: str):
    """``schema`` with its local references (``#``, ``#/...``) made to work from ``pointer``,
    where it now sits inside the calls' array (``$defs`` stay where they are: two tools may
    both have a ``Point``)."""
    if isinstance(schema, list):
        return [_moved(s, pointer) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value[:2] == "#/"):
            out[key] = pointer + value[1:]
        elif key in _VALUES:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas
            out[key] = {name: _moved(s, pointer) for name, s in value.items()}
        else:
            out[key] = _moved(value, pointer)
    return out


def tool_constraint(body: ChatCompletionRequest, mode: str | None) -> tuple[str, dict] | None:
    """The structured-outputs spec ``tool_choice`` asks for, as (field, spec)."""
    if mode in (None, "none", "auto"):
        return None
    if mode != "required":
        tool = next(t for t in body.tools if t.function.name == mode)
        return "tool_choice", {"json": _arguments_schema(tool),
                               "whitespace_pattern": CALL_WHITESPACE}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": t.function.name}, "arguments": _moved(
                  _arguments_schema(t), f"#/anyOf/{i}/properties/arguments")}}
             for i, t in enumerate(body.tools)]
    call = {"anyOf": calls, "x-guidance": {"whitespace_flexible": True,
                                           "whitespace_pattern": CALL_WHITESPACE}}
    more = f' (WS? "," WS? call){{0,{MAX_PARALLEL_CALLS - 1}}}' if body.parallel_tool_calls else ""
    # the closing bracket may be left out: the model's end of turn after a whole call ends the
    # array there, where a small model, the end of turn held back, wrote call after call
    return "tool_choice", {"grammar": f'start: "[" WS? call{more} (WS? "]")?\n'
                                      f"call: %json {json.dumps(call)}\n"
                                      f"WS: /{CALL_WHITESPACE}/\n"}
