"""Bounded JSON strings (`minLength` / `maxLength`) rewritten into a grammar of tandem's own before xgrammar
compiles a schema.

xgrammar's JSON-schema converter (0.2.x) writes a bounded string as a repetition of one loose character
class: it drops the escape branch and admits raw U+0000-U+001F, which no strict JSON parser accepts
(xgrammar issue #800, shared by vLLM and SGLang). Its negated character classes also let through
surrogates and overlong UTF-8, which decode to U+FFFD and so lengthen the string past its bound. So each
such string becomes a `pattern` that counts characters as JSON does (an escape is one character): a
character is one code point outside `"`, `\\` and U+0000-U+001F written in positive ranges (which xgrammar
builds as exact UTF-8), or one escape, `\\uXXXX` without lone surrogates. xgrammar matches a pattern against
the string's text between the quotes, so the pattern's language is exactly the valid JSON strings of
those lengths.
"""

from __future__ import annotations

import json
from typing import Any

# Outside `"` (0x22), `\` (0x5C) and the controls; surrogates excluded; the supplementary planes as literal
# characters (the regex reader takes `\u` escapes of the BMP only).
_CHARACTER = "[ !#-\\[\\]-\\uD7FF\\uE000-\\uFFFF\U00010000-\U0010ffff]"
_ESCAPE = '\\\\(?:["\\\\/bfnrt]|u(?:[0-9A-Ca-cEFef][0-9A-Fa-f]{3}|[Dd][0-7][0-9A-Fa-f]{2}))'
JSON_CHARACTER = f"(?:{_CHARACTER}|{_ESCAPE})"
# Keys with which the string's content is already pinned down otherwise: left to xgrammar.
_PINNED = ("pattern", "format", "enum", "const")


def bounded_string_pattern(min_length: int, max_length: int | None) -> str:
    upper = "" if max_length is None else str(max_length)
    return f"^{JSON_CHARACTER}{{{min_length},{upper}}}$"


def rewrite_bounded_strings(schema: Any) -> Any:
    """A copy of `schema` in which every string schema with minLength/maxLength (and no pattern, format,
    enum or const) carries the equivalent `pattern` instead."""
    if isinstance(schema, list):
        return [rewrite_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: rewrite_bounded_strings(value) for key, value in schema.items()}
    bounded = "minLength" in out or "maxLength" in out
    if out.get("type") == "string" and bounded and not any(key in out for key in _PINNED):
        low, high = out.pop("minLength", 0), out.pop("maxLength", None)
        if _count(low) and (high is None or _count(high)):
            out["pattern"] = bounded_string_pattern(low, high)
        else:  # not a valid bound: leave it for xgrammar to refuse
            out["minLength"], out["maxLength"] = low, high
    return out


def rewrite_schema_text(text: str) -> str:
    """`rewrite_bounded_strings` on a schema's JSON text, keeping its key order (the output's)."""
    return json.dumps(rewrite_bounded_strings(json.loads(text)), separators=(",", ":"))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
