"""Triton kernels, each beside a torch reference; imported as `radixserve_kernels`."""
