"""The README's code runs, and its first two lines are the set-up and test commands CI uses."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_starts_with_the_two_commands():
    first, second = README.read_text().splitlines()[:2]
    assert "pip install torch==2.13.0" in first and first.endswith("python -m functe.demo")
    assert second.startswith(".venv/bin/python -m pytest")


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks
    for block in blocks:
        namespace: dict = {}
        exec(compile(block, str(README), "exec"), namespace)
        if "per_example" in namespace:
            assert namespace["per_example"]["w1"].shape == (16, 64, 32)
