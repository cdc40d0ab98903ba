"""Triton kernels. Imported only when a CUDA path runs, so the package imports without Triton."""
