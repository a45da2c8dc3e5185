"""Figures drawn from result tables (never from live tensors)."""
