"""Inference: KV-cache generation with temperature/top-k/top-p sampling, `sample` and `chat`."""
