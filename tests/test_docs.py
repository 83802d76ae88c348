"""The documentation: the site builds with every warning treated as an error; every ```python
example of docs/ and the README runs as pasted (one namespace per page, blocks in order; a block
whose first line starts with `# GPU only` is skipped without a GPU); the files, modules and
install commands the pages name exist and work from a checkout; edit links point to `main`."""

import pathlib
import re
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


# ----------------------------------------------------------------------------- examples run
# Every ```python block of a page runs as pasted, top to bottom, in one namespace per page (a
# page's blocks may build on its earlier ones, like a notebook). A block whose first line is a
# comment starting with "# GPU only" needs an NVIDIA GPU and is skipped without one. Other fences
# (bash, text, plain ```) are not run.
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
GPU_ONLY = "# gpu only"


def python_blocks(page: pathlib.Path) -> list[tuple[int, str]]:
    """The ```python blocks of a page as (line of the block's first code line, code)."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in FENCE.finditer(text)]


def _page_id(page: pathlib.Path) -> str:
    return str(page.relative_to(ROOT))


def _has_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
def test_the_pages_with_examples_are_found():
    found = {_page_id(p) for p in PAGES if python_blocks(p)}
    assert {"README.md", "docs/quickstart.md", "docs/softmax.md", "docs/introspect.md",
            "docs/nn.md", "docs/backends.md"} <= found, found


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=_page_id)
def test_page_examples_run_as_pasted(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # examples may write files (saved aux, plots)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    namespace: dict = {"__name__": "__docs__"}
    skipped = []
    for line, code in python_blocks(page):
        if code.lstrip().lower().startswith(GPU_ONLY) and not _has_gpu():
            skipped.append(line)
            continue
        # Padded so that tracebacks give the line numbers of the page itself.
        exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)
    if skipped:
        pytest.skip(f"GPU-only blocks at lines {skipped} skipped (no GPU); the rest ran")


# ----------------------------------------------------------------------------- references
DOC_FILES = [p for p in PAGES if p.name != "kernel_abi.md"] + [ROOT / "mkdocs.yml"]


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
@pytest.mark.parametrize("page", DOC_FILES, ids=_page_id)
def test_referenced_files_and_modules_exist(page):
    text = page.read_text()
    missing = []
    # Relative links and `path/like/this.md` mentions name files of the repository.
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if "://" not in target and not (page.parent / target).exists():
            missing.append(target)
    for target in re.findall(r"`([\w./-]+/[\w.-]+\.(?:md|py|cc|cu|h|txt|toml))`", text):
        if not target.startswith("/") and not (ROOT / target).exists():
            missing.append(target)
    # attnaux._private modules: a source file, a subpackage or a compiled extension.
    cmake = (ROOT / "CMakeLists.txt").read_text()
    for module in re.findall(r"\battnaux\.(_\w+)", text):
        src = ROOT / "src" / "attnaux"
        if not ((src / f"{module}.py").exists() or (src / module).is_dir()
                or re.search(rf"add_module\({module}\b", cmake)):
            missing.append(f"attnaux.{module}")
    assert not missing, f"{_page_id(page)} refers to what the repository does not have: {missing}"


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
def test_install_commands_work_from_a_checkout():
    # The package is not on an index: extras are installed from the checkout, `pip install ".[x]"`.
    for page in PAGES:
        bad = re.findall(r"pip install[^`\n]*?\battnaux\[\w+\]", page.read_text())
        assert not bad, f"{_page_id(page)}: {bad}; use `pip install \".[extra]\"` from the checkout"


@pytest.mark.skipif(not (ROOT / "mkdocs.yml").exists(), reason="not run from a source checkout")
def test_mkdocs_edit_links_point_to_main():
    import yaml

    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    # Without edit_uri, mkdocs links a GitHub repo_url's pages to edit/master/docs/.
    assert config.get("repo_url", "").startswith("https://github.com/")
    assert config.get("edit_uri", "").rstrip("/") in {"edit/main/docs", "blob/main/docs"}, config


def test_no_merge_conflict_markers_are_left():
    """No source, build or documentation file keeps a line of a merge conflict."""
    suffixes = {".md", ".py", ".h", ".cc", ".cu", ".cuh", ".txt", ".toml", ".yml"}
    markers = ("<<<<<<< ", ">>>>>>> ")
    found = []
    for path in ROOT.rglob("*"):
        if path.suffix not in suffixes or any(p in path.parts for p in ("build", ".git", "site")):
            continue
        try:
            lines = path.read_text().splitlines()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{path.relative_to(ROOT)}:{n}" for n, line in enumerate(lines, 1)
                  if line.startswith(markers)]
    assert not found, found
