"""Run llama.cpp's `convert_hf_to_gguf.py` on our HF export, naming the GPT-2 pre-tokenizer for it.

    cd <llama.cpp source> && python <this repo>/bench/llama_gguf.py hf-model --outtype f32 --outfile m-f32.gguf

The converter recognises a BPE tokenizer's pre-tokenizer by hashing how it splits a fixed text, and ours
(GPT-2's split pattern, our own merges) is not in its table, so it stops. Our export splits exactly as
GPT-2 does, so this names it `gpt-2` and runs the converter unchanged. The converter also imports
sentencepiece before it tries a BPE vocabulary: install it beside (`pip install --target DIR sentencepiece`
and put DIR on PYTHONPATH). Run from llama.cpp's source folder (it imports `gguf-py` and `conversion/`).
"""

import runpy
import sys

sys.path[:0] = ["gguf-py", "."]
import conversion.base as base  # noqa: E402  (llama.cpp's converter package, from the current folder)

for cls in vars(base).values():
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
runpy.run_path("convert_hf_to_gguf.py", run_name="__main__")
