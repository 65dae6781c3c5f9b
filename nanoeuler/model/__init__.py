"""The transformer: config, layer forward/backward pairs, the model, and the gradient check."""
