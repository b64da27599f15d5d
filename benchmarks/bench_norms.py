"""Benchmark of functe's norms (LayerNorm, RMSNorm, L2), forward+backward, on the CPU vs torch eager
and torch.compile; with CUDA also the Triton kernels' bandwidth.

Run from the repository root:
`python -m benchmarks.bench_norms [--dtype float32] [--ops NAME ...] [--no-compile]`.
"""

from ._act_cases import NORMS, main

if __name__ == "__main__":
    main(NORMS, __doc__)
