"""How params become prompt text: the model's chat template, or the plain format.

Pure logic: no framework imports and no I/O; the chat template itself is a callable
the backend hands in (``transformers``' / mlx-lm's ``apply_chat_template`` with
``tokenize=False``).

A prompt is a list of text **segments**, tokenized one at a time and concatenated, so
every segment boundary is a token boundary (what ``tokens.TokenPrefix`` digests and
base selection relies on):

* plain format: an optional tools block, then one ``role: content`` line per element
  (``contract.render_segments``), then the query text as it is; the backend prepends
  its BOS token to the first segment when its tokenizer adds one.
* chat template: the messages are rendered by the template; segment ``k`` is the text
  that rendering the first ``k`` messages adds to rendering the first ``k - 1``
  (a leading segment holds what the template writes before the first message, e.g.
  BOS and a tools block), and the last segment the query message plus the
  generation prompt. No BOS is added: the template writes its own, as
  ``apply_chat_template(tokenize=True)`` does. Where a template renders a message
  differently once more messages follow, that boundary is dropped (the message's
  text joins the next segment): caching stays correct -- reuse is decided on token
  ids -- only coarser.

The cacheable prefix is the rendering of the cacheable messages without a generation
prompt; a query reuses it when that text is where the query's rendering starts, which
holds for templates that render each message independently of the ones after it
(ChatML, Llama 3, Mistral, Qwen, Gemma...). ``template_id`` names the template so
entries rendered with another template (or the plain format) never share a key.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from spoolctl.errors import ConfigError
from spoolctl.store import hash_parts

from ..contract import CachePrepareParams, Element, render_segments

PLAIN = "plain"
CHAT = "chat"
#: The template identity of the plain format (keys of plain prompts carry no template id,
#: so they are the keys spoolctl always used).
PLAIN_ID = ""

#: ``apply(messages, tools, add_generation_prompt, **kwargs) -> str``
Apply = Callable[..., str]

#: Chat roles for elements without one: instructions are system text, data is user text.
_DEFAULT_ROLE = {"instructions": "system", "data": "user"}
#: Gemini says "model" where chat templates say "assistant".
_ROLE_NAMES = {"model": "assistant"}


@dataclass(frozen=True)
class Segments:
    """A rendered prompt: ``texts`` per segment, ``lead`` segments before the first
    element, and whether the backend should prepend its BOS token."""

    texts: list[str]
    lead: int
    bos: bool


@dataclass(frozen=True)
class ChatTemplate:
    """The model's chat template: ``apply`` renders messages to text; ``source``
    identifies it (the template text, or the name of a custom renderer)."""

    apply: Apply
    source: str

    @property
    def template_id(self) -> str:
        return hash_parts(b"spoolctl-chat-template/v1", self.source.encode())


def template_source(template: Any, extra: str = "") -> str:
    """A stable text for a tokenizer's ``chat_template`` (a string, or a dict of named
    templates), plus ``extra`` (e.g. a custom renderer's name)."""
    if isinstance(template, str):
        text = template
    else:
        text = json.dumps(template, sort_keys=True, default=str)
    return f"{text}\x00{extra}" if extra else text


def choose(params: CachePrepareParams, template: ChatTemplate | None) -> ChatTemplate | None:
    """The chat template to render ``params`` with, or None for the plain format."""
    mode = params.template
    if mode == PLAIN:
        return None
    if template is None:
        if mode == CHAT:
            raise ConfigError("formatter_options asks for the chat template, but this "
                              "model's tokenizer has none",
                              fix="use {'template': 'plain'} (or 'auto'), or a model with a "
                                  "chat template")
        return None
    return template


def render_id(params: CachePrepareParams, template: ChatTemplate | None) -> str:
    """What the key must add to ``params.key()`` for this rendering ("" = plain)."""
    chosen = choose(params, template)
    return PLAIN_ID if chosen is None else chosen.template_id


def message(element: Element, section: str) -> dict[str, Any]:
    """An element as a chat message (``{"role", "content"[, "name"]}``)."""
    role = element.role or _DEFAULT_ROLE[section]
    out: dict[str, Any] = {"role": _ROLE_NAMES.get(role, role), "content": element.content}
    if element.name is not None:
        out["name"] = element.name
    return out


def tool_specs(params: CachePrepareParams) -> list[dict[str, Any]] | None:
    """Tools in the JSON-schema form chat templates take, sorted by name (the order the
    key hashes them in)."""
    if not params.tools:
        return None
    ordered = sorted((t.to_json() for t in params.tools), key=lambda t: t["name"])
    return [{"type": "function", "function": t} for t in ordered]


def _elements(params: CachePrepareParams, include_volatile: bool) -> list[tuple[Element, str]]:
    if include_volatile:
        instr, data = params.instructions, params.data
    else:
        instr, data = params.cacheable()
    return [(e, "instructions") for e in instr] + [(e, "data") for e in data]


def render(params: CachePrepareParams, template: ChatTemplate | None, *,
           query: str | None) -> Segments:
    """The segments of the cacheable prefix (``query is None``), or of the whole prompt:
    every element (volatile ones included), then ``query`` (may be empty)."""
    chosen = choose(params, template)
    if chosen is None:
        texts = render_segments(params, include_volatile=query is not None)
        if query:
            texts.append(query)
        return Segments(texts, lead=1 if params.tools else 0, bos=True)
    messages = [message(e, s) for e, s in _elements(params, query is not None)]
    final = [{"role": "user", "content": query}] if query else []
    return chat_segments(chosen.apply, messages, final=final, generation=query is not None,
                         tools=tool_specs(params), kwargs=_template_kwargs(params))


def _template_kwargs(params: CachePrepareParams) -> dict[str, Any]:
    kwargs = params.chat_template_kwargs
    if params.reasoning_effort is not None:
        # Templates with a reasoning switch read this variable (e.g. gpt-oss); others
        # ignore it. It is part of the key either way.
        kwargs.setdefault("reasoning_effort", params.reasoning_effort)
    return kwargs


def _apply(apply: Apply, messages: Sequence[Mapping[str, Any]], *, tools: Any,
           generation: bool, kwargs: Mapping[str, Any]) -> str:
    try:
        text = apply(list(messages), tools=tools, add_generation_prompt=generation, **kwargs)
    except ConfigError:
        raise
    except Exception as exc:  # jinja2 errors, TemplateError, TypeError from a renderer
        raise ConfigError(f"the model's chat template refused these messages: "
                          f"{str(exc)[:200]}",
                          fix="merge consecutive messages of one role or reorder them as the "
                              "model expects, or pass formatter_options={'template': 'plain'}"
                          ) from None
    if not isinstance(text, str):
        raise ConfigError("the chat template did not return text",
                          fix="pass formatter_options={'template': 'plain'}")
    return text


def chat_segments(apply: Apply, messages: list[dict[str, Any]], *, final: list[dict[str, Any]],
                  generation: bool, tools: Any, kwargs: Mapping[str, Any]) -> Segments:
    """Cut the template's rendering of ``messages + final`` at message boundaries (see the
    module docstring). ``generation`` adds the template's generation prompt."""
    full = _apply(apply, [*messages, *final], tools=tools, generation=generation,
                  kwargs=kwargs)
    try:  # many templates index messages[0]; then there is no lead segment
        lead_text = _apply(apply, [], tools=tools, generation=False, kwargs=kwargs) \
            if messages else ""
    except ConfigError:
        lead_text = ""
    texts: list[str] = []
    prev = len(lead_text) if lead_text and full.startswith(lead_text) else 0
    lead = 0
    if prev:
        texts.append(full[:prev])
        lead = 1
    for k in range(1, len(messages) + 1):
        if k == len(messages) and not final and not generation:
            cut = len(full)  # the prefix itself: the last message ends the text
        else:
            part = _apply(apply, messages[:k], tools=tools, generation=False, kwargs=kwargs)
            cut = len(part) if len(part) >= prev and full.startswith(part) else prev
        texts.append(full[prev:cut])
        prev = cut
    if prev < len(full) or not texts:
        texts.append(full[prev:])
    return Segments(texts, lead=lead, bos=False)
