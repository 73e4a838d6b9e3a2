"""Draft heads (Hydra) trained on the target's own hidden states."""
