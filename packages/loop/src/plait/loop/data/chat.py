"""Chat data: conversations rendered with a tokenizer's chat template, their assistant tokens marked.

The template is the Jinja ``chat_template`` of a Hugging Face tokenizer directory, rendered as
``transformers`` renders it (a sandboxed environment with ``trim_blocks`` / ``lstrip_blocks``,
``raise_exception``, ``tojson``, the tokenizer's special tokens such as ``bos_token`` and
``eos_token``, ``add_generation_prompt=False``). The assistant tokens are those a
``{% generation %}`` ... ``{% endgeneration %}`` block renders, mapped to tokens as
``apply_chat_template(..., return_assistant_tokens_mask=True)`` maps them; a template without such a
block gets each assistant turn's span from renders of the conversation's prefixes (the text the
conversation up to that turn adds to the conversation before it, with the generation prompt).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

__all__ = ["ROLES", "ChatTemplate", "assistant_token_mask", "check_messages"]

ROLES = ("system", "user", "assistant", "tool")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


def _jinja() -> Any:
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise ImportError("the chat format needs jinja2: pip install 'plait-loop[chat]'") from None
    return jinja2


def _token_text(value: object) -> str | None:
    return value.get("content") if isinstance(value, dict) else value if isinstance(value, str) else None


def _template_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as ``transformers`` hands them to a template: keys whose value is None dropped, a
    message's reasoning (``reasoning_content``, ``thinking`` or ``reasoning``) under both
    ``reasoning_content`` and ``thinking``."""
    out = []
    for m in messages:
        message = {k: v for k, v in m.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def check_messages(record: object) -> list[dict[str, Any]]:
    """The ``messages`` of a chat record, checked: a list of ``{"role", "content"}`` dicts with known roles
    and at least one assistant turn.

    Raises:
        ValueError: naming what is wrong (the caller adds the file and line).
    """
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            'no \'messages\' list (a chat record is {"messages": [{"role": ..., "content": ...}]})'
        )
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} is {type(m).__name__}, not an object with 'role' and 'content'")
        if m.get("role") not in ROLES:
            raise ValueError(f"message {i} has role {m.get('role')!r} (expected one of {', '.join(ROLES)})")
        if not isinstance(m.get("content"), str) and not m.get("tool_calls"):
            raise ValueError(f"message {i} ({m['role']}) has no string 'content'")
        out.append(m)
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant message (nothing to train on)")
    return out


class ChatTemplate:
    """A compiled Jinja chat template with the tokenizer's special tokens.

    Args:
        source: the template text.
        special_tokens: ``bos_token``, ``eos_token``, ... -> their text (template variables).

    Raises:
        ImportError: without jinja2 (the ``chat`` extra).
        ValueError: a template that does not compile.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None) -> None:
        jinja2 = _jinja()
        spans: list[tuple[int, int]] = []
        blocks: list[str] = []
        tracking = [False]

        class _Generation(jinja2.ext.Extension):  # type: ignore[misc,name-defined]
            """``{% generation %}...{% endgeneration %}``: records the character span it renders."""

            tags: ClassVar[set[str]] = {"generation"}

            def parse(self, parser: Any) -> Any:
                lineno = next(parser.stream).lineno
                body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
                return jinja2.nodes.CallBlock(self.call_method("_track"), [], [], body).set_lineno(lineno)

            def _track(self, caller: Callable[[], str]) -> str:
                text = caller()
                if tracking[0]:
                    start = sum(len(b) for b in blocks)
                    spans.append((start, start + len(text)))
                return text

        def raise_exception(message: str) -> None:
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
                   sort_keys: bool = False) -> str:  # fmt: skip
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
            )

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e} (template line {e.lineno})") from None
        self._errors = (jinja2.exceptions.TemplateError, TypeError)
        self._spans, self._blocks, self._tracking = spans, blocks, tracking
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        self.has_generation_block = re.search(r"\{%-?\s*generation\s*-?%\}", source) is not None

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        """The chat template of a Hugging Face tokenizer directory: ``chat_template.jinja``, else the
        ``chat_template`` of ``tokenizer_config.json`` (a string, or the one named ``default`` of a list),
        with the special tokens of ``tokenizer_config.json`` / ``special_tokens_map.json``.

        Raises:
            ValueError: no chat template in ``path`` (naming the files looked at).
        """
        path = Path(path)
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        special: dict[str, str] = {}
        map_file = path / "special_tokens_map.json"
        for source in (json.loads(map_file.read_text()) if map_file.is_file() else {}, cfg):
            for key in _SPECIAL_TOKEN_KEYS:
                text = _token_text(source.get(key))
                if text is not None:
                    special[key] = text
        template: Any = None
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        else:
            template = cfg.get("chat_template")
            if isinstance(template, list):
                named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
                template = named.get("default")
        if not isinstance(template, str):
            raise ValueError(
                f"{path} has no chat template (no chat_template.jinja, no 'chat_template' in tokenizer_config.json)"
            )
        return cls(template, special)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = False) -> str:
        """The conversation's text.

        Raises:
            ValueError: the template raised (``raise_exception``) or failed on these messages.
        """
        try:
            return str(
                self._template.render(
                    messages=_template_messages(messages),
                    tools=None,
                    documents=None,
                    add_generation_prompt=add_generation_prompt,
                    **self.special_tokens,
                )
            )
        except self._errors as e:
            raise ValueError(f"the chat template failed: {e}") from None

    def render_with_spans(self, messages: Sequence[Mapping[str, Any]]) -> tuple[str, list[tuple[int, int]]]:
        """The conversation's text and the character spans ``[start, end)`` of its assistant turns: those
        of the ``{% generation %}`` blocks, or (a template without one) from prefix renders.

        Raises:
            ValueError: the template failed, or (no generation block) renders a prefix of the
                conversation differently from the conversation, so the turns cannot be found.
        """
        if not self.has_generation_block:
            return self._spans_from_prefixes(messages)
        self._spans.clear()
        self._blocks.clear()
        self._tracking[0] = True
        try:
            for block in self._template.generate(
                messages=_template_messages(messages),
                tools=None,
                documents=None,
                add_generation_prompt=False,
                **self.special_tokens,
            ):
                self._blocks.append(block)
        except self._errors as e:
            raise ValueError(f"the chat template failed: {e}") from None
        finally:
            self._tracking[0] = False
        return "".join(self._blocks), list(self._spans)

    def _spans_from_prefixes(
        self, messages: Sequence[Mapping[str, Any]]
    ) -> tuple[str, list[tuple[int, int]]]:
        text = self.render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1])
            if not (upto.startswith(before) and text.startswith(upto)):
                raise ValueError(
                    f"the chat template renders the conversation up to message {i} differently from the whole "
                    "conversation, so its assistant turns cannot be found; give it a {% generation %} block"
                )
            spans.append((len(before), len(upto)))
        return text, spans


def assistant_token_mask(
    num_tokens: int, spans: Sequence[tuple[int, int]], char_to_token: Callable[[int], int | None]
) -> list[int]:
    """1 for the tokens that cover the character ``spans``, else 0, as ``transformers`` builds
    ``assistant_masks``: from the token of a span's first character to that of its last (to the end
    when the last character has no token); a span whose first character has no token ends the marking."""
    mask = [0] * num_tokens
    for start, end in spans:
        first, last = char_to_token(start), char_to_token(end - 1)
        if first is None:
            break
        for t in range(first, last + 1 if last else num_tokens):  # `if last`: transformers' own test
            mask[t] = 1
    return mask
