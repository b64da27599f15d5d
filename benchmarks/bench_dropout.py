"""Benchmark of functe's dropout (counter-based mask), forward+backward, on the CPU vs torch eager and
torch.compile; with CUDA also the Triton kernel's bandwidth.

Run from the repository root:
`python -m benchmarks.bench_dropout [--dtype float32] [--ops NAME ...] [--no-compile]`.
"""

from ._act_cases import DROPOUT, main

if __name__ == "__main__":
    main(DROPOUT, __doc__)
