"""Chat messages through the checkpoint's chat template to prompt token ids.

One rendering for the offline ``LLM.chat`` and the router's ``/v1/chat/completions`` and
``/tokenize``: the template renders text (its special tokens written out), which is then
tokenized without adding special tokens again. Errors are :class:`InvalidRequestError` with
``field`` naming the message (the router answers them as 400s).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2 import TemplateError

from pdserve.errors import InvalidRequestError


def template_message(message: Mapping[str, Any], index: int) -> dict[str, Any]:
    """The message as a chat template sees it: OpenAI content parts joined into one string
    (``"\\n"`` between text parts), no content as ``""``; other keys (name, tool_calls, ...) as
    given. Non-text parts raise InvalidRequestError naming ``messages.<i>.content.<j>.type``."""
    msg = dict(message)
    content = msg.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            text = part.get("text") if isinstance(part, Mapping) else None
            if kind != "text" or not isinstance(text, str):
                raise InvalidRequestError(
                    f"content part type {kind!r} is not supported here; only 'text'",
                    field=f"messages.{index}.content.{j}.type",
                )
            texts.append(text)
        msg["content"] = "\n".join(texts)
    elif content is None:
        msg["content"] = ""
    return msg


def render_chat(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template: str | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    check_text: Callable[[str], None] | None = None,
) -> tuple[str, list[int]]:
    """The rendered prompt text and its token ids.

    ``chat_template`` (Jinja text) replaces the tokenizer's own; ``chat_template_kwargs`` reach
    the template as extra variables (e.g. ``enable_thinking``); ``continue_final_message`` leaves
    the last (assistant) message open for the model to continue, and excludes
    ``add_generation_prompt``; ``check_text`` sees the rendered text before it is tokenized (the
    router's character cap) and raises to refuse it.
    """
    if not messages:
        raise InvalidRequestError("messages: give at least one message", field="messages")
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message: cannot be combined with add_generation_prompt=True "
            "(the first continues the last message, the second opens a new one)",
            field="continue_final_message",
        )
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise InvalidRequestError(
            "messages: this model's tokenizer has no chat template (no chat_template in its "
            "tokenizer_config.json or chat_template.jinja); pass one, or send a plain prompt",
            field="messages",
        )
    rows: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise InvalidRequestError(
                f"messages.{i}: must be a mapping with a string 'role', got {m!r:.80}", field=f"messages.{i}"
            )
        rows.append(template_message(m, i))
    extra = dict(chat_template_kwargs or {})
    if tools:
        extra["tools"] = tools
    try:
        text = tokenizer.apply_chat_template(
            rows,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=chat_template,
            **extra,
        )
    except (TemplateError, ValueError, TypeError) as e:  # the template refused these messages
        raise InvalidRequestError(
            f"messages: the chat template cannot render these messages: {e}", field="messages"
        ) from e
    if check_text is not None:
        check_text(text)
    return text, list(tokenizer.encode(text, add_special_tokens=False))
