"""Exports of trained checkpoints to other ecosystems."""
