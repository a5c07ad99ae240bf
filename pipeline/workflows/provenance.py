"""What produced a record or a results file: kvf's version, the git commit, the device, and the versions of
the libraries that compute an answer (torch's kernels, transformers' loading of the model)."""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from kvf.version import __version__

REPO_ROOT = Path(__file__).resolve().parents[2]  # pipeline/workflows/provenance.py -> the kvf package root


@functools.lru_cache(maxsize=1)
def git_commit() -> str | None:
    """The checkout's commit, or None outside a git checkout. '-dirty' when tracked files other than
    results/ changed: results/ holds outputs, which a re-scoring rewrites while it runs."""
    git = shutil.which("git")
    if git is None or not (REPO_ROOT / ".git").exists():
        return None
    try:
        commit = subprocess.run([git, "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                                timeout=10).stdout.strip()
        dirty = subprocess.run([git, "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)results"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("-dirty" if dirty else "")) or None


# the libraries whose release can change a number kvf records: torch computes it, transformers reads the model
RECORDED_LIBRARIES = ("torch", "transformers")


@functools.lru_cache(maxsize=1)
def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version
    found = {}
    for name in RECORDED_LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            continue
    return found


def provenance(device: str) -> dict:
    return {"kvf_version": __version__, "commit": git_commit(), "device": device, "libraries": library_versions()}
