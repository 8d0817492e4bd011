"""Quantized linear layers (one class per weight format), chosen at load time."""
