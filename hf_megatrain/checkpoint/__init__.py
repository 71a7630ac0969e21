"""Loading models, HF-format saves, optimizer state, local hub."""
