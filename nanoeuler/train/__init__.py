"""Training: the shard loader, typed stage settings, the Stepper seam, the one training loop, pretraining,
Alpaca fine-tuning and DPO, and what a run measures and draws (validation metrics, loss plots), which
evaluation reuses."""
