"""The bundled chat format: special tokens and the chat template (one source of truth).

``scripts/make_assets.py`` bakes these into the bundled tokenizer, and the SFT
dataset renders every example through the tokenizer's own chat template, so
training data and inference prompts are formatted identically.

A rendered conversation looks like::

    <|system|>You add numbers.<|end|><|user|>What is 2+3?<|end|><|assistant|>5<|end|>

The assistant's content and the ``<|end|>`` after it are the trained tokens;
``<|end|>`` is also the EOS token, so generation stops at the end of a turn.

A ``tool`` message (a tool's output answering the assistant's call) renders as a user
turn that wraps the output in ``<tool_response>`` tags, as Qwen's templates do, so it
needs no special token of its own (the tokenizer and its ids are unchanged)::

    <|user|><tool_response>{"sum": 5}</tool_response><|end|>
"""

from __future__ import annotations

PAD_TOKEN = "<|pad|>"
SYSTEM_TOKEN = "<|system|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
END_TOKEN = "<|end|>"
EOS_TOKEN = END_TOKEN

# Order fixes their ids (0..4): the pad token is id 0.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, SYSTEM_TOKEN, USER_TOKEN, ASSISTANT_TOKEN, END_TOKEN)

ROLE_SYSTEM = "system"
ROLE_USER = "user"
ROLE_ASSISTANT = "assistant"
ROLE_TOOL = "tool"
ROLES: tuple[str, ...] = (ROLE_SYSTEM, ROLE_USER, ROLE_ASSISTANT, ROLE_TOOL)

# `{% generation %}` marks the trained span, so transformers'
# `apply_chat_template(..., return_assistant_tokens_mask=True)` agrees with our labels.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "<|assistant|>{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}"
    "{%- elif message['role'] == 'user' -%}"
    "<|user|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'system' -%}"
    "<|system|>{{ message['content'] }}<|end|>"
    "{%- elif message['role'] == 'tool' -%}"
    "<|user|><tool_response>{{ message['content'] }}</tool_response><|end|>"
    "{%- else -%}"
    "{{ raise_exception('unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
