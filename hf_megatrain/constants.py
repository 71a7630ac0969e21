"""Constants shared by data loading, preflight checks and the engine.

It imports nothing of the package, so any module can take a constant from here without
pulling in the engine or the checkpoint code.
"""

# The label of a token with nothing to learn: what HF's causal-LM loss (and torch's cross-entropy,
# by default) leaves out of the loss.
IGNORE_INDEX = -100
