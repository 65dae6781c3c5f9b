"""Training: the shard loader, the one training loop, pretraining and Alpaca fine-tuning."""
