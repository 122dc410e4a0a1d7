"""The chat template is the server's choice: a file or inline Jinja given at start, else the tokenizer's.

A client's `chat_template_kwargs` are variables for that template and nothing more. Any key that
`apply_chat_template` takes as an argument of its own would let a client swap the template (running
Jinja of its choosing in the replica) or change how the prompt is built, so those keys are refused.
"""

from __future__ import annotations

from pathlib import Path

# `apply_chat_template`'s own parameters, plus the arguments tandem passes: none may come from a client.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "conversation",
        "messages",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "tokenizer",
    }
)

_JINJA_MARKS = ("{{", "{%", "\n")


def load_chat_template(value: str | None) -> str | None:
    """The template text: the file `value` names, or `value` itself when it is Jinja (as vLLM reads
    `--chat-template`). Raises ValueError for a value that is neither."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a long inline template is not a valid file name
        pass
    if any(mark in value for mark in _JINJA_MARKS):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a readable file nor a Jinja template")


def forbidden_template_kwargs(kwargs: dict[str, object]) -> list[str]:
    return sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())


def non_json_template_value(kwargs: dict[str, object]) -> str | None:
    """The first key whose value is not plain JSON data (null, bool, number, string, or lists and
    string-keyed objects of them), or None. A handle call could hand the template any Python object,
    whose methods Jinja would then let the template call."""
    for key, value in kwargs.items():
        if not _plain_json(value):
            return key
    return None


_SCALARS = (type(None), bool, int, float, str)  # exact types: no subclass brings methods of its own


def _plain_json(value: object, depth: int = 0) -> bool:
    if depth > 32:
        return False
    if type(value) in _SCALARS:
        return True
    if type(value) is list and isinstance(value, list):
        return all(_plain_json(v, depth + 1) for v in value)
    if type(value) is dict and isinstance(value, dict):
        return all(type(k) is str and _plain_json(v, depth + 1) for k, v in value.items())
    return False
