"""The command lines: `python -m attnaux` (the demonstration) and its `--help`."""

import fnmatch
import importlib.util
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

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
    assert "training batch: loss" in result.stdout and "evaluation batch" in result.stdout


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


def _train_and_log(module, threshold):
    config = module.DemoConfig(steps=2, log_every=1, clip_threshold=threshold)
    lines = []
    _, history = module.train(config, progress=False, log=lines.append)
    return config, history, lines


def _load_example():
    spec = importlib.util.spec_from_file_location("train_decoder_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("where", ["demo", "example"])
def test_training_log_says_which_batch_each_figure_is_from(where):
    """QK-clip acts on the training batch's max logits, so "heads clipped" is logged next to
    those (before the clip); the evaluation batch's figures are logged under their own label."""
    import attnaux.__main__ as demo

    module = demo if where == "demo" else _load_example()
    threshold = 1.3  # about the max logits of the untrained decoder: some heads above it
    config, history, lines = _train_and_log(module, threshold)
    assert len(history) == len(lines) == 2
    clipped_any = 0
    for entry, text in zip(history, lines):
        train_max = np.stack([entry[f"train/layer{i}/max_logit"] for i in range(config.depth)])
        clipped = int(np.sum(train_max > threshold))
        assert entry["train/clipped_heads"] == clipped
        assert entry["train/heads"] == train_max.size == config.depth * config.num_heads
        clipped_any += clipped
        first, *rest = text.splitlines()
        assert "training batch" in first
        assert f"heads clipped {clipped} of {train_max.size}" in first
        assert f"above {threshold:g} before the clip" in first
        for i in range(config.depth):  # the training batch's figures follow that line
            logged = re.findall(r"-?\d+\.\d+", rest[i].split("[")[1])
            np.testing.assert_allclose(np.array(logged, float), train_max[i], atol=0.006)
        assert rest[config.depth].lstrip().startswith("evaluation batch, after the step")
        assert f"{entry['eval/accuracy']:.2f}" in rest[config.depth]
        for i in range(config.depth):
            assert "entropy" in rest[config.depth + 1 + i]
    assert clipped_any > 0


def test_demo_and_example_outputs_are_gitignored():
    gitignore = pathlib.Path(__file__).resolve().parents[1] / ".gitignore"
    if not gitignore.exists():
        pytest.skip("not a git checkout")
    patterns = [line.strip().lstrip("/") for line in gitignore.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for name in ("attnaux-demo-aux.npz", "attnaux-demo-heads.png", "decoder-aux.npz"):
        assert any(fnmatch.fnmatch(name, pattern) for pattern in patterns), name
