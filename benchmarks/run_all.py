"""Run every benchmark script in turn with its default options (CPU: tens of minutes on 2 cores).

Run: ``python -m benchmarks.run_all [NAME ...]`` (names like ``norms`` or ``bench_norms``; default: all).
Each script prints its own tables; paste them, with the machine line, into docs/benchmarks.md.
"""

from __future__ import annotations

import subprocess
import sys

SCRIPTS = [
    "bench_overhead",
    "bench_launch",
    "bench_activations",
    "bench_norms",
    "bench_dropout",
    "bench_fp8",
    "bench_block",
    "bench_gemm",
    "bench_fuse",
    "bench_parallel",
    "bench_serving",
]


def main(argv: list[str]) -> int:
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        print(f"benchmarks: {', '.join(SCRIPTS)}")
        return 0
    wanted = [a if a.startswith("bench_") else f"bench_{a}" for a in argv]
    unknown = sorted(set(wanted) - set(SCRIPTS))
    if unknown:
        print(f"unknown benchmarks {unknown}; choose from {SCRIPTS}", file=sys.stderr)
        return 2
    failed = []
    for name in wanted or SCRIPTS:
        print(f"\n===== benchmarks.{name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"benchmarks.{name}"]).returncode:
            failed.append(name)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
