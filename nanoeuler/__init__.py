"""nanoeuler: a GPT-2-class language model written from scratch on NumPy and CuPy.

A residual block `x = x + f(x)` is one forward-Euler step of `dx/dt = f(x)`; hence the name.
"""

__version__ = "0.1.0"
