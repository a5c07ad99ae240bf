"""The Python API behind `kvf.evaluate`: score run files into a DataFrame."""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import pandas as pd

from kvf.errors import KvfError, errors_name_arguments
from kvf.eval.report import evaluate


@errors_name_arguments()
def evaluate_runs(run_files, out=None, complete_only: bool = False, exclude_questions=None) -> pd.DataFrame:
    """The summary `kvf eval` prints, as a DataFrame (its scored records in .attrs["records"]).
    With `out`, the tables and plots are written there too. exclude_questions: question ids left out (e.g. the
    split a method was tuned on), as a list or a file of one id per line (`kvf eval --exclude-questions`)."""
    files = [run_files] if isinstance(run_files, (str, Path)) else run_files
    if not isinstance(files, (list, tuple)) or not all(isinstance(f, (str, Path)) for f in files):
        raise KvfError(f"run_files={run_files!r}: pass a run file's path, or a list of them (folders and globs too)")
    files = [Path(f) for f in files]
    if not isinstance(complete_only, bool):   # "no" would be true
        raise KvfError(f"complete_only={complete_only!r}: pass True or False")
    if out is not None and not isinstance(out, (str, Path)):
        raise KvfError(f"out={out!r}: pass a folder's path for the tables and plots, or leave it out")
    # without `out`, the files evaluate writes go to a folder that is removed after
    with contextlib.nullcontext(out) if out is not None else tempfile.TemporaryDirectory(prefix="kvf-evaluate-") as where:
        return evaluate(files, Path(where), complete_only, command="kvf.evaluate(...)",
                        exclude_questions=exclude_questions, exclude_flag="exclude_questions")
