"""The prompt formats training renders rows in and a checkpoint records (``slimtune_format.json``): the
Alpaca prompts and the chat template used when the tokenizer has none. Plain text, no imports: the data
reader, the checkpoint's documents and generation all read them from here.

Example: ``alpaca_prompt("Summarize.", extra="a long text")``
"""

from __future__ import annotations

ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)


# The format chat rows train in when the tokenizer has no chat template, as a Jinja template: saved with
# the checkpoint's tokenizer, so `apply_chat_template` reproduces the training token ids.
FALLBACK_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def alpaca_prompt(instruction: str, extra: str = "") -> str:
    """The Alpaca prompt training uses (and ``slimtune generate`` for models trained on alpaca rows).

    Example: ``alpaca_prompt("Name a color.").endswith("### Response:\\n")``"""
    return ALPACA_PROMPT_WITH_INPUT.format(instruction=instruction, input=extra) if extra else ALPACA_PROMPT.format(instruction=instruction)
