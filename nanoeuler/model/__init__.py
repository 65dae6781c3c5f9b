"""The reference transformer: config, layer forward/backward pairs, the model and DPO's loss, and
`dispatch`, which picks the layer functions (the reference or the GPU kernels) for the arrays at hand."""
