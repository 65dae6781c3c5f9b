"""Checks of the implementations against the reference, above everything they check: `gradcheck`
(analytic gradients vs finite differences on the CPU; the GPU's float32 gradients vs float64),
`selftest` and `selftest_bf16` (every GPU kernel vs its NumPy layer), `trainbench` (a timed training
run); `problem` holds the random model and batch the gradient checks share. Nothing in the model, the
kernels or the training loop imports this package."""
