"""kvf: reuse precomputed chunk KV caches to make RAG prefill cheap, and measure what each fusion method keeps.

The Python API, for notebooks:

    import kvf
    ws = kvf.open_workspace("workspace")                       # built by `kvf build-cache my_docs/`
    answer = ws.answer("Who founded X?", method="cacheblend", ratio=0.15)
    answer.text, answer.timings["first_token"], answer.recomputed_tokens
    hits = ws.search("Who founded X?", top_k=3)               # each: chunk_id, score, doc_id, text
    summary = kvf.evaluate(["runs/a.jsonl", "runs/b.jsonl"])  # a pandas DataFrame, as `kvf eval` prints
"""
from kvf.errors import KvfError  # noqa: F401

from kvf.version import __version__  # noqa: F401


def open_workspace(path, model: str | None = None, device: str = "cpu", dtype: str | None = None):
    """A built workspace, ready to answer questions by fusing its stored chunk KVs (see kvf.pipeline.workflows.api).
    dtype: the model's compute dtype (default float32 on cpu, bfloat16 on cuda), as `kvf run --dtype`."""
    from kvf.pipeline.workflows.api import WorkspaceSession
    return WorkspaceSession(path, model=model, device=device, dtype=dtype)


def evaluate(run_files, out=None, complete_only: bool = False, exclude_questions=None):
    """Score run files (as `kvf eval`): the summary DataFrame; with `out`, also writes tables and plots there.
    exclude_questions: question ids to leave out (a list, or a file of one id per line), e.g. a dev split."""
    from kvf.eval.api import evaluate_runs
    return evaluate_runs(run_files, out, complete_only, exclude_questions)
