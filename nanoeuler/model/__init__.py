"""The reference transformer: config, layer forward/backward pairs, and the model."""
