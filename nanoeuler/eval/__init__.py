"""Evaluation: samples, metrics (validation loss and bits per byte by `train.metrics`), HellaSwag, the
report's pages and loss plots (`train.plots`), experiments compared."""
