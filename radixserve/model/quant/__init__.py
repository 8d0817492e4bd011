"""Quantized linear layers (one class per weight format), chosen at load time."""


class QuantizationError(ValueError):
    """A quantization option cannot be honoured for this model or device; names the flag."""
