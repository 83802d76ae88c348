"""The documentation site builds with every warning treated as an error."""

import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
def test_docs_build_strict(tmp_path):
    if shutil.which("mkdocs") is None and subprocess.run(
        [sys.executable, "-c", "import mkdocs"], capture_output=True
    ).returncode:
        pytest.fail("mkdocs is not installed: `pip install '.[test]'` installs it")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (tmp_path / "site" / "api" / "index.html").exists()
