"""Inference: the sampling rules (`sampling`), the reference generator (`generate`), the decode engine
(`engine.DecodeEngine`) on its NumPy and CUDA backends (`cpu`, `gpu`), `sample` and `chat`."""
