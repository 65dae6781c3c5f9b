"""Training: the shard loader, typed stage settings, the Stepper seam, the one training loop, pretraining and
Alpaca fine-tuning."""
