"""Shared fixtures: deterministic seeds and the backend parametrisation.

Tests that take the ``backend`` fixture run once with the PyTorch twins and
once with the Triton kernels through Triton's interpreter, so every kernel is
checked on a CPU-only machine. With a GPU, ``FUNCTE_TEST_CUDA=1`` moves the
tests that take the ``device`` fixture to CUDA (instead of the CPU; run the suite
twice for both) and runs the ``interpret`` parametrisation as ``auto`` (the
compiled kernels on CUDA tensors), and the CUDA-only tests run whenever a GPU is
present.

Hypothesis draws the same examples on every run (profile ``deterministic``), so
a test run, CI's included, passes or fails the same way each time. To search
for new failing examples, run with ``--hypothesis-profile=explore`` (fresh
random examples on every run); pin what it finds with ``@example``.
"""

import os

import pytest
import torch
from hypothesis import settings

import functe

settings.register_profile("deterministic", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("deterministic")

_BACKENDS = ["torch", "interpret"]


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _cuda_tests() -> bool:
    return os.environ.get("FUNCTE_TEST_CUDA") == "1" and torch.cuda.is_available()


@pytest.fixture(params=_BACKENDS)
def backend(request):
    # With FUNCTE_TEST_CUDA=1 the Triton side runs compiled ("auto": CUDA tensors launch the GPU
    # kernels), which is what a GPU run is for; the interpreter is the CPU suite's stand-in for it.
    name = "auto" if request.param == "interpret" and _cuda_tests() else request.param
    with functe.use_backend(name):
        yield request.param


@pytest.fixture
def device():
    return "cuda" if _cuda_tests() else "cpu"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
