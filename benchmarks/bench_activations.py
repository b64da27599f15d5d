"""Benchmark of functe's activation ops, forward+backward, on the CPU vs torch eager and torch.compile;
with CUDA also the Triton kernels' bandwidth.

Run from the repository root:
`python -m benchmarks.bench_activations [--dtype float32] [--ops NAME ...] [--no-compile]`.
"""

from ._act_cases import ACTIVATIONS, main

if __name__ == "__main__":
    main(ACTIVATIONS, __doc__)
