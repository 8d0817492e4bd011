"""radixserve's native code: every C++ CPU kernel (csrc/) and the builder that compiles them
into one extension on first use (extension.py). The Python wrappers live beside their
callers: attention/cpu_fused.py, model/cpu_layer_ops.py, model/quant/block_matmul.py,
model/quant/batch_invariant.py. The Triton kernels (GPU) are the radixserve_kernels package.
"""
