"""`kvf ask`: one question from a workspace with each method, without a questions file or a run file. Its
answers are kvf run's for the same question (same retrieval, same requests), and its refusals name its flags."""
import json
import re

from conftest import model_of, run_cli


def first_question(built) -> str:
    return json.loads((built / "data" / "questions.jsonl").read_text().splitlines()[0])["question"]


def test_ask_gives_the_answers_kvf_run_gives_for_the_question(tiny_built, tmp_path, capsys, monkeypatch):
    """The oracle is kvf run: a questions file of that one question, the same methods, ratios and retrieval.
    Each (method, ratio) has kvf run's answer, chunks and recomputed tokens; the documents ask names are those
    of the chunks in the prompt."""
    question, ws, model = first_question(tiny_built), tiny_built / "ws", model_of(tiny_built)
    same = ["-w", ws, "-m", "full,reuse,cacheblend", "-r", "0.15,0.5", "-k", "3", "--max-new-tokens", "4",
            "--model", model]
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question": question}) + "\n")
    code, _, err = run_cli(["run", "-q", questions, *same, "-o", tmp_path / "r.jsonl", "--no-show-answers",
                            "--no-warmup"], capsys, monkeypatch)
    assert code == 0, err
    code, out, err = run_cli(["ask", question, *same, "--json"], capsys, monkeypatch)
    assert code == 0, err
    asked = json.loads(out)
    ran = [json.loads(line) for line in (tmp_path / "r.jsonl").read_text().splitlines()]

    def by_request(records):
        return {(r["method"], r["settings"]["ratio"]): (r["answer"], r["chunk_ids"], r["recomputed_tokens"],
                                                        r["chunk_tokens"]) for r in records}
    assert len(asked) == len(ran) == 4   # full and reuse once each (no ratio), cacheblend at both ratios
    assert by_request(asked) == by_request(ran)
    cacheblend = [r for r in asked if r["method"] == "cacheblend"]
    assert [r["recomputed_tokens"] for r in cacheblend] != [0, 0] and cacheblend[0]["recomputed_tokens"] < \
        cacheblend[1]["recomputed_tokens"]   # 0.15 of the chunk tokens, then 0.5
    doc_of = {cid: doc for doc, cids in json.loads((ws / "doc_chunks.json").read_text()).items() for cid in cids}
    assert asked[0]["doc_ids"] == [doc_of[cid] for cid in asked[0]["chunk_ids"]]


def test_ask_from_named_documents_shows_what_each_method_keeps_of_full(tiny_built, capsys, monkeypatch):
    """--documents answers from their chunks, in order; the table scores each answer against --gold and against
    full prefill's answer, and names the prompt's documents."""
    question, ws = first_question(tiny_built), tiny_built / "ws"
    docs = json.loads((ws / "doc_chunks.json").read_text())
    first, second = list(docs)[:2]
    args = ["ask", question, "-w", ws, "-m", "full,reuse", "--documents", f"{first},{second}", "--max-new-tokens", "4",
            "--model", model_of(tiny_built)]
    code, out, err = run_cli([*args, "--json"], capsys, monkeypatch)
    assert code == 0, err
    full, reuse = json.loads(out)
    assert full["chunk_ids"] == reuse["chunk_ids"] == docs[first] + docs[second]
    assert full["recomputed_tokens"] == full["chunk_tokens"] and reuse["recomputed_tokens"] == 0
    monkeypatch.setenv("COLUMNS", "400")   # the caption on one line
    code, out, err = run_cli([*args, "--gold", full["answer"]], capsys, monkeypatch)
    assert code == 0, err
    from kvf.eval.metrics import token_f1
    full_row = next(line for line in out.splitlines() if line.startswith("│ full "))
    reuse_row = next(line for line in out.splitlines() if line.startswith("│ reuse "))
    assert [cell.strip() for cell in full_row.split("│")[3:5]] == ["1.00", "1.00"]   # gold is full's answer here
    kept = f"{token_f1(reuse['answer'], [full['answer']]):.2f}"
    assert [cell.strip() for cell in reuse_row.split("│")[3:5]] == [kept, kept]
    # each document once, with its title and how many of its chunks are in the prompt
    said = [re.escape(d) + "[^,]*" + (f" \\({len(docs[d])} chunks\\)" if len(docs[d]) > 1 else "") for d in (first, second)]
    assert re.search(f"context \\(the documents named\\): {said[0]}, {said[1]} ", out), out
