"""headlab: experiment runner for attention-head interpretability."""

__version__ = "0.1.0"
