"""Tensor parallelism's communication: the rank group and its collectives."""
