"""Runs the Python blocks of README.md and docs/*.md as tests, through Sybil's pytest integration.

``python -m pytest`` collects them with the tests (``testpaths`` in pyproject.toml): every
```` ```python ```` block of a page runs, in order, in one namespace per page, so a later block uses
what an earlier one defined. A page sets up what its blocks take as given (a model, a loader) in
``<!-- invisible-code-block: python ... -->`` comments, and a block that cannot run here (it needs
a GPU, several processes or a cluster) is preceded by ``<!-- skip: next "the reason" -->``, which
pytest reports as a skip with that reason. Each page runs in a fresh temporary directory (files a
block writes, such as checkpoints, go there), with one intra-op thread as in tests/conftest.py and
one device per Lightning Trainer or Fabric;
afterwards the environment variables, the working directory and the thread count are restored
and a process group the page started (a one-process gloo group) is destroyed. Pages start one only
where none exists.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent

try:
    from sybil import Sybil
    from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser
except ImportError:  # the test extra installs it; without it the pages are reported as skipped, not passed
    Sybil = None


def _setup(namespace: dict[str, Any]) -> None:
    import torch

    had_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    namespace["__doc_state"] = (os.getcwd(), torch.get_num_threads(), dict(os.environ), had_group)
    tmp = tempfile.mkdtemp(prefix="qmuon_docs_")
    namespace["__doc_tmp"] = tmp
    namespace["REPO"] = REPO  # the repository root, for blocks that read a file shipped in it
    torch.set_num_threads(1)
    # One device per Trainer / Fabric the pages build (they leave devices="auto"): on a machine with
    # several GPUs Lightning would start the other ranks by re-running this pytest command.
    os.environ["PL_TRAINER_DEVICES"] = "1"
    os.environ["LT_DEVICES"] = "1"
    os.chdir(tmp)


def _teardown(namespace: dict[str, Any]) -> None:
    import torch

    import sys

    if "accelerate" in sys.modules:  # Accelerate keeps one process-wide state: the next page builds its own
        from accelerate.state import AcceleratorState

        AcceleratorState._reset_state(reset_partial_state=True)
    cwd, threads, environ, had_group = namespace["__doc_state"]
    if not had_group and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # a page that started a one-process group leaves none behind
    os.chdir(cwd)
    torch.set_num_threads(threads)
    os.environ.clear()
    os.environ.update(environ)
    shutil.rmtree(namespace["__doc_tmp"], ignore_errors=True)


if Sybil is not None:
    pytest_collect_file = Sybil(
        parsers=[PythonCodeBlockParser(), SkipParser()],
        patterns=["README.md", "docs/*.md"],
        excludes=["*/README.md"],  # only the top-level README (a pattern matches from the right)
        setup=_setup,
        teardown=_teardown,
    ).pytest()
else:
    import pytest

    class _NoSybil(pytest.Item):
        def runtest(self) -> None:
            pytest.skip("sybil is not installed, so the Python blocks of this page did not run: pip install -e '.[test]'")

    class _Page(pytest.File):
        def collect(self):
            yield _NoSybil.from_parent(self, name="python-blocks")

    def pytest_collect_file(file_path: Path, parent: Any) -> Any:
        rel = file_path.relative_to(REPO) if file_path.is_relative_to(REPO) else None
        if rel is not None and file_path.suffix == ".md" and (rel == Path("README.md") or rel.parent == Path("docs")):
            return _Page.from_parent(parent, path=file_path)
        return None
