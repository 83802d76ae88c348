"""The command lines: `python -m attnaux` (the demonstration) and its `--help`."""

import pathlib
import re
import subprocess
import sys

import numpy as np

from attnaux import introspect as ai


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "attnaux", *args], capture_output=True,
                          text=True, timeout=600, cwd=cwd)


def test_help_explains_every_command():
    result = run("--help")
    assert result.returncode == 0
    assert "demo" in result.stdout and "bench" in result.stdout
    for command in ("demo", "bench"):
        result = run(command, "--help")
        assert result.returncode == 0 and "--" in result.stdout


def test_demo_trains_saves_and_reports(tmp_path):
    result = run("--steps", "4", "--out-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    ran = result.stdout.split("backend that ran: ")[1].split()[0]
    assert ran in ("flash", "probs", "small_seq", "reference")
    assert "layer0" in result.stdout and "nonfinite" in result.stdout  # the health table
    collection = ai.load(tmp_path / "attnaux-demo-aux.npz")
    assert sorted(collection) == ["layer0", "layer1"]
    assert np.all(np.isfinite(np.asarray(collection["layer0"].lse)))
    assert (tmp_path / "attnaux-demo-heads.png").stat().st_size > 1000
    assert "training [" in result.stderr  # progress


def test_bad_option_is_a_clear_error():
    result = run("demo", "--batch", "0")
    assert result.returncode == 2 and "positive integer" in result.stderr


EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_decoder.py"


def test_example_is_self_contained_and_trains(tmp_path):
    """`examples/train_decoder.py` is a copyable script on the public API: it imports no private
    module of attnaux, and runs as it is outside the repository."""
    source = EXAMPLE.read_text()
    assert not re.search(r"attnaux\._|attnaux\.\w+\._", source), "imports a private module"
    copy = tmp_path / "train.py"
    copy.write_text(source)
    result = subprocess.run(
        [sys.executable, str(copy), "--steps", "3", "--save", str(tmp_path / "aux.npz")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert sorted(ai.load(tmp_path / "aux.npz")) == ["layer0", "layer1"]
