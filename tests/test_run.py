"""`kvf run` end to end on the synthetic set: records, sweeps, resuming, and bad input."""
import errno
import io
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from rich.console import Console

from conftest import assert_one_line, model_of, tiny_llama_dir
from kvf.errors import KvfError
from kvf.pipeline.records import RunFile, parse_record
from kvf.pipeline.fusion.controller import DEFAULT_QUALITY_FLOOR
from kvf.pipeline.workflows.run import RunOptions, parse_ratios, run

QUIET = Console(file=io.StringIO())
RECORD_FIELDS = {"qid", "dataset", "method", "settings", "chunk_ids", "question", "answer", "gold",
                 "prompt_tokens", "chunk_tokens", "recomputed_tokens", "timings"}


def run_opts(built, out, **kw):
    """A run of `built`'s dataset (a `tiny_built`) on its workspace, by its model."""
    base = dict(dataset=built / "data", methods=["full", "reuse", "cacheblend"], ratios=[0.0, 0.5, 1.0],
                out=out, workspace=built / "ws", limit=2, max_new_tokens=4, warmup=False,  # timing is not tested here
                model=model_of(built))
    base.update(kw)
    return RunOptions(**base)


def questions_opts(built, questions, out):
    """reuse on a questions file of one's own, retrieved from `built`'s workspace, by its model."""
    return RunOptions(questions=questions, workspace=built / "ws", methods=["reuse"], ratios=[0.0], out=out,
                      max_new_tokens=2, model=model_of(built))


def read_records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sweep_writes_one_record_per_question_method_ratio(tiny_built, tmp_path):
    out = tmp_path / "runs.jsonl"
    run(run_opts(tiny_built, out, compare_full=True), QUIET)
    records = read_records(out)
    # full and reuse ignore the ratio: once each; cacheblend once per ratio -> 5 per question
    assert len(records) == 2 * 5
    for rec in records:
        assert RECORD_FIELDS <= set(rec)
        assert set(rec["timings"]) >= {"load", "select", "recompute", "first_token", "decode"}
        assert rec["timings"]["first_token"] >= rec["timings"]["recompute"]
        assert {"full_answer", "kl_full", "top1_agree_full"} <= set(rec)
    blend = {r["settings"]["ratio"]: r for r in records if r["method"] == "cacheblend" and r["qid"] == records[0]["qid"]}
    n = blend[1.0]["chunk_tokens"]
    assert [blend[r]["recomputed_tokens"] for r in (0.0, 0.5, 1.0)] == [0, int(0.5 * n + 0.5), n]
    # ratio 1.0 reproduces full prefill: same first token distribution, same answer
    assert blend[1.0]["kl_full"] < 1e-4 and blend[1.0]["answer"] == blend[1.0]["full_answer"]
    assert all(r["kl_full"] < 1e-6 for r in records if r["method"] == "full")
    # full's whole answer, teacher-forced over each cache: full's own predicts it exactly, ratio 1 too
    assert all(r["answer_kl_full"] == 0.0 and r["answer_agree_full"] == 1.0 for r in records if r["method"] == "full")
    assert blend[1.0]["answer_kl_full"] < 1e-4 and blend[1.0]["answer_agree_full"] == 1.0
    # an answer that parts from full's (other than by going on after it) missed one of full's tokens at least
    parted = [r for r in records if not r["answer"].startswith(r["full_answer"])]
    assert parted and all(r["answer_agree_full"] < 1 and r["answer_kl_full"] > 0 for r in parted)


def test_full_is_one_request_whatever_the_variant(tiny_built, tmp_path):
    """`full` reads no stored entry, but a run with --variant fusion recorded it as a fusion record: resuming
    the same file without --variant prefilled every question in full again, and the tables showed two
    `full` rows. It is recorded under its own variant (prefix, as every earlier run recorded it)."""
    out = tmp_path / "runs.jsonl"
    run(run_opts(tiny_built, out, methods=["full", "reuse"], ratios=[0.0], limit=1, variant="fusion"), QUIET)
    run(run_opts(tiny_built, out, methods=["full", "reuse"], ratios=[0.0], limit=1), QUIET)
    records = read_records(out)
    assert sorted((r["method"], r["settings"]["variant"]) for r in records) == [
        ("full", "prefix"), ("reuse", "fusion"), ("reuse", "prefix")]


def test_compare_full_and_full_share_one_prefill_per_question(tiny_built, tmp_path, monkeypatch):
    """With --compare-full, the `full` record is the comparison's own prefill: one per question
    (plus one untimed warm-up, when there is one), not two."""
    from kvf.pipeline.fusion.methods.full import FullPrefill
    calls = []
    original = FullPrefill.prefill
    monkeypatch.setattr(FullPrefill, "prefill", lambda self, *a, **kw: calls.append(1) or original(self, *a, **kw))
    out = tmp_path / "runs.jsonl"
    run(run_opts(tiny_built, out, methods=["full", "reuse"], ratios=[0.0], compare_full=True, warmup=True), QUIET)
    records = read_records(out)
    assert len(records) == 2 * 2
    assert len(calls) == 1 + 2
    for rec in (r for r in records if r["method"] == "full"):
        assert rec["answer"] == rec["full_answer"] and rec["kl_full"] == 0.0 and rec["top1_agree_full"]
    # every record carries the TTFT of that one full prefill: kvf eval's ttft_ratio when no `full` run is there
    full_ttft = {r["qid"]: r["timings"]["first_token"] for r in records if r["method"] == "full"}
    assert all(r["full_first_token"] == full_ttft[r["qid"]] for r in records)


def test_shared_work_gives_the_answers_of_lone_requests_and_is_listed(tiny_built, tmp_path, monkeypatch):
    """A sweep shares each variant's query-only pass (reuse, fusionrag, prophetkv at every ratio) and its loaded
    cache (cacheblend), computes once the reuse prefill of every method that is reuse at ratio 0, and decodes in batches;
    --no-share runs every request alone. Same answers, and the shared pieces are named in each record."""
    from kvf.pipeline.fusion.engine import FusionEngine
    passes, fused = [], []
    original_pass, original_fuse = FusionEngine.query_pass, FusionEngine.fuse
    monkeypatch.setattr(FusionEngine, "query_pass", lambda self, *a: passes.append(1) or original_pass(self, *a))
    monkeypatch.setattr(FusionEngine, "fuse", lambda self, m, *a: fused.append(m.name) or original_fuse(self, m, *a))
    kw = dict(methods=["reuse", "prophetkv", "fusionrag", "cacheblend"], ratios=[0.0, 0.15], warmup=False, limit=1)
    run(run_opts(tiny_built, tmp_path / "shared.jsonl", **kw), QUIET)
    assert len(passes) == 2  # one pass on the prefix variant, one on the fusion variant
    # reuse once per variant (prophetkv@0 and cacheblend@0 share the prefix one, fusionrag@0 the fusion one)
    assert sorted(fused) == ["cacheblend", "fusionrag", "prophetkv", "reuse", "reuse"]
    run(run_opts(tiny_built, tmp_path / "alone.jsonl", share=False, **kw), QUIET)
    assert len(passes) == 2  # alone, each request runs its first pass inside its own layer loop
    shared, alone = read_records(tmp_path / "shared.jsonl"), read_records(tmp_path / "alone.jsonl")
    key = lambda r: (r["qid"], r["method"], r["settings"]["ratio"])  # noqa: E731
    assert len(shared) == 7 and {key(r): r["answer"] for r in shared} == {key(r): r["answer"] for r in alone}
    assert len({r["answer"] for r in shared}) > 1   # answers that tell the caches apart: the check above can fail
    for rec in shared:
        variant, ratio = rec["settings"]["variant"], rec["settings"]["ratio"]
        assert "decode-batch:5" in rec["shared"]  # 7 answers, 5 distinct prefills
        assert (f"reuse-prefill:{variant}" in rec["shared"]) == (ratio == 0.0 and rec["method"] != "reuse")
        assert (f"query-pass:{variant}" in rec["shared"]) == (rec["method"] != "cacheblend" or ratio == 0.0)
        assert (f"loaded-kv:{variant}" in rec["shared"]) == (rec["method"] == "cacheblend" and ratio > 0.0)
    assert all(rec["shared"] == [] for rec in alone)


def test_a_question_whose_caches_the_free_memory_cannot_hold_goes_in_groups(tiny_built, tmp_path, monkeypatch):
    """A sweep holds each method's prefilled cache until the question's answers are decoded together: v1's 9
    methods x 4 ratios at 6K tokens took 7.5 GB here, and past the free memory the kernel ends the process without
    a word. Where the free memory holds fewer caches than there are methods, they go in groups, each prefilled,
    decoded and scored before the next: the same answers and the same measures against full's, fewer caches
    alive at once, and smaller decoding batches."""
    import weakref
    from kvf.pipeline.model.forward import KVCache
    from kvf.pipeline.workflows import run as run_module
    alive, most = weakref.WeakSet(), []
    original_init = KVCache.__init__

    def counted_init(self, *a, **kw):
        original_init(self, *a, **kw)
        alive.add(self)
        most.append(len(alive))
    monkeypatch.setattr(KVCache, "__init__", counted_init)
    kw = dict(methods=["full", "reuse", "prophetkv", "fusionrag", "cacheblend", "epic"], ratios=[0.0, 0.15, 0.3],
              warmup=False, limit=1, compare_full=True)
    run(run_opts(tiny_built, tmp_path / "roomy.jsonl", **kw), QUIET)
    roomy_most, most[:] = max(most), []
    monkeypatch.setattr(run_module.QuestionRunner, "methods_at_once", lambda self, prompt, held, q: 2)
    run(run_opts(tiny_built, tmp_path / "short.jsonl", **kw), QUIET)
    short_most = max(most)
    roomy, short = read_records(tmp_path / "roomy.jsonl"), read_records(tmp_path / "short.jsonl")
    key = lambda r: (r["qid"], r["method"], r["settings"]["ratio"])  # noqa: E731
    measures = lambda r: (r["answer"], r["recomputed_tokens"], r["kl_full"], r["answer_agree_full"])  # noqa: E731
    assert [key(r) for r in roomy] == [key(r) for r in short] and len(roomy) == 14
    assert {key(r): measures(r) for r in roomy} == {key(r): measures(r) for r in short}
    assert all(abs(a["answer_kl_full"] - b["answer_kl_full"]) < 1e-5 for a, b in zip(roomy, short))
    assert len({r["answer"] for r in roomy}) > 1   # answers that tell the caches apart: the check above can fail
    batches = lambda records: {int(t.split(":")[1]) for r in records for t in r["shared"] if t.startswith("decode-batch")}  # noqa: E731
    assert batches(roomy) == {11}   # full's prefill, reuse's on each variant, and 8 more
    assert batches(short) and max(batches(short)) <= 3   # 2 methods a group, and full's prefill with the first
    assert short_most < roomy_most, (short_most, roomy_most)


def test_each_step_of_a_question_is_said_as_it_starts(tiny_built, tmp_path, monkeypatch):
    """A question's records all come at its end (one decoding batch), minutes apart at 6K tokens, where the bar sat
    at "0/24" with no sign of life: records() now says each step as it starts, and the bar shows it."""
    from kvf.pipeline.workflows import run as run_module
    steps, original = [], run_module.QuestionRunner.records

    def spy(self, q, todo, on_missing=None, on_done=None, on_step=None):
        def both(text):
            steps.append(text)
            on_step(text)
        return original(self, q, todo, on_missing, on_done, both)
    monkeypatch.setattr(run_module.QuestionRunner, "records", spy)
    run(run_opts(tiny_built, tmp_path / "runs.jsonl", methods=["full", "reuse", "cacheblend"], ratios=[0.15],
                 label="one", limit=1, compare_full=True, warmup=False), QUIET)
    assert steps == ["prefill full", "prefill reuse (prefix)", "prefill cacheblend@0.15 [one]", "decoding 3 answers",
                     "full's answer over every cache (--compare-full)"]


def test_methods_at_once_is_the_free_memory_s_share_in_caches(tiny_built, tmp_path, monkeypatch):
    """methods_at_once: CACHE_MEMORY_SHARE of the free memory, in caches of the prompt's rows plus the answer's, less
    the caches kept for the whole question; at least one where the held caches and one more fit in all of the free
    memory, refused where they do not (memory that went between the run's checks and this question); every method
    where the free memory cannot be read."""
    from kvf.errors import KvfError
    from kvf.pipeline.workflows import run as run_module
    seen = {}
    original = run_module.QuestionRunner.methods_at_once

    def spy(self, prompt, held, q):
        t = self.session.answerer.transformer
        one = t.n_layers * 2 * t.n_kv_heads * (prompt.n_tokens + self.opts.max_new_tokens) * t.head_dim * 4  # float32
        for free, want in ((one * 10 / run_module.CACHE_MEMORY_SHARE, 10 - held), (one * (held + 1), 1),
                           (None, len(self.planned))):
            monkeypatch.setattr(run_module, "allocatable_bytes", lambda device, free=free: free)
            seen[free] = (original(self, prompt, held, q), want)
        monkeypatch.setattr(run_module, "allocatable_bytes", lambda device: one * (held + 1) - 1)
        with pytest.raises(KvfError, match=f"question {q.qid} in .* needs {held + 1} KV caches at once"):
            original(self, prompt, held, q)
        seen["held"] = (held, 3)   # full prefill's (--compare-full), and on cacheblend's variant its pass and reuse's
        monkeypatch.setattr(run_module, "allocatable_bytes", lambda device: None)
        return original(self, prompt, held, q)
    monkeypatch.setattr(run_module.QuestionRunner, "methods_at_once", spy)
    run(run_opts(tiny_built, tmp_path / "runs.jsonl", methods=["full", "cacheblend"], ratios=[0.15], limit=1,
                 compare_full=True, warmup=False), QUIET)
    assert len(seen) == 4 and all(got == want for got, want in seen.values()), seen


def test_rerun_skips_done_and_a_torn_line_is_recovered(tiny_built, tmp_path):
    out = tmp_path / "runs.jsonl"
    opts = run_opts(tiny_built, out, methods=["reuse", "cacheblend"], ratios=[0.2])
    run(opts, QUIET)
    first = out.read_text().splitlines()
    assert len(first) == 4
    # a crash mid-write leaves a torn last line: the re-run drops it and redoes only that record
    out.write_text("\n".join(first[:3]) + "\n" + first[3][: len(first[3]) // 2])
    run(opts, QUIET)
    again = out.read_text().splitlines()
    assert len(again) == 4 and again[:3] == first[:3]
    assert json.loads(again[3])["qid"] == json.loads(first[3])["qid"]


class DiskFills:
    """A run file's handle whose next write stops half-way with "no space left on device", as a full disk does."""
    def __init__(self, file):
        self.file = file

    def write(self, data):
        self.file.write(bytes(data[: len(data) // 2]))
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_a_full_disk_cuts_the_record_back_and_the_rerun_resumes(tiny_built, tmp_path):
    """Disk full mid-record: one line naming --out and the fix, the file cut back to its whole records (no
    torn line, no traceback from a buffered retry at close), and the re-run writes the rest."""
    out = tmp_path / "runs.jsonl"
    opts = run_opts(tiny_built, out, methods=["reuse", "cacheblend"], ratios=[0.2])
    run(opts, QUIET)
    records = [parse_record(json.loads(line), "test") for line in out.read_text().splitlines()]
    with RunFile(out) as run_file:
        run_file.truncate_all()
        run_file.append(records[0])
        run_file._file = DiskFills(run_file._file)
        with pytest.raises(KvfError, match=f"--out {out}: disk full while writing a record.*re-run to resume"):
            run_file.append(records[1])
    assert out.read_text() == records[0].to_line()
    said = Console(file=io.StringIO(), width=200)
    run(opts, said)
    assert len(out.read_text().splitlines()) == 4
    assert f"{out}: resuming; 1 answer of the 4 asked for already there, 3 to run" in said.file.getvalue()
    said = Console(file=io.StringIO(), width=200)
    run(opts, said)                                       # a re-run over a complete file said nothing of it
    assert f"{out}: every answer asked for (4) is there already; nothing to run" in said.file.getvalue()


def test_a_failed_atomic_write_names_the_file_not_its_temp(tmp_path, monkeypatch):
    """A write that fails (disk full) carries no file name; kvf's one line must name the user's file."""
    from kvf.pipeline.files import write_atomic
    def full(self, data, encoding=None):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError) as failed:
        write_atomic(tmp_path / "summary.csv", "a,b\n")
    assert failed.value.filename == str(tmp_path / "summary.csv")
    assert list(tmp_path.iterdir()) == []            # no temp file left behind


def test_a_dataset_on_a_read_only_mount_needs_a_workspace_elsewhere(tiny_built, tmp_path, monkeypatch):
    """`kvf run -d DATA` with no workspace makes one inside DATA; where DATA is a read-only copy the line
    names the default and the flag that moves it (it was "Read-only file system (check the path ...)")."""
    import shutil
    import tempfile
    data = tmp_path / "data"
    shutil.copytree(tiny_built / "data", data, ignore=shutil.ignore_patterns("workspace"))
    real_probe = tempfile.NamedTemporaryFile
    def read_only_under_data(*args, dir=None, **kw):
        if dir is not None and Path(dir).is_relative_to(data):
            raise OSError(errno.EROFS, "Read-only file system")
        return real_probe(*args, dir=dir, **kw)
    monkeypatch.setattr(tempfile, "NamedTemporaryFile", read_only_under_data)
    opts = run_opts(tiny_built, tmp_path / "runs.jsonl", dataset=data, workspace=None, methods=["reuse"], ratios=[0.0],
                    limit=1)
    with pytest.raises(KvfError, match=r"--workspace \(default: inside --dataset\) .*data/workspace is not writable"):
        run(opts, QUIET)


def test_a_store_that_does_not_exist_yet_is_said(tiny_built, tmp_path, capsys):
    """`kvf run --store TYPO`: the run made a new, empty store there and recomputed every KV without a word.
    It still may (the store fills as questions need it), but says so; the workspace's own store says nothing."""
    out = tmp_path / "runs.jsonl"
    run(run_opts(tiny_built, out, methods=["reuse"], ratios=[0.0], limit=1), QUIET)
    assert "no store at" not in capsys.readouterr().err
    elsewhere = tmp_path / "typo" / "kv.zarr"
    run(run_opts(tiny_built, tmp_path / "other.jsonl", methods=["reuse"], ratios=[0.0], limit=1,
                 store=str(elsewhere)), QUIET)
    err = " ".join(capsys.readouterr().err.split())
    assert f"no store at {elsewhere} yet: created it" in err and "check --store" in err
    assert (tmp_path / "other.jsonl").read_text().count("\n") == 1   # it answered, from the new store


def test_a_question_edited_since_it_was_answered_is_not_skipped_as_done(tiny_built, tmp_path, capsys):
    """Resuming keys records by question id: a question whose text changed under the same id was skipped
    as done, its old answer kept. Refused now; changed gold answers (scoring only) are said."""
    mine, out = tmp_path / "mine.jsonl", tmp_path / "runs.jsonl"
    ask = lambda text, answers: mine.write_text(json.dumps({"id": "a", "question": text, "answers": answers}) + "\n")  # noqa: E731
    opts = questions_opts(tiny_built, mine, out)
    ask("Where was the subject born?", ["Paris"])
    run(opts, QUIET)
    ask("Who founded the company?", ["Paris"])
    with pytest.raises(KvfError, match=f"--out {out} answered question a as 'Where was the subject born\\?'.*"
                                       "now asks 'Who founded the company\\?'.*--overwrite"):
        run(opts, QUIET)
    ask("Where was the subject born?", ["Lyon"])
    run(opts, QUIET)
    assert "the answers of 1 question(s)" in " ".join(capsys.readouterr().err.split())
    assert out.read_text().count("\n") == 1                     # nothing re-run


def test_a_question_whose_id_changed_is_not_answered_and_scored_twice(tiny_built, tmp_path):
    """Ids given to a questions file that had none (or renamed): resuming answered every question again under
    its new id, and the run file held each twice, which `kvf eval` scored as twice the questions. Refused; a
    run of other questions of the same source (another --offset) with the same text is not."""
    mine, out = tmp_path / "mine.jsonl", tmp_path / "runs.jsonl"
    lines = lambda *rows: mine.write_text("".join(json.dumps(r) + "\n" for r in rows))  # noqa: E731
    opts = questions_opts(tiny_built, mine, out)
    lines({"question": "Where was the subject born?"}, {"question": "Who founded the company?"})
    run(opts, QUIET)
    lines({"id": "born", "question": "Where was the subject born?"}, {"id": "founded", "question": "Who founded the company?"})
    with pytest.raises(KvfError, match=f"--out {out} answered 'Where was the subject born\\?' as question mine-1, but "
                                       f"{mine} now names it born.*--overwrite"):
        run(opts, QUIET)
    assert out.read_text().count("\n") == 2
    twice = tmp_path / "twice.jsonl"      # one text under two ids of the source: each is its own question
    mine.write_text(json.dumps({"id": "x", "question": "Where was the subject born?"}) + "\n"
                    + json.dumps({"id": "y", "question": "Where was the subject born?"}) + "\n")
    run(replace(opts, out=twice, offset=1), QUIET)
    run(replace(opts, out=twice, limit=1), QUIET)
    assert [json.loads(line)["qid"] for line in twice.read_text().splitlines()] == ["y", "x"]


def test_a_question_retrieval_finds_nothing_for_is_refused_before_any_work(tiny_built, tmp_path):
    """Shared BM25 retrieval of a question with no word in the corpus returns no chunk: the question was
    answered with no context at all, every method alike, and each one's fidelity to full counted 1.0."""
    mine, out = tmp_path / "mine.jsonl", tmp_path / "runs.jsonl"
    mine.write_text(json.dumps({"id": "fine", "question": "Where was the subject born?"}) + "\n"
                    + json.dumps({"id": "void", "question": "Qzxv wkpq?"}) + "\n")
    opts = questions_opts(tiny_built, mine, out)
    with pytest.raises(KvfError, match=f"question void in {mine}: bm25 retrieval found no chunk for it.*"
                                       "--retriever dense, or leave it out of mine.jsonl"):
        run(opts, QUIET)
    assert not out.exists() or out.read_text() == ""


def test_neighbours_other_than_the_workspace_s_are_refused_not_ignored(tiny_built, tmp_path):
    """`kvf run --neighbours 5` on a workspace built with 2 ran on the workspace's fusion entries, silently."""
    out = tmp_path / "runs.jsonl"
    with pytest.raises(KvfError,
                       match=f"--neighbours 5: workspace {tiny_built / 'ws'} was built with 2, .*--neighbours 5`"):
        run(run_opts(tiny_built, out, methods=["fusionrag"], ratios=[0.15], limit=1, n_neighbours=5), QUIET)
    run(run_opts(tiny_built, out, methods=["reuse"], ratios=[0.0], limit=1, n_neighbours=2), QUIET)
    assert read_records(out)[0]["settings"]["n_neighbours"] == 2



def test_a_refused_run_leaves_no_file_and_overwrite_keeps_the_records_it_would_replace(tiny_built, tmp_path):
    """A run refused after its --out was opened left an empty run file (and the folders made for it); a refused
    `--overwrite` had already emptied the file, so a typo cost the records it was meant to keep."""
    refused = dict(methods=["fusionrag"], ratios=[0.15], limit=1, n_neighbours=5)   # refused after --out is opened
    new = tmp_path / "new" / "deep" / "runs.jsonl"
    with pytest.raises(KvfError, match="--neighbours 5"):
        run(run_opts(tiny_built, new, **refused), QUIET)
    assert not (tmp_path / "new").exists()
    out = tmp_path / "runs.jsonl"
    run(run_opts(tiny_built, out, methods=["reuse"], ratios=[0.0], limit=1), QUIET)
    kept = out.read_text()
    with pytest.raises(KvfError, match="--neighbours 5"):
        run(run_opts(tiny_built, out, overwrite=True, **refused), QUIET)
    assert out.read_text() == kept
    run(run_opts(tiny_built, out, methods=["full"], ratios=[1.0], limit=1, overwrite=True), QUIET)
    assert [r["method"] for r in read_records(out)] == ["full"]     # an --overwrite that runs still replaces


def test_a_run_that_locks_a_file_a_refused_run_removed_opens_it_again(tmp_path, monkeypatch):
    """A refused run unlinks its empty file under the lock; a second run that opened the path meanwhile
    gets the lock on the unlinked file. Appending there would lose its records: it opens the path afresh."""
    import fcntl
    from kvf.pipeline import records
    out = tmp_path / "runs.jsonl"
    out.write_text("")
    locked, real_flock = [], fcntl.flock

    def flock_after_the_unlink(file, operation):
        if not locked:
            out.unlink()          # the refused run's __exit__, between this run's open and its lock
        locked.append(file)
        return real_flock(file, operation)
    monkeypatch.setattr(records.fcntl, "flock", flock_after_the_unlink)
    with RunFile(out) as run_file:
        run_file._file.write(b"kept\n")
    assert len(locked) == 2 and out.read_text() == "kept\n"
def test_retrieval_flags_in_the_per_question_setting_are_refused_not_ignored(tiny_built, tmp_path):
    """`kvf run -d DATA -k 3` where questions bring their own passages answered from all of them: -k (and
    --retriever) shape shared retrieval only, and were dropped without a word."""
    out = tmp_path / "runs.jsonl"
    for flags, said in (({"top_k": 3}, "--top-k 3"), ({"retriever": "dense"}, "--retriever dense")):
        with pytest.raises(KvfError, match=f"{said}: the per-question setting \\(questions name up to 3 passages\\) "
                                           ".*--setting shared"):
            run(run_opts(tiny_built, out, methods=["reuse"], ratios=[0.0], limit=1, **flags), QUIET)
    run(run_opts(tiny_built, out, methods=["reuse"], ratios=[0.0], limit=1, top_k=2, setting="shared"), QUIET)
    assert len(read_records(out)[0]["chunk_ids"]) == 2


def test_run_without_a_workspace_writes_the_manifest_build_cache_writes(tiny_built, tmp_path):
    """`kvf run` on a dataset with no workspace chunks and indexes it itself; its manifest must carry every
    field build-cache's does (same writer), so a later build-cache or run reads it alike."""
    ws = tmp_path / "ws"
    run(run_opts(tiny_built, tmp_path / "runs.jsonl", methods=["reuse"], ratios=[0.0], limit=1, workspace=ws,
                 chunk_tokens=64), QUIET)
    made_by_run = json.loads((ws / "manifest.json").read_text())
    made_by_build = json.loads((tiny_built / "ws" / "manifest.json").read_text())
    assert set(made_by_run) == set(made_by_build)
    assert made_by_run["format"] == "zarr" and made_by_run["store"] == "kv.zarr"  # relative: the workspace can move
    assert made_by_run["tokenizer_fingerprint"] == made_by_build["tokenizer_fingerprint"]
    assert made_by_run["variants"] == [] and made_by_run["chunk_tokens"] == 64


def test_a_dataset_prepared_again_with_more_questions_is_chunked_again_into_its_own_workspace(tmp_path):
    """`kvf data prepare ... -n 2 -o D`, `kvf run -d D`, then `kvf data prepare ... -n 4 -o D` and `kvf run -d D`:
    the dataset's own workspace had no chunks for the new questions' passages, and the run was refused ("built
    from another corpus"). It is chunked and indexed again in its own settings; the entries it stored stay."""
    from kvf.cachestore import open_store
    from kvf.pipeline.data.synthetic import make_synthetic
    data = tmp_path / "data"
    make_synthetic(data, n_questions=2, passages_per_question=3, seed=5)
    tiny = str(tiny_llama_dir(tmp_path / "tiny"))   # chunking does not depend on it
    opts = RunOptions(dataset=data, methods=["reuse"], ratios=[0.0], out=tmp_path / "a.jsonl", max_new_tokens=1,
                      warmup=False, chunk_tokens=64, model=tiny)
    run(opts, QUIET)
    ws = data / "workspace"
    stored = set(open_store(str(ws / "kv.zarr")).keys())
    first = json.loads((ws / "doc_chunks.json").read_text())
    make_synthetic(data, n_questions=4, passages_per_question=3, seed=6)   # more questions, other passages
    out = io.StringIO()
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "b.jsonl", "chunk_tokens": 256}), Console(file=out, width=300))
    assert f"workspace {ws} lacks passages of {data / 'corpus'} that its questions cite" in out.getvalue()
    assert len(read_records(tmp_path / "b.jsonl")) == 4
    manifest = json.loads((ws / "manifest.json").read_text())
    assert manifest["chunk_tokens"] == 64 and manifest["store"] == "kv.zarr"            # its own settings, its store
    assert len(json.loads((ws / "doc_chunks.json").read_text())) > len(first)
    assert stored <= set(open_store(str(ws / "kv.zarr")).keys())                           # nothing stored was lost
    out = io.StringIO()
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "c.jsonl"}), Console(file=out, width=300))
    assert "chunking and indexing" not in out.getvalue()                                  # up to date: used as it is
    # a refresh stopped after the chunks were written but before the manifest caught up: the next run finishes it
    manifest["indexes"]["bm25"] = "0" * 64
    (ws / "manifest.json").write_text(json.dumps(manifest))
    out = io.StringIO()
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "d.jsonl"}), Console(file=out, width=300))
    assert f"workspace {ws} was left half updated" in out.getvalue()
    assert json.loads((ws / "manifest.json").read_text())["indexes"]["bm25"] != "0" * 64


def test_a_passage_edited_in_a_datasets_corpus_is_chunked_again_and_a_workspace_named_with_w_says_so(tmp_path, capsys):
    """A passage edited in place in DATASET/corpus keeps its id, so the dataset's workspace still had chunks for
    every passage its questions cite: `kvf run -d` answered from the old text without a word. The workspace keeps
    a stamp of the files it was chunked from; an edit since is chunked and indexed again, and a workspace named
    with -w (which kvf run never rebuilds) is said to answer from its documents as they were."""
    from kvf.pipeline.data.synthetic import make_synthetic
    from kvf.pipeline.retrieval.chunking import read_chunks_table
    data = tmp_path / "data"
    make_synthetic(data, n_questions=2, passages_per_question=3, seed=5)
    opts = RunOptions(dataset=data, methods=["reuse"], ratios=[0.0], out=tmp_path / "a.jsonl", max_new_tokens=1,
                      warmup=False, chunk_tokens=64, model=str(tiny_llama_dir(tmp_path / "tiny")))
    run(opts, QUIET)
    ws = data / "workspace"
    [corpus_file] = [f for f in (data / "corpus").iterdir() if f.is_file()]
    rows = [json.loads(line) for line in corpus_file.read_text().splitlines()]
    question = json.loads((data / "questions.jsonl").read_text().splitlines()[0])
    edited = next(r for r in rows if r["id"] == question["context_ids"][0])
    edited["text"] = "Quillmarsh harbour was rebuilt in stone. " + edited["text"]
    corpus_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "b.jsonl"}), Console(file=out, width=300))
    assert f"{data / 'corpus'} changed since workspace {ws} was chunked" in out.getvalue()
    text_of = {c.chunk_id: c.text for c in read_chunks_table(ws / "chunks.parquet")}
    [record] = [r for r in read_records(tmp_path / "b.jsonl") if r["qid"] == question["id"]]
    assert text_of[record["chunk_ids"][0]].startswith("Quillmarsh harbour was rebuilt")   # the text as it is now
    out = io.StringIO()
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "c.jsonl"}), Console(file=out, width=300))
    assert "chunking and indexing" not in out.getvalue()                      # chunked since: used as it is
    capsys.readouterr()
    corpus_file.write_text(corpus_file.read_text() + json.dumps({"id": "new", "text": "Added later."}) + "\n")
    run(RunOptions(**{**opts.__dict__, "out": tmp_path / "d.jsonl", "workspace": ws}), QUIET)
    err = " ".join(capsys.readouterr().err.split())
    assert f"{(data / 'corpus').resolve()} changed since workspace {ws} was built" in err
    assert f"`kvf build-cache -w {ws}` brings it up to date" in err

@pytest.mark.parametrize("text", ["1.5", "-0.1", "0.1,abc", ""])
def test_bad_ratio_is_refused(text):
    with pytest.raises(KvfError, match="--ratio"):
        parse_ratios(text)


def test_parse_ratio_list():
    assert parse_ratios("0,0.05,0.15,0.3,1") == [0.0, 0.05, 0.15, 0.3, 1.0]


def kvf_cli(*args):
    return subprocess.run([sys.executable, "-m", "kvf", *args], capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"})


def test_cli_unknown_method_lists_known_ones(tiny_built, tmp_path):
    proc = kvf_cli("run", "-d", str(tiny_built / "data"), "-w", str(tiny_built / "ws"), "-m", "nosuch",
                   "-o", str(tmp_path / "x.jsonl"))
    assert_one_line(proc.returncode, proc.stderr, "--method nosuch", "cacheblend", "reuse")


def test_cli_ratio_out_of_range(tiny_built, tmp_path):
    proc = kvf_cli("run", "-d", str(tiny_built / "data"), "-m", "cacheblend", "-r", "1.2",
                   "-o", str(tmp_path / "x.jsonl"))
    assert_one_line(proc.returncode, proc.stderr, "--ratio")


def test_cli_missing_model_path(tmp_path):
    proc = kvf_cli("demo", "--model", str(tmp_path / "nope"))
    assert_one_line(proc.returncode, proc.stderr, "--model", "no such file")


def test_cli_truncated_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    proc = kvf_cli("demo", "--model", str(bad))
    assert_one_line(proc.returncode, proc.stderr, "--model", "GGUF")


def test_cli_not_a_gguf(tmp_path):
    bad = tmp_path / "weights.gguf"
    bad.write_text("hello")
    proc = kvf_cli("demo", "--model", str(bad))
    assert_one_line(proc.returncode, proc.stderr, "not a GGUF")


def test_cli_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    proc = kvf_cli("demo", "--model", str(tmp_path))
    assert_one_line(proc.returncode, proc.stderr, "gpt2", "llama")


def test_help_on_every_command(capsys, monkeypatch):
    from kvf.cli.main import main

    def kvf_main(*args):   # the real entry point's wrapper, in-process (a subprocess each took ~1.5 s)
        monkeypatch.setattr(sys, "argv", ["kvf", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        out, err = capsys.readouterr()
        return exit_info.value.code or 0, out, err
    for cmd in ([], ["demo"], ["build-cache"], ["run"], ["eval"], ["search"], ["store", "info"], ["data", "prepare"]):
        code, out, _ = kvf_main(*cmd, "--help")
        assert code == 0 and "Usage" in out, cmd
        assert kvf_main(*cmd, "-h") == (0, out, ""), cmd   # -h, as most tools take it ("No such option: -h")
    for group in ([], ["store"], ["data"]):   # a group alone prints its help, not an error
        code, out, err = kvf_main(*group)
        assert code == 0 and out.startswith("Usage: kvf") and not err, group
    proc = kvf_cli("store")   # and once through `python -m kvf`, as a shell runs it
    assert proc.returncode == 0 and proc.stdout.startswith("Usage: kvf store") and not proc.stderr


def test_help_reads_on_an_80_column_terminal():
    """Every command's help fits 80 columns with each option's help in one readable column (typer's
    rich tables squeezed it to ~17 characters, so not even its first 30 fitted on a line), every
    command's summary in full (click cuts them at ~60 characters with '...'), and no markup escapes."""
    import typer
    from typer.testing import CliRunner
    from kvf.cli.main import app
    root = typer.main.get_command(app)
    paths = [[]] + [[name] for name in root.commands] + [[g, name] for g in ("store", "data")
                                                          for name in root.commands[g].commands]
    for path in paths:
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        shown = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "80"}).output
        lines = [" ".join(line.split()) for line in shown.splitlines() if not line.startswith("Usage:")]
        assert "\\[" not in shown and not any(line.endswith("...") for line in lines), path
        assert max(len(line) for line in shown.splitlines()) <= 80, path
        for param in cmd.params:
            start = " ".join((getattr(param, "help", None) or "").split())[:30]
            assert any(start in line for line in lines), (path, param.name, start)


def test_help_shows_every_option_s_help_and_bracketed_default():
    """Every option of every command has help, and every "[default: ...]" its help text holds is shown (it
    vanished when help went through rich markup, which took it for a style tag)."""
    import re
    import typer
    from typer.testing import CliRunner
    from kvf.cli.main import app
    root = typer.main.get_command(app)

    def commands(group, path):
        for name, cmd in getattr(group, "commands", {}).items():
            yield path + [name], cmd
            yield from commands(cmd, path + [name])
    checked = 0
    for path, cmd in commands(root, []):
        summary = (cmd.help or "").split("\n\n")[0]      # the command list shows it as written, line breaks too
        assert summary and "\n" not in summary.strip(), (path, summary)
        shown = " ".join(CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "2000"}).output.split())
        for param in cmd.params:   # every option says what it is (run and bench once lost their shared options' help)
            assert param.param_type_name != "option" or param.help, (path, param.name)
            for bracketed in re.findall(r"\[[a-zA-Z$][^\]]*\]", (getattr(param, "help", None) or "").replace("\\[", "[")):
                assert " ".join(bracketed.split()) in shown, (path, param.name, bracketed)
                checked += 1
    assert checked > 10


def test_cli_method_knobs_reach_the_records(tiny_built, tmp_path):
    """Every method flag of `kvf run` lands in the method's recorded settings (and so changes what runs)."""
    out = tmp_path / "knobs.jsonl"
    proc = kvf_cli("run", "-d", str(tiny_built / "data"), "-w", str(tiny_built / "ws"), "--model",
                   model_of(tiny_built), "-m", "cacheblend,cachefocus",
                   "-r", "0.3", "-n", "1", "--max-new-tokens", "2", "-o", str(out),
                   "--check-layer", "2", "--deviation", "v", "--gradual",
                   "--prune-every", "2", "--keep-chunks", "1", "--allocation", "sort")
    assert proc.returncode == 0, proc.stderr
    settings = {r["method"]: r["settings"] for r in read_records(out)}
    assert settings["cacheblend"] | {"check_layer": 2, "deviation": "v", "gradual": True} == settings["cacheblend"]
    assert settings["cachefocus"] | {"prune_every": 2, "keep_chunks": 1, "allocation": "sort"} == settings["cachefocus"]


def test_ratio_auto_uses_the_loading_controller(tiny_built, tmp_path):
    out = tmp_path / "auto.jsonl"
    opts = run_opts(tiny_built, out, methods=["reuse", "cacheblend"], ratios=[0.25], auto_ratio=True,
                    quality_floor=0.25)
    run(opts, QUIET)
    records = read_records(out)
    blend = [r for r in records if r["method"] == "cacheblend"]
    assert len(blend) == 2
    for r in blend:
        assert r["settings"]["ratio_mode"] == "auto" and 0.25 <= r["settings"]["ratio"] <= 1.0
        assert r["recomputed_tokens"] == int(r["settings"]["ratio"] * r["chunk_tokens"] + 0.5)
    assert all("ratio_mode" not in r["settings"] for r in records if r["method"] == "reuse")
    run(opts, QUIET)  # resuming matches auto records by mode, whatever ratio they got
    assert len(read_records(out)) == len(records)
    # another --quality-floor gives other answers: it was skipped as done; now it is a changed setting
    assert all(r["settings"]["quality_floor"] == 0.25 for r in blend)
    with pytest.raises(KvfError, match=r"other settings \(quality_floor 0.25 -> 0.5\)"):
        run(replace(opts, quality_floor=0.5), QUIET)
    # a record made before floors were recorded resumes as the default floor, and only as it
    unrecorded = [{**r, "settings": {k: v for k, v in r["settings"].items() if k != "quality_floor"}} for r in records]
    out.write_text("".join(json.dumps(r) + "\n" for r in unrecorded))
    run(replace(opts, quality_floor=DEFAULT_QUALITY_FLOOR), QUIET)
    assert len(read_records(out)) == len(records)
    with pytest.raises(KvfError, match="quality_floor"):
        run(opts, QUIET)
    # each question got its own ratio; still one run: one summary row (it was a row of n = 1 per question), and
    # the name progress lines and tables give it
    from kvf.eval.report import evaluate
    from kvf.pipeline.records import run_name
    rows = evaluate([out], tmp_path / "eval")
    auto = rows[rows.method == "cacheblend"]
    assert len(auto) == 1 and auto.label.iloc[0] == "auto" and auto.n.iloc[0] == 2
    assert abs(auto.ratio.iloc[0] - sum(r["settings"]["ratio"] for r in blend) / 2) < 1e-9
    assert {run_name(r) for r in blend} == {"cacheblend@auto"}


def test_fewer_questions_than_n_asked_are_said(tiny_built, tmp_path, capsys):
    """`-n 5 --offset 19` on 20 questions answered one and said nothing (kvf data prepare -n says so)."""
    from kvf.pipeline.data.datasets import load_prepared
    from kvf.pipeline.workflows.run import select_questions
    questions = load_prepared(tiny_built / "data")[0]
    n = len(questions)
    opts = run_opts(tiny_built, tmp_path / "o.jsonl")
    assert len(select_questions(questions, replace(opts, offset=n - 1, limit=5))) == 1
    assert "1 question left after --offset" in capsys.readouterr().err
    assert len(select_questions(questions, replace(opts, limit=n + 1))) == n
    assert f"only {n} questions, fewer than the {n + 1} asked" in capsys.readouterr().err
    assert len(select_questions(questions, replace(opts, limit=n))) == n
    assert capsys.readouterr().err == ""   # as many as asked: nothing to say
    assert len(select_questions(questions[:1], replace(opts, limit=2))) == 1
    assert "there is only 1 question, fewer than the 2 asked" in capsys.readouterr().err   # said "there are only 1"


def test_a_passage_cited_twice_is_said(tiny_built, tmp_path, capsys):
    """A question citing one document twice (a copy-paste) was answered with its chunks twice in the prompt, and
    nothing said so. It is said once for the run, and the prompt is as cited."""
    doc = next(iter(json.loads((tiny_built / "ws" / "doc_chunks.json").read_text())))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"id": "twice", "question": "Who?", "passages": [doc, doc]}) + "\n"
                         + json.dumps({"id": "once", "question": "Who?", "passages": [doc]}) + "\n")
    out = tmp_path / "o.jsonl"
    run(run_opts(tiny_built, out, dataset=None, questions=questions, methods=["reuse"], ratios=[0.0], limit=None),
        QUIET)
    err = capsys.readouterr().err
    assert f"question twice cites passage {doc!r} more than once; its chunks go into the prompt each time" in err
    assert err.count("more than once") == 1
    by_qid = {r["qid"]: r for r in read_records(out)}
    assert by_qid["twice"]["chunk_ids"] == by_qid["once"]["chunk_ids"] * 2


def test_method_entries_with_their_own_knobs_are_separate_rows_and_offset_skips_questions(tiny_built, tmp_path):
    """-m NAME:KNOB=VALUE:variant=V runs that entry with those settings alone, labelled by them; --offset
    answers a later slice (a held-out split) and nothing before it."""
    out = tmp_path / "specs.jsonl"
    opts = run_opts(tiny_built, out, methods=["cacheblend", "cacheblend:check_layer=2:variant=fusion"], ratios=[0.3],
                    offset=1, limit=1)
    printed = io.StringIO()
    run(opts, Console(file=printed, width=200))
    assert "cacheblend@0.3 [check_layer=2:variant=fusion]" in printed.getvalue()   # the mean-TTFT line names both
    records = read_records(out)
    from kvf.pipeline.data.datasets import load_prepared
    all_qids = [q.qid for q in load_prepared(tiny_built / "data")[0]]
    assert {r["qid"] for r in records} == {all_qids[1]}
    by_label = {r.get("label"): r for r in records}
    assert set(by_label) == {None, "check_layer=2:variant=fusion"}
    assert by_label[None]["settings"]["check_layer"] != 2 and by_label[None]["settings"]["variant"] == "prefix"
    assert by_label["check_layer=2:variant=fusion"]["settings"] | {"check_layer": 2, "variant": "fusion"} \
        == by_label["check_layer=2:variant=fusion"]["settings"]
    run(opts, QUIET)  # resuming finds both entries done
    assert len(read_records(out)) == 2


def test_an_entry_naming_a_configuration_plans_its_knobs_labelled_by_its_name():
    """`-m kvfuse:tuned` is kvfuse with the knobs its file names `tuned` (what results/kvfuse.md's ablation chose),
    labelled `tuned`; a knob after the name overrides it; a name the method does not have lists the ones it has."""
    from kvf.pipeline.fusion.methods import METHODS
    from kvf.pipeline.workflows.run import parse_method_spec
    named = parse_method_spec("kvfuse:tuned")   # registers the methods first
    written = parse_method_spec("kvfuse:" + METHODS["kvfuse"].configurations["tuned"])
    assert named.knobs == written.knobs and named.knobs["hop_if_fits"] is True and named.label == "tuned"
    assert parse_method_spec("kvfuse:tuned:hop_after=8").knobs == {**written.knobs, "hop_after": 8}
    assert parse_method_spec("kvfuse:hop_after=8:tuned").knobs["hop_after"] == 12   # the later part wins
    with pytest.raises(KvfError, match="or one of its named configurations: tuned$"):
        parse_method_spec("kvfuse:tunned")


@pytest.mark.parametrize("entry,fragment", [("cacheblend:nope=1", "no knob 'nope'"),
                                            ("cacheblend:check_layer=abc", "must be int"),
                                            ("cacheblend:variant=middle", "use prefix or fusion"),
                                            ("cacheblend:check_layer", "expected NAME:KNOB=VALUE"),
                                            (":tuned", "no method name before ':'"),
                                            ("reuse:tuned", "reuse has no knobs or named configurations; write reuse, "
                                                            "or reuse:variant=prefix\\|fusion$"),
                                            ("full:x", "full has no knobs or named configurations; write full$")])
def test_bad_method_entries_are_one_line_errors(entry, fragment):
    from kvf.pipeline.workflows.run import parse_methods
    with pytest.raises(KvfError, match=fragment):
        parse_methods(entry)


def test_answers_table_scores_a_generated_suite_s_answers_as_kvf_eval_does():
    """On a RULER-style task the table gave token F1 against gold (0.25 for "The special magic number for kernel is
    6682266.", a right answer), where kvf eval scores acc; it now shows acc there, and F1 elsewhere."""
    from kvf.cli.tables import answers_rows_table
    record = dict(qid="b-0", question="What is the special magic number for kernel?", gold=["6682266"], method="full",
                  settings=dict(ratio=1.0), answer="The special magic number for kernel is 6682266.", gold_mode="any",
                  recomputed_tokens=723, chunk_tokens=723, timings=dict(first_token=1.2), dataset="ruler-1024/boundary")
    for dataset, header, value in (("ruler-1024/boundary", "acc", "1.00"), ("nq", "F1", "0.25")):
        table = answers_rows_table([dict(record, dataset=dataset)], "t")
        cells = {c.header: [str(v) for v in c._cells] for c in table.columns}
        assert cells[header][1] == value, cells
        assert table.caption.plain.startswith("acc: " if header == "acc" else "F1: ")
        no_gold = answers_rows_table([dict(record, dataset=dataset, gold=[])], "t")   # a question asked without answers
        assert [str(v) for v in no_gold.columns[2]._cells][1] == "-"


def test_answers_table_heads_each_question_once_and_keeps_every_answer_readable_at_80_columns():
    from kvf.cli.tables import answers_rows_table
    answers = {"full": "Huszim Works, founded in the north by the spouse", "cacheblend": "Vartroucko province"}
    records = [dict(qid=q[:5], question=q, gold=["Huszim Works"], method=m, settings=dict(ratio=0.15), answer=answers[m],
                    recomputed_tokens=111, chunk_tokens=740, timings=dict(first_token=0.288))
               for q in ("Which company was founded by the spouse of Quaemful Pouckfa?", "Where was Pruckgri born?")
               for m in answers]
    out = io.StringIO()
    Console(file=out, width=80).print(answers_rows_table(records, "t"))
    assert all(len(line) <= 80 for line in out.getvalue().splitlines())
    assert out.getvalue().count("cacheblend@0.15") == 2 and out.getvalue().count("111/740") == 4
    assert "Vartroucko province" in out.getvalue()                    # short answers are not folded mid-word
    table = answers_rows_table(records, "t")
    cells = {c.header: [str(v) for v in c._cells] for c in table.columns}   # 2 heading rows + 4 records
    assert cells["method"] == ["question", "full", "cacheblend@0.15"] * 2
    headings = [a for m, a in zip(cells["method"], cells["answer"]) if m == "question"]
    assert headings == [f"{q}\ngold: Huszim Works" for q in ("Which company was founded by the spouse of Quaemful Pouckfa?",
                                                             "Where was Pruckgri born?")]
    assert [v for v in cells["vs full"] if v] == ["1.00", "0.00", "1.00", "0.00"]   # F1 of each answer against full's
    ablation = dict(records[1], label="propagate=off", answer=answers["full"])      # `-m cacheblend:KNOB=V`: labelled
    cells = {c.header: [str(v) for v in c._cells] for c in answers_rows_table(records[:2] + [ablation], "t").columns}
    assert cells["method"] == ["question", "full", "cacheblend@0.15", "cacheblend@0.15 [propagate=off]"]
    assert cells["vs full"][1:] == ["1.00", "0.00", "1.00"]          # compared with the unlabelled full run
    # `--label x@0.5 -m cacheblend:check_layer=2`: the long name took the whole width, and the answer got none
    long_name = dict(ablation, label="x@0.5 check_layer=2 propagate=off", answer="Vartroucko province")
    out = io.StringIO()
    Console(file=out, width=80).print(answers_rows_table([long_name], "t"))
    lines = out.getvalue().splitlines()
    assert all(len(line) <= 80 for line in lines)
    assert any("Vartroucko" in line for line in lines) and any("province" in line for line in lines)   # wrapped, not cut
    # a run file's (or a document's) [brackets] in the title or caption were read as markup: runs/[v2].jsonl showed
    # as runs/.jsonl
    out = io.StringIO()
    table = answers_rows_table(records[:2], "kvf run: 2 answers in runs/[v2].jsonl")
    table.caption.append("; context: notes[draft].txt")
    Console(file=out, width=200).print(table)
    assert "runs/[v2].jsonl" in out.getvalue() and "notes[draft].txt" in out.getvalue()


def test_answers_table_of_a_labelled_run_keeps_its_ablation_entries(tmp_path):
    """`kvf run --label big -m reuse,cacheblend:check_layer=2`: the table kept records labelled exactly "big",
    and dropped the entry labelled "big check_layer=2" that this run had just answered."""
    from kvf.cli.tables import answers_table
    from kvf.pipeline.workflows.run import RunOptions
    def record(method, label, ratio):
        return dict(qid="q1", dataset="toy", method=method, label=label, settings=dict(ratio=ratio, variant="prefix"),
                    chunk_ids=["c"], question="Where?", answer=f"{method} {label}", gold=["x"], prompt_tokens=10,
                    chunk_tokens=8, recomputed_tokens=0, timings=dict(load=0.0, select=0.0, recompute=0.1, first_token=0.1, decode=0.1))
    out = tmp_path / "run.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in (record("reuse", "big", 0.0), record("cacheblend", "big check_layer=2", 0.15),
                                                          record("reuse", "small", 0.0))))
    table = answers_table(out, RunOptions(out=out, methods=["reuse", "cacheblend:check_layer=2"], label="big"))
    methods = [str(v) for v in table.columns[0]._cells]
    assert methods == ["question", "reuse [big]", "cacheblend@0.15 [big check_layer=2]"]   # not the other run's


def test_a_run_of_several_questions_ends_with_its_means_as_kvf_eval_scores_them(tmp_path):
    """`kvf run` over 50 questions showed the first 40 records' answers and no mean: a user had to run kvf eval
    to see which method kept more. Its last table is now kvf eval's rows for the file, the same numbers; one
    question gets none (its answers say it all)."""
    from kvf.cli.tables import means_table
    from kvf.eval.report import evaluate

    def record(qid, method, ratio, answer, first_token):
        return dict(qid=qid, dataset="toy[v2]", method=method, settings=dict(ratio=ratio, variant="prefix"), chunk_ids=["c"],
                    question=f"{qid}?", answer=answer, gold=["paris"], prompt_tokens=10, chunk_tokens=8,
                    recomputed_tokens=round(8 * ratio), timings=dict(load=0.0, select=0.0, recompute=0.1,
                                                                     first_token=first_token, decode=0.1))
    answers = {"full": ["paris", "paris", "rome", "paris"], "cacheblend": ["paris", "rome", "rome", "lyon paris"]}
    out = tmp_path / "run[v2].jsonl"   # brackets: rich markup in a str title or caption, which swallowed them
    out.write_text("".join(json.dumps(record(f"q{i}", m, 1.0 if m == "full" else 0.15, a, 1.0 if m == "full" else 0.3))
                           + "\n" for m, column in answers.items() for i, a in enumerate(column)))
    table = means_table(out, width=200)
    cells = {c.header: [str(v) for v in c._cells] for c in table.columns}
    summary = evaluate([out], tmp_path / "eval")
    assert cells["method"] == list(summary.method)
    for column in ("f1", "fidelity_f1", "ttft_ratio"):
        assert cells[column] == [f"{v:.3f}" for v in summary[column]], column
    assert cells["fidelity_f1"][1] == "0.667" and cells["ttft_ratio"][1] == "0.300"   # 1, 0, 1, 2/3; 0.3 s of 1 s
    assert "means over 4 questions" in table.title and f"kvf eval {out}" in table.caption
    shown = io.StringIO()
    Console(file=shown, width=400).print(table)
    assert f"kvf eval {out}" in shown.getvalue() and "means over 4 questions: toy[v2]" in shown.getvalue()
    one = tmp_path / "one.jsonl"
    one.write_text("".join(line + "\n" for line in out.read_text().splitlines() if '"qid": "q0"' in line))
    assert means_table(one, width=200) is None


def test_run_refuses_zero_ray_workers(tmp_path):
    proc = kvf_cli("run", "-q", tmp_path / "q.jsonl", "-m", "full", "-o", tmp_path / "o.jsonl", "--ray", "local", "--workers", "0")
    assert proc.returncode == 2 and "--workers" in proc.stderr and "Traceback" not in proc.stderr


def test_demo_runs_end_to_end(tmp_path):
    """`make demo`'s command (README's first line), small: RULER-style boundary questions are generated, stored
    and answered by full, reuse and cacheblend, and the summary gives each its TTFT against full's, how many it
    answered right, and its answers' F1 against full's. The demo's questions are ones the embedded model answers
    right with full prefill (on the synthetic two-hop set it did before, full scored F1 0.00 on all three)."""
    proc = subprocess.run([sys.executable, "-m", "kvf", "demo", "-n", "1", "--max-new-tokens", "16", "-w", str(tmp_path)],
                          capture_output=True, text=True,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    assert "build-cache:" in out and "kvf demo: 1 RULER-style boundary question (" in out
    table = out[out.index("each method against full prefill"):]
    summary = {cells[0]: cells[1:] for line in table.splitlines()
               if len(cells := [c.strip() for c in line.strip("│┃ ").split("│")]) == 5 and cells[0] in ("full", "reuse", "cacheblend")}
    assert sorted(summary) == ["cacheblend", "full", "reuse"]
    assert summary["full"][1:] == ["1.00", "1 of 1", "1.00"]   # TTFT / full, right, F1 vs full
    assert (tmp_path / "ws" / "kv.zarr").is_dir() and (tmp_path / "runs" / "demo.jsonl").is_file()


def test_the_live_ttft_line_names_the_full_prefill_compare_full_timed():
    """With --compare-full and no -m full, the others' mean TTFT had no baseline beside it on the line."""
    from kvf.pipeline.workflows.run import MethodStats
    stats = MethodStats()
    for qid, full in (("q1", 2.0), ("q2", 4.0)):
        for method, ttft in (("reuse", 0.5), ("cacheblend", 1.0)):
            stats.add({"qid": qid, "method": method, "settings": {"ratio": 0.15 if method == "cacheblend" else 0.0},
                       "timings": {"first_token": ttft}, "full_first_token": full})
    assert stats.line().endswith("| full (--compare-full) 3000ms")     # per question once: (2 + 4) / 2
    stats.add({"qid": "q1", "method": "full", "settings": {"ratio": 1.0}, "timings": {"first_token": 2.0},
               "full_first_token": 2.0})
    assert "--compare-full" not in stats.line() and "full 2000ms" in stats.line()
