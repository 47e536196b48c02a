"""What a request's JSON may not hold, whichever front end it came through: JSON
allows it, but what reads it later cannot (a 500, or a worker stuck in recursion)."""

# Nesting of a request's JSON values (a tool's parameter schema, a response_format
# schema, chat_template_kwargs): far beyond any real schema, and well within the
# recursion the chat template, the grammar and the JSON encoders can take.
MAX_JSON_DEPTH = 64
_SURROGATE = "contains a lone surrogate (e.g. \\ud800), which is not Unicode text"


def json_problem(value, path: tuple = ()) -> tuple[str | None, str] | None:
    """(parameter path, what is wrong) for the first array or object nested deeper than
    MAX_JSON_DEPTH, or the first string (or key) holding a lone surrogate, which JSON's
    "\\ud800" escapes allow but no UTF-8 encoder, tokenizer or protobuf string takes;
    None when the value is fine. Iterative, so depth itself cannot break it, and quick
    over long arrays of numbers (a prompt of token ids)."""
    if isinstance(value, str):
        return None if _is_unicode(value) else (_param(path), _SURROGATE)
    stack = [(value, path)] if isinstance(value, dict | list | tuple) else []
    while stack:
        container, where = stack.pop()
        if len(where) - len(path) >= MAX_JSON_DEPTH:
            return _param(where[:len(path) + 3]), f"is nested more than {MAX_JSON_DEPTH} levels deep"
        if isinstance(container, dict):
            for key in container:
                if isinstance(key, str) and not _is_unicode(key):
                    return _param(where), "has a key with a lone surrogate (e.g. \\ud800), which is not Unicode text"
            items = container.items()
        elif all(type(item) is int for item in container):
            continue
        else:
            items = enumerate(container)
        for key, item in items:
            if isinstance(item, str):
                if not _is_unicode(item):
                    return _param((*where, key)), _SURROGATE
            elif isinstance(item, dict | list | tuple):
                stack.append((item, (*where, key)))
    return None


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _param(path: tuple) -> str | None:
    return ".".join(str(part) for part in path) or None
