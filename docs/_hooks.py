"""mkdocs hook: lets mkdocstrings see `introspect/` as the subpackage `attnaux.introspect`.

The wheel maps `src/attnaux` and `introspect/` into one package; mkdocstrings reads source files,
so this stages the same layout (symlinks) in a temporary folder and puts it first on `sys.path`,
where the Python handler looks for packages.
"""

import atexit
import pathlib
import shutil
import sys
import tempfile

from mkdocs.plugins import event_priority

ROOT = pathlib.Path(__file__).resolve().parent.parent


@event_priority(100)  # before mkdocstrings creates its Python handler (which copies sys.path)
def on_config(config):
    staged = pathlib.Path(tempfile.mkdtemp(prefix="attnaux-docs-"))
    atexit.register(shutil.rmtree, staged, ignore_errors=True)
    package = staged / "attnaux"
    package.mkdir()
    for entry in (ROOT / "src" / "attnaux").iterdir():
        (package / entry.name).symlink_to(entry)
    (package / "introspect").symlink_to(ROOT / "introspect")
    sys.path.insert(0, str(staged))
    return config
