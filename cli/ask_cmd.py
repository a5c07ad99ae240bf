"""`kvf ask`: answer one question from a built workspace with each method, without a questions file or a run file."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from kvf.cli.options import DeviceOption, DtypeOption, S3EndpointOption, WorkspaceModelOption, use_store_flags
from kvf.cli.search_cmd import SearchMode


def ask_command(
    question: Annotated[str, typer.Argument(help="The question, in quotes.")],
    workspace: Annotated[Path, typer.Option("--workspace", "-w", help="Workspace from build-cache.")] = Path("workspace"),
    method: Annotated[str, typer.Option(
        "--method", "-m", "--methods", help="Fusion method(s), comma-separated (see `kvf methods`); an entry "
        "NAME:KNOB=VALUE or NAME:CONFIGURATION (kvfuse:tuned) runs with its own knobs. Add full to see what each "
        "method keeps of full prefill's answer.")] = "cacheblend",
    ratio: Annotated[Optional[str], typer.Option(
        "--ratio", "-r", "--ratios", show_default=False, help="Recompute ratio in [0, 1], a comma list "
        "(0.05,0.15,0.3), or auto (the loading controller) [default: 0.15].")] = None,
    top_k: Annotated[Optional[int], typer.Option(
        "--top-k", "-k", "--k", min=1, show_default=False, help="Chunks retrieved [default: 5].")] = None,
    retriever: Annotated[Optional[SearchMode], typer.Option(
        "--retriever", show_default=False, help="bm25 or dense [default: bm25, or dense in a workspace without a "
        "BM25 index].")] = None,
    documents: Annotated[Optional[str], typer.Option(
        "--documents", "--docs", show_default=False, help="Answer from these documents' chunks, in order, "
        "instead of retrieving: their ids, comma-separated (each hit of `kvf search` shows its doc id).")] = None,
    gold: Annotated[Optional[list[str]], typer.Option(
        "--gold", show_default=False, metavar="ANSWER", help="A right answer, to score each answer against (F1); repeat it for "
        "several.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=1, help="Longest answer to generate.")] = 32,
    model: WorkspaceModelOption = None,
    device: DeviceOption = "cpu",
    dtype: DtypeOption = None,
    s3_endpoint: S3EndpointOption = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print the answers as JSON, one object per method and ratio.")] = False,
):
    """Answer one question from a workspace with each method: the answers, tokens recomputed, TTFT; no run file."""
    import json
    from kvf.cli.run_cmd import check_ratio_used
    from kvf.cli.search_cmd import check_not_a_workspace, doc_label
    from kvf.cli.tables import answers_rows_table
    from kvf.errors import KvfError, flags_kept
    from kvf.pipeline.workflows.api import WorkspaceSession
    from kvf.pipeline.workflows.display import progress_bar
    from kvf.pipeline.workflows.run import parse_methods, parse_ratios
    from kvf.pipeline.workflows.workspace import Workspace
    check_not_a_workspace(question, "question", 'the question: kvf ask "QUESTION"')
    use_store_flags(None, s3_endpoint)   # the workspace's store may be on S3, at a non-AWS endpoint
    entries = parse_methods(method)
    check_ratio_used(ratio, None, entries)
    ratios = [None] if ratio is None else ["auto"] if ratio.strip() == "auto" else parse_ratios(ratio)
    doc_ids = [d.strip() for d in documents.split(",") if d.strip()] if documents is not None else None
    if doc_ids == []:
        raise KvfError(f"--documents {documents!r}: name at least one document id, or leave --documents out to retrieve")
    ws = Workspace(workspace)
    if not ws.manifest_path.is_file():   # before open_workspace's: a file inside a workspace is said as such, as by search
        raise ws.not_built()
    retriever = retriever.value if retriever is not None else None
    with flags_kept(), WorkspaceSession(workspace, model, device, dtype) as session, \
            progress_bar(Console(stderr=True)) as progress:
        requests = planned_requests(entries, ratios, session.session.n_layers)
        task = progress.add_task("answering", total=len(requests))
        answers = []
        for spec, r in requests:   # one request at a time, each timed alone (a long prompt takes a while)
            progress.update(task, description=spec.text + (f" @ {r}" if r is not None else ""))
            answers.append((spec, session.answer(question, method=spec.text, ratio=r, top_k=top_k, retriever=retriever,
                                                 documents=doc_ids, max_new_tokens=max_new_tokens)))
            progress.advance(task)
        retriever = retriever or session.session.ws.default_retriever()
        chunks = session.session.chunks(answers[0][1].chunk_ids, retriever)
    records = [as_record(question, gold or [], spec, answer) for spec, answer in answers]
    if json_out:
        print(json.dumps([{"method": r["method"], "label": r["label"], "settings": r["settings"], "answer": r["answer"],
                           "recomputed_tokens": r["recomputed_tokens"], "chunk_tokens": r["chunk_tokens"],
                           "prompt_tokens": r["prompt_tokens"], "timings": r["timings"], "chunk_ids": r["chunk_ids"],
                           "doc_ids": [c.doc_id for c in chunks]} for r in records]))
        return
    table = answers_rows_table(records, f"kvf ask: {len(records)} answer{'' if len(records) == 1 else 's'} from {workspace}")
    where = "the documents named" if doc_ids else f"{retriever} top {len(chunks)}"
    table.caption.append(f"; TTFT: one request each (`kvf bench` times methods side by side, warmed up and repeated); "
                      f"context ({where}): {context_line([doc_label(c) for c in chunks])}")
    Console().print(table)


def context_line(documents: list[str]) -> str:
    """The documents of the prompt's chunks, in prompt order, a run of chunks of one document said once:
    "d3 · Doc 3 (3 chunks), d7"."""
    runs: list[list] = []
    for doc in documents:
        if runs and runs[-1][0] == doc:
            runs[-1][1] += 1
        else:
            runs.append([doc, 1])
    return ", ".join(doc + (f" ({n} chunks)" if n > 1 else "") for doc, n in runs)


def planned_requests(entries: list[str], ratios: list, n_layers: int) -> list[tuple]:
    """Each (-m entry's MethodSpec, ratio) to answer: every ratio for a method that takes one, once for one that
    does not (full, reuse). Each entry's knobs are checked against the model first, named as the entry (as kvf run
    does), so that a bad one is refused before any answer is computed."""
    from kvf.pipeline.fusion.methods.base import DEFAULT_RATIO
    from kvf.pipeline.workflows.run import parse_method_spec
    requests = []
    for spec in map(parse_method_spec, entries):
        takes_ratio = spec.build(DEFAULT_RATIO, n_layers=n_layers).ratio_is_knob
        requests += [(spec, r) for r in ratios] if takes_ratio else [(spec, None)]
    return requests


def as_record(question: str, gold: list[str], spec, answer) -> dict:
    """A WorkspaceAnswer as the run record fields the answers table reads (kvf run's table, one question)."""
    return {"qid": "ask", "question": question, "gold": gold, "gold_mode": "any", "dataset": "",
            "method": spec.name, "label": spec.label, "settings": answer.settings, "answer": answer.text,
            "recomputed_tokens": answer.recomputed_tokens, "chunk_tokens": answer.chunk_tokens,
            "prompt_tokens": answer.prompt_tokens, "timings": answer.timings, "chunk_ids": answer.chunk_ids}
