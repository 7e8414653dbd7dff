"""The policy's turn as the loop's `ModelReply`: an OpenAI message, or raw generated text.

A trainer that generates with vLLM/SGLang in token-in-token-out mode has no tool parser
in the way: it hands over the decoded text, and the tool calls are inside it in the
model's own format (Hermes/Qwen ``<tool_call>``, Qwen3-Coder's XML, Mistral's
``[TOOL_CALLS]``, Llama 3's JSON: ``FORMATS``). The text the model generated is kept as
is: `TextReply.as_message()` puts the raw text back into the history.

The reading itself is tasks/replies.py, THE reader of model replies (the agent loop's
too), with one rule for malformed input; this module is the RL environment's name for it.
"""

from __future__ import annotations

from tasks.replies import FORMATS as FORMATS
from tasks.replies import MAX_ACTION_CHARS as MAX_ACTION_CHARS
from tasks.replies import ActionError as ActionError
from tasks.replies import TextReply as TextReply
from tasks.replies import ToolCallFormat as ToolCallFormat
from tasks.replies import parse_text_tool_calls as parse_text_tool_calls
from tasks.replies import reply_from_action as reply_from_action
