"""Tool-call formats: how a model family writes a call, where generation stops for it, and
how the tool's output goes back into the episode.

Four formats, picked by ``rollout.environment.tool_format`` ("auto": from the tokenizer,
``format_for``; a tokenizer of no known family is refused, at load:
``config.checks.check_tool_format``):

- ``llama3``: Llama-3.1's code interpreter. With ``Environment: ipython`` in the system
  prompt the model writes ``<|python_tag|>`` + code and ends the turn with ``<|eom_id|>``
  ("end of message": a tool call follows) instead of ``<|eot_id|>``. The output comes back
  as an ``ipython`` turn, then the assistant's header opens its next turn. Token for token
  what Meta's reference formatter writes for the same dialog
  (``llama_models.llama3.chat_format``): the output is tokenized on its own, raw. (The Hub
  chat template instead writes a string tool output JSON-quoted, ``"8\\n"``: see
  docs/environments.md for what that means for serving the trained model.)
- ``llama4``: Llama-4's code interpreter as Meta's reference formatter defines it
  (``llama_models.llama4.chat_format``; the prompt-format doc has no code-interpreter
  example): the model writes ``<|python_start|>`` code ``<|python_end|>`` and ends the
  message with ``<|eom|>``; the output comes back as an ``ipython`` turn ended by ``<|eom|>``
  (Meta's formatter ends tool turns so; the Hub chat template with ``<|eot|>``), then the
  assistant's header. The chat template is given nothing (its ``tools`` argument offers
  JSON function calls, not the code interpreter): the recipe's system prompt says how to
  call the tool.
- ``qwen``: Qwen2.5 / Qwen3 (Hermes style): ``<tool_call>\\n{"name": "python",
  "arguments": {"code": "..."}}\\n</tool_call>`` inside the assistant turn; the output comes
  back in a user turn as ``<tool_response>\\n...\\n</tool_response>`` (the Qwen chat
  templates' rendering of a ``tool`` message).
- ``markdown``: base models (ToRA's convention): a fenced ````python`` block, closed, then
  ````output``; generation stops at ````output`` and the output fills that block.

Every format gives the engine what to stop on (``stop_strings`` and ``stop_token_ids``), reads
the call out of the model's turn (``parse``; the turn's ids decoded with their special
tokens, which is what ``parse_ids`` does) and renders the output as the text that is
tokenized once and appended by id (``observation_text`` / ``observation_ids``). A call that
cannot be read (unterminated, bad JSON, no code) is a ``ToolCall`` with an ``error``: the
environment reports it to the model as a tool error, it never raises.

Stop strings: the engine must keep them in the output (vLLM ``include_stop_str_in_output``)
so that the turn's text is the decoding of its ids.
"""

from __future__ import annotations

import json
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

# The tool the JSON formats name ("name" of Qwen's call).
DEFAULT_TOOL_NAME = "python"


@dataclass(frozen=True)
class ToolCall:
    """A call read from a model turn: ``code`` to run, or ``error`` (why it could not be
    read; ``code`` is None then). ``text`` is the call as the model wrote it."""

    code: str | None
    error: str = ""
    text: str = ""

    @property
    def malformed(self) -> bool:
        """True when the call cannot be run (reported to the model as a tool error)."""
        return self.code is None


class ToolFormat(ABC):
    """One model family's tool-call convention (see the module docstring)."""

    name: ClassVar[str]
    # Text the engine stops at to hand over to the tool (kept in the output).
    stop_strings: ClassVar[tuple[str, ...]] = ()
    # Tokens (by their text) that end a call, where the tokenizer has them as single tokens.
    stop_tokens: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tool_name: str = DEFAULT_TOOL_NAME) -> None:
        self.tool_name = tool_name

    def stop_token_ids(self, tokenizer: Any) -> list[int]:
        """Ids of ``stop_tokens`` that are single tokens of ``tokenizer`` (others are
        caught by ``stop_strings``)."""
        ids = []
        for token in self.stop_tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded) == 1:
                ids.append(int(encoded[0]))
        return ids

    @abstractmethod
    def parse(self, text: str) -> ToolCall | None:
        """The call at the end of a model turn (``text``: the turn's ids decoded with their
        special tokens); None when the turn makes no call (a final answer)."""

    def parse_ids(self, token_ids: Sequence[int], tokenizer: Any) -> ToolCall | None:
        """``parse`` of a turn given as the ids the engine produced (decoded only to read
        the call: the ids themselves stay what the episode holds)."""
        return self.parse(tokenizer.decode(list(token_ids), skip_special_tokens=False))

    def template_kwargs(self, tool_schema: dict[str, Any]) -> dict[str, Any]:
        """What the chat template is given (``apply_chat_template(..., **kwargs)``) so that
        the prompt offers the tool the family's way (``tool_schema``: the environment's
        ``Environment.tool_schema()``); {}: the prompt text says it (base models)."""
        return {}

    @abstractmethod
    def observation_text(self, output: str) -> str:
        """The text appended after a call's turn: ``output`` in the family's tool turn, and
        whatever reopens the model's turn."""

    def observation_ids(self, output: str, tokenizer: Any) -> list[int]:
        """``observation_text`` tokenized once, without BOS: the ids appended to the episode.
        Special-token text in it is ordinary text (``plain_text_ids``): a format whose
        observation holds real special tokens encodes them apart from the output."""
        return plain_text_ids(self.observation_text(output), tokenizer)


_PLAIN_TEXT: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_PLAIN_TEXT_LOCK = threading.Lock()


def plain_text_ids(text: str, tokenizer: Any) -> list[int]:
    """``text``'s ids with the text of special tokens encoded as ordinary text, as Meta's
    tokenizers encode message content (tiktoken with ``disallowed_special=()``): a program
    that prints ``<|eot_id|>`` must not end a turn or forge a header in the episode.

    A copy of ``tokenizer``'s backend with ``encode_special_tokens`` set, made once per
    tokenizer: transformers' per-call ``split_special_tokens`` flips that flag on the shared
    backend, which the tool threads would race on. A tokenizer without a ``tokenizers``
    backend is called as it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=False))
    with _PLAIN_TEXT_LOCK:
        plain = _PLAIN_TEXT.get(tokenizer)
        if plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            _PLAIN_TEXT[tokenizer] = plain
    return list(plain.encode(text, add_special_tokens=False).ids)


class LlamaFormat(ToolFormat):
    """Meta's code interpreter (Llama-3.1, Llama-4): ``START`` code ``END``, then the output
    in an ``ipython`` turn ended by ``TOOL_END`` and the assistant's header, tokenized as
    Meta's reference formatter does (``ChatFormat.encode_message``): the header, the output
    and the turn's end each on their own (an output starting with a newline would otherwise
    merge with the header's ``\\n\\n``), the output's special-token text as ordinary text
    (``plain_text_ids``)."""

    START: ClassVar[str]
    END: ClassVar[str]
    HEADER: ClassVar[tuple[str, str]]  # (start, end) of a turn's header
    TOOL_END: ClassVar[str]

    def parse(self, text: str) -> ToolCall | None:
        start = text.find(self.START)
        if start < 0:
            return None
        call = text[start:]
        body = call[len(self.START) :]
        if not body.rstrip().endswith(self.END):
            return ToolCall(None, f"unterminated tool call: {self.START} without {self.END}", call)
        code = self.call_code(body.rstrip()[: -len(self.END)])
        if not code.strip():
            return ToolCall(None, "empty tool call: no code", call)
        return ToolCall(code, text=call)

    def call_code(self, body: str) -> str:
        """The code of a call whose text between ``START`` and ``END`` is ``body``."""
        return body

    def _header(self, role: str) -> str:
        return f"{self.HEADER[0]}{role}{self.HEADER[1]}\n\n"

    def observation_text(self, output: str) -> str:
        return self._header("ipython") + output + self.TOOL_END + self._header("assistant")

    def observation_ids(self, output: str, tokenizer: Any) -> list[int]:
        ids = tokenizer.encode(self._header("ipython"), add_special_tokens=False)
        ids += plain_text_ids(output, tokenizer)
        return ids + tokenizer.encode(
            self.TOOL_END + self._header("assistant"), add_special_tokens=False
        )


class Llama3Format(LlamaFormat):
    """Llama-3.1's ``<|python_tag|>`` code ``<|eom_id|>`` (the ``ipython`` environment)."""

    name = "llama3"
    START = "<|python_tag|>"
    END = "<|eom_id|>"
    HEADER = ("<|start_header_id|>", "<|end_header_id|>")
    TOOL_END = "<|eot_id|>"
    stop_tokens = (END,)

    def template_kwargs(self, tool_schema: dict[str, Any]) -> dict[str, Any]:
        # Llama-3.1's template writes "Environment: ipython" into the system turn when
        # builtin_tools is given; code_interpreter is the <|python_tag|> tool itself.
        return {"builtin_tools": ["code_interpreter"]}


class Llama4Format(LlamaFormat):
    """Llama-4's ``<|python_start|>`` code ``<|python_end|>`` ``<|eom|>`` (Meta's llama4
    formatter: ``decode_assistant_message`` reads such a message as a code-interpreter
    call; ``encode_message`` ends tool turns with ``<|eom|>``)."""

    name = "llama4"
    START = "<|python_start|>"
    END = "<|eom|>"
    CODE_END = "<|python_end|>"
    HEADER = ("<|header_start|>", "<|header_end|>")
    TOOL_END = "<|eom|>"
    stop_tokens = (END,)

    def call_code(self, body: str) -> str:
        # Meta's decoder drops <|python_end|> wherever it is
        return body.replace(self.CODE_END, "")


class QwenFormat(ToolFormat):
    """Qwen's ``<tool_call>{json}</tool_call>`` with the code in ``arguments.code``."""

    name = "qwen"
    START = "<tool_call>"
    END = "</tool_call>"
    stop_strings = (END,)
    stop_tokens = (END,)

    def parse(self, text: str) -> ToolCall | None:
        start = text.rfind(self.START)
        if start < 0:
            return None
        call = text[start:]
        end = call.find(self.END)
        if end < 0:
            return ToolCall(None, f"unterminated tool call: {self.START} without {self.END}", call)
        try:
            payload = json.loads(call[len(self.START) : end])
        except ValueError as exc:
            return ToolCall(None, f"tool call is not valid JSON: {exc}", call)
        if not isinstance(payload, dict):
            return ToolCall(None, "tool call must be a JSON object with name and arguments", call)
        name = payload.get("name")
        if name != self.tool_name:
            return ToolCall(None, f"unknown tool {name!r}; the tool is {self.tool_name!r}", call)
        arguments = payload.get("arguments")
        if isinstance(arguments, str):  # some models encode the arguments object twice
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str) or not code.strip():
            return ToolCall(None, 'tool call needs "arguments": {"code": "<python code>"}', call)
        return ToolCall(code, text=call)

    def template_kwargs(self, tool_schema: dict[str, Any]) -> dict[str, Any]:
        # Qwen's templates list the tools in the system turn, with the <tool_call> format
        return {"tools": [tool_schema]}

    HEAD = "<|im_end|>\n<|im_start|>"
    TAIL = "<|im_end|>\n<|im_start|>assistant\n"

    def _body(self, output: str) -> str:
        return f"user\n<tool_response>\n{output}\n</tool_response>"

    def observation_text(self, output: str) -> str:
        # The call ended the assistant's turn at </tool_call>: close it as the chat template
        # would (<|im_end|>), then the tool message and the next assistant header.
        return self.HEAD + self._body(output) + self.TAIL

    def observation_ids(self, output: str, tokenizer: Any) -> list[int]:
        # The turn's own special tokens as such; the tool message between them (the text a
        # tokenizer encodes apart anyway, split at special tokens) with the output's
        # special-token text as ordinary text: an output printing "<|im_end|>\n<|im_start|>
        # assistant\n..." forged a turn end and an assistant turn in the episode.
        head = tokenizer.encode(self.HEAD, add_special_tokens=False)
        tail = tokenizer.encode(self.TAIL, add_special_tokens=False)
        return [*head, *plain_text_ids(self._body(output), tokenizer), *tail]


class MarkdownFormat(ToolFormat):
    """Base models: a ```python block, then ```output (ToRA's tool-integrated reasoning)."""

    name = "markdown"
    OPEN = "```python"
    OUTPUT = "```output"
    stop_strings = (OUTPUT,)

    def parse(self, text: str) -> ToolCall | None:
        stripped = text.rstrip()
        if not stripped.endswith(self.OUTPUT):
            return None
        before = stripped[: -len(self.OUTPUT)]
        start = before.rfind(self.OPEN)
        if start < 0:
            return ToolCall(None, f"{self.OUTPUT} without a {self.OPEN} block before it", text)
        call = stripped[start:]
        body = before[start + len(self.OPEN) :]
        closed = body.rstrip()
        if not closed.endswith("```"):
            return ToolCall(None, f"unterminated {self.OPEN} block before {self.OUTPUT}", call)
        code = closed[:-3]
        if not code.strip():
            return ToolCall(None, "empty tool call: no code", call)
        return ToolCall(code.strip("\n") + "\n", text=call)

    def observation_text(self, output: str) -> str:
        # ToRA's rendering: "```output\n18\n```" for a program that printed "18\n" (its
        # trailing newlines are the block's, tests/data/tora_gsm8k_outputs_slice.jsonl)
        return f"\n{output.rstrip(chr(10))}\n```\n"


FORMATS: dict[str, type[ToolFormat]] = {
    "llama3": Llama3Format,
    "llama4": Llama4Format,
    "qwen": QwenFormat,
    "markdown": MarkdownFormat,
}
TOOL_FORMATS: tuple[str, ...] = ("auto", *FORMATS)
# What "auto" finds (detect_format), for the messages that say why it found nothing.
KNOWN_FAMILIES = (
    "<|python_tag|> in the vocabulary: llama3 (Llama-3.1), <|python_start|>: llama4 "
    "(Llama-4), a chat template that writes <tool_call>: qwen"
)


def detect_format(tokenizer: Any) -> str | None:
    """The format of ``tokenizer``'s model family: "llama3" when ``<|python_tag|>`` is one of
    its tokens, "llama4" when ``<|python_start|>`` is, "qwen" when its chat template renders
    ``<tool_call>``; None for any other (a base model's tokenizer: name the format, e.g.
    "markdown", in the recipe)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    if Llama3Format.START in vocab or Llama3Format.START in template:
        return "llama3"
    if Llama4Format.START in vocab or Llama4Format.START in template:
        return "llama4"
    if QwenFormat.START in template:
        return "qwen"
    return None


def format_for(name: str, tokenizer: Any = None, tool_name: str = DEFAULT_TOOL_NAME) -> ToolFormat:
    """The format called ``name`` (one of ``TOOL_FORMATS``; "auto" needs ``tokenizer`` and
    refuses one of no known family)."""
    if name == "auto":
        if tokenizer is None:
            raise ValueError("tool_format 'auto' needs the tokenizer to detect the format")
        detected = detect_format(tokenizer)
        if detected is None:
            raise ValueError(
                f"tool_format 'auto': the tokenizer is of no model family with a known tool "
                f"format ({KNOWN_FAMILIES}); name one of {', '.join(FORMATS)}"
            )
        name = detected
    if name not in FORMATS:
        raise ValueError(f"unknown tool format {name!r}; known: {', '.join(TOOL_FORMATS)}")
    return FORMATS[name](tool_name)
