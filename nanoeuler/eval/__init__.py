"""Evaluation: validation loss and bits-per-byte, samples, metrics and loss plots."""
