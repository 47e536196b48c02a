"""Chat messages (and tools) to prompt tokens through the model's chat template,
or the one given with --chat-template, as vLLM renders them."""

import json
import pathlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import jinja2

from gateway.errors import InvalidRequest

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# apply_chat_template arguments that chat_template_kwargs may not override.
RESERVED_TEMPLATE_ARGS = ("conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                          "add_generation_prompt", "continue_final_message", "return_dict")


@dataclass(frozen=True)
class ChatPrompt:
    messages: Sequence[dict]  # OpenAI's message objects
    tools: Sequence[dict] | None = None  # OpenAI's tools: {"type": "function", "function": {...}}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the output continues the last (assistant) message
    template_kwargs: dict = field(default_factory=dict)  # e.g. {"enable_thinking": False}


def read_chat_template(value: str) -> str | None:
    """--chat-template: a file's path or the template itself (vLLM takes both); empty: the model's."""
    if not value:
        return None
    path = pathlib.Path(value).expanduser()
    return path.read_text() if "{" not in value and path.is_file() else value


def _tool_call_for_template(call: dict, where: str) -> dict:
    """Templates write a call's arguments with `tojson`: give them the object, not
    OpenAI's JSON text (vLLM does the same)."""
    function = call.get("function") or {}
    if not isinstance(function, dict):
        raise InvalidRequest(f"{where}.function must be an object with name and arguments", f"{where}.function")
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except ValueError:
            raise InvalidRequest(f"{where}.function.arguments is not valid JSON", where) from None
    return {**call, "function": {**function, "arguments": arguments}}


def _template_message(index: int, message: dict) -> dict:
    where = f"messages.{index}"
    role, content = message.get("role"), message.get("content")
    if role not in CHAT_ROLES:
        raise InvalidRequest(f"messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                             f"{where}.role")
    tool_calls = message.get("tool_calls") or []
    if role != "assistant" and tool_calls:
        raise InvalidRequest(f"messages[{index}]: only assistant messages carry tool_calls", f"{where}.tool_calls")
    if content is None and not tool_calls:
        raise InvalidRequest(f"messages[{index}].content must be a string", f"{where}.content")
    if content is not None and not isinstance(content, str):
        raise InvalidRequest(f"messages[{index}].content must be a string", f"{where}.content")
    if role == "tool" and not message.get("tool_call_id"):
        raise InvalidRequest(f"messages[{index}]: a tool message needs the tool_call_id it answers",
                             f"{where}.tool_call_id")
    # "developer" is OpenAI's newer name for "system"; chat templates know only the latter.
    rendered = {"role": "system" if role == "developer" else role, "content": content or ""}
    # reasoning_content: an assistant's earlier thinking, which reasoning models' templates render (or drop).
    for key in ("name", "tool_call_id", "reasoning_content"):
        if message.get(key):
            rendered[key] = message[key]
    if tool_calls:
        rendered["tool_calls"] = [_tool_call_for_template(call, f"{where}.tool_calls.{i}")
                                  for i, call in enumerate(tool_calls)]
    return rendered


def render_chat(tokenizer, template: str | None, prompt: ChatPrompt) -> list[int]:
    """Prompt token ids; InvalidRequest when the messages or arguments do not fit."""
    if not prompt.messages:
        raise InvalidRequest("messages must not be empty", "messages")
    messages = [_template_message(index, message) for index, message in enumerate(prompt.messages)]
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("the model has no chat template; send a plain prompt, or start the server with "
                             "--chat-template")
    if prompt.continue_final_message:
        if prompt.add_generation_prompt:
            raise InvalidRequest("continue_final_message needs add_generation_prompt=false",
                                 "continue_final_message")
        if messages[-1]["role"] != "assistant":
            raise InvalidRequest("continue_final_message needs an assistant message last", "continue_final_message")
    if reserved := sorted(set(prompt.template_kwargs) & set(RESERVED_TEMPLATE_ARGS)):
        raise InvalidRequest(f"chat_template_kwargs may not set {', '.join(reserved)}", "chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=list(prompt.tools) if prompt.tools else None, chat_template=template, tokenize=False,
            add_generation_prompt=prompt.add_generation_prompt,
            continue_final_message=prompt.continue_final_message, **prompt.template_kwargs)
    except (jinja2.TemplateError, TypeError, ValueError) as error:  # e.g. "roles must alternate user/assistant"
        raise InvalidRequest(f"messages rejected by the chat template: {error}", "messages") from error
    # The template writes its own special tokens (BOS and the like).
    return tokenizer.encode(text, add_special_tokens=False)
