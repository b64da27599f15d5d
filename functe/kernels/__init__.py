"""Triton kernels and their PyTorch twins.

One module per op family. Each holds private ``_*_kernel`` Triton kernels, host
launchers that allocate their own outputs (never writing their inputs), a
``*_ref`` PyTorch twin with the launcher's exact signature, and the
:class:`functe._kernel.Kernel` objects that dispatch between them.
"""
