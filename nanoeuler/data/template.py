"""The Stanford Alpaca instruction prompt: the format SFT trains on (`train.sft`), the preference pairs'
prompts are written in (`data.prefs`), and `nanoeuler chat` and the server wrap every instruction in, so a
chat model sees at inference exactly what it learned from. It belongs to the data, as the Alpaca records'
text form, so the stages that train on it and the ones that serve it share it from below.

    >>> render_prompt("Name a color.").splitlines()[-4:]
    ['### Instruction:', 'Name a color.', '', '### Response:']
"""

from __future__ import annotations

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)


def render_prompt(instruction: str, input: str = "") -> str:
    """The prompt text for one instruction (the template with or without its input block)."""
    if input and input.strip():
        return PROMPT_WITH_INPUT.format(instruction=instruction, input=input)
    return PROMPT_NO_INPUT.format(instruction=instruction)
