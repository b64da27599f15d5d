"""The README's and docs/' code runs, and the README's first two lines are the set-up and test commands CI uses."""

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


DOCS = sorted((README.parent / "docs").glob("*.md"))


def test_docs_python_blocks_run(capsys):
    # Each file's ```python blocks run in order in one namespace (signature listings are ```text).
    ran = 0
    for doc in DOCS:
        namespace: dict = {}
        for block in re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S):
            exec(compile(block, str(doc), "exec"), namespace)
            ran += 1
    assert ran >= 5
    assert "forward_linear_bias_add" in capsys.readouterr().out  # fusion.md's explain printed its plans
