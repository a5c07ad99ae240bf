"""Read a corpus of documents from a folder of text (.txt, .md, .markdown, .rst, .html) files, one document each, and of
.jsonl, .json (one array), .csv, .tsv and .parquet files, one document per row; each but Parquet also gzipped.
A .pdf file is one document, its text layer's pages."""
import codecs
import gzip
import hashlib
import json
import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from kvf.errors import KvfError, json_reason, shown, stand_in, warn

# one document per file (the title from its first heading, markdown's or reStructuredText's), or one per row
MARKDOWN_EXTENSIONS, RST_EXTENSIONS, HTML_EXTENSIONS = (".md", ".markdown"), (".rst",), (".html", ".htm")
PLAIN_EXTENSIONS = (".txt", *MARKDOWN_EXTENSIONS, *RST_EXTENSIONS, *HTML_EXTENSIONS)
JSONL_EXTENSIONS = (".jsonl", ".jsonl.gz")
JSON_EXTENSIONS = (".json", ".json.gz")   # one array of rows
CSV_EXTENSIONS = (".csv", ".csv.gz", ".tsv", ".tsv.gz")
PARQUET_EXTENSIONS = (".parquet",)
PDF_EXTENSIONS = (".pdf",)   # one document per file, its text layer's pages
SUPPORTED_EXTENSIONS = (*(e + gz for e in (*PLAIN_EXTENSIONS, ".jsonl") for gz in ("", ".gz")), *JSON_EXTENSIONS,
                        *CSV_EXTENSIONS, *PARQUET_EXTENSIONS, *PDF_EXTENSIONS)
# for messages
SUPPORTED = (", ".join((*PLAIN_EXTENSIONS, ".jsonl", ".json", ".csv", ".tsv")) + " (each also gzipped, .gz), "
             ".parquet, .pdf")
_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+(.+?)\s*#*\s*$")
_SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")
_RST_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+:.])\1{2,}\s*$")   # a line of one punctuation mark, 3 or more


class SkipNotes:
    """One corpus read's notes on the files and documents it skips: the first SHOWN of each kind named, one line each;
    the rest counted, in one line at the end (a folder of 10,000 binary files is not 10,000 lines)."""
    SHOWN = 5

    def __init__(self):
        self.counts = Counter()

    def add(self, kind: str, message: str) -> None:
        self.counts[kind] += 1
        if self.counts[kind] <= self.SHOWN:
            warn(message)

    def summarize(self) -> None:
        for kind, n in self.counts.items():
            if n > self.SHOWN:
                warn(f"skipped {n - self.SHOWN:,} more {kind} (the first {self.SHOWN} are named above)")


_SKIP_NOTES: ContextVar[SkipNotes | None] = ContextVar("kvf_corpus_skip_notes", default=None)


def skipped(kind: str, message: str) -> None:
    """Warn of a file or document skipped (kind: what it is, in the plural, for the count), within a corpus read
    counted by its SkipNotes; outside one, warned directly."""
    notes = _SKIP_NOTES.get()
    if notes is None:
        warn(message)
    else:
        notes.add(kind, message)


@dataclass
class Document:
    doc_id: str       # relative path for a text file, the row's "id" for .jsonl(.gz)
    title: str
    text: str
    source_file: str  # the file it came from, for messages


def list_corpus_files(root: Path) -> list[Path]:
    """Every supported file under root (or root itself), sorted so doc order is reproducible."""
    if not root.exists():
        raise KvfError(f"corpus path {root} does not exist; pass a folder of {SUPPORTED} files")
    if root.is_file():
        if not is_supported(root):
            raise KvfError(f"corpus file {root} is not a supported type; use one of {SUPPORTED}, or rename a "
                           "plain-text file to .txt")
        return [root]
    found = files_under(root)
    files = [p for p in found if p.is_file()]
    broken = [p for p in found if not p.exists()]
    if broken:
        warn(f"skipped {len(broken)} link(s) whose target is missing, e.g. {broken[0]} -> {os.readlink(broken[0])}")
    special = [p for p in found if p.exists() and not p.is_file()]   # reading a named pipe would wait for a writer
    if special:
        warn(f"skipped {len(special)} item(s) that are not files (a named pipe, a socket or a device), e.g. {special[0]}")
    if not files:
        raise KvfError(f"corpus folder {root} is empty; put {SUPPORTED} files in it")
    supported = [p for p in files if is_supported(p)]
    if not supported:
        raise KvfError(f"corpus folder {root} has no supported files ({kinds_of(files)}); "
                       f"supported extensions are {SUPPORTED}; rename a plain-text file to .txt")
    if len(supported) < len(files):
        skipped = [p for p in files if not is_supported(p)]
        warn(f"skipped {len(skipped)} file(s) with unsupported extensions, e.g. {skipped[0]} ({kinds_of(skipped)}; "
             f"kvf reads {SUPPORTED} files; convert the others to text, or rename a plain-text file to .txt)")
    return supported


def kinds_of(files: list[Path]) -> str:
    """'3 .pdf, 1 with no extension': what a folder's unread files are, so a user sees which kind to convert."""
    counts = Counter(f.suffix.lower() or "with no extension" for f in files)
    return ", ".join(f"{n} {kind}" for kind, n in counts.most_common())


def files_under(root: Path, quiet: bool = False) -> list[Path]:
    """Every name under root that is not a folder, sorted so document order is reproducible. Hidden files and
    folders (.git, .DS_Store) are never corpus content. A linked folder (corpus/wiki -> /data/wiki) is read like
    any other, once: pathlib's rglob skipped it without a word, and a link back up the tree would loop.
    quiet: no warning of a folder it cannot list (a check, not a build)."""
    found, seen, unreadable = [], set(), []
    for folder, subfolders, names in os.walk(root, followlinks=True, onerror=unreadable.append):
        real = os.path.realpath(folder)
        if real in seen:   # reached again through a link
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        found += [Path(folder) / name for name in names if not name.startswith(".")]
    if unreadable and not quiet:   # os.walk skips a folder it cannot list; its documents would be missing without a word
        first = unreadable[0]
        warn(f"skipped {len(unreadable)} folder(s) kvf cannot read, e.g. {first.filename} ({first.strerror}); "
             "fix their permissions to include their documents")
    return sorted(found)


def corpus_stamp(root: Path, files: list[Path] | None = None) -> dict:
    """What a corpus's files were when it was read: how many, and a digest of each one's path, size and change
    time. A workspace keeps it, so that a document edited, added or removed since is noticed without reading any.
    files: list_corpus_files(root) when a build has them; else listed here without a word."""
    if files is None:
        files = [root] if root.is_file() else [p for p in files_under(root, quiet=True) if p.is_file() and is_supported(p)]
    made_of = []
    for file in files:
        stat = file.stat()
        made_of.append([file_document_id(file, root), stat.st_size, stat.st_mtime_ns])
    return {"files": len(files), "digest": hashlib.sha256(json.dumps(made_of).encode()).hexdigest()}


def file_document_id(path: Path, root: Path) -> str:
    """A file's id as a document: its path relative to the corpus root (its name, where the root is the file)."""
    return path.relative_to(root).as_posix() if path != root else path.name


def is_supported(path: Path, extensions: tuple[str, ...] = SUPPORTED_EXTENSIONS) -> bool:
    return path.name.lower().endswith(extensions)


def holds_documents(folder: Path) -> bool:
    """A folder with document files of its own (not in subfolders): what build-cache reads, passed where a
    workspace or a prepared dataset was meant. Tables are not counted: kvf eval's folder holds summary.csv."""
    document_files = tuple(e for e in SUPPORTED_EXTENSIONS if e not in JSON_EXTENSIONS + CSV_EXTENSIONS + PARQUET_EXTENSIONS)
    return folder.is_dir() and any(p.is_file() and is_supported(p, document_files) for p in folder.iterdir())


@contextmanager
def open_lines(path: Path, on_bytes=None):
    """A binary stream of the file's bytes (decompressed for .gz) and progress(): on_bytes(n) for the n bytes
    of the file read since the last call. A damaged .gz is one line naming it."""
    with path.open("rb") as raw:
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.lower().endswith(".gz") else raw
        done = 0

        def progress():
            nonlocal done
            if on_bytes is not None:
                position = raw.tell()
                on_bytes(position - done)
                done = position
        try:
            yield stream, progress
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise KvfError(f"corpus file {path}: not a readable gzip file ({e or 'it ends early'}); check it with "
                           "`gzip -t` and fetch or compress it again") from None


def read_text_file(path: Path) -> str | None:
    """UTF-8 text of a file (decompressed, for .gz), or None (with a warning) when it is binary or another
    encoding."""
    with open_lines(path) as (f, _):
        data = f.read()
    if not _is_text(path, data[:8192]):
        return None
    try:
        return data.decode("utf-8").removeprefix("\ufeff")  # a leading BOM is not text (decoded with it, so
    except UnicodeDecodeError as e:                          # a bad byte's offset is the file's)
        _not_utf8(path, e.start)
        return None


def check_text_file(path: Path, block: int = 1 << 24) -> bool:
    """read_text_file's checks, a block at a time (a JSONL corpus may be larger than memory; a .gz one is
    checked as it decompresses): True when the whole file is UTF-8 text, else False with read_text_file's
    warning."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with open_lines(path) as (f, _):
        data = f.read(8192)
        if not _is_text(path, data):
            return False
        while data:
            try:
                decoder.decode(data)
            except UnicodeDecodeError as e:
                _not_utf8(path, offset + e.start)
                return False
            offset += len(data)
            data = f.read(block)
    try:
        decoder.decode(b"", final=True)   # a file that ends inside a character
    except UnicodeDecodeError:
        _not_utf8(path, offset)
        return False
    return True


def _is_text(path: Path, head: bytes) -> bool:
    if b"\x00" in head:
        skipped("files that look binary", f"skipped {path}: looks binary (contains NUL bytes)")
        return False
    instead = stand_in(head[:200].decode("utf-8", errors="replace"), html=False)
    if instead is not None:   # its text would be stored and answered from as if it were a document
        skipped("files that stand in for data", f"skipped {path}: it {instead}")
        return False
    return True


def binary_stand_in(path: Path) -> str | None:
    """stand_in() of a binary format's file (Parquet, PDF), whose text checks do not apply: a Git LFS pointer
    named like one. Only its first bytes are read."""
    with path.open("rb") as f:
        return stand_in(f.read(200).decode("utf-8", errors="replace"), html=False)


def _not_utf8(path: Path, byte: int) -> None:
    skipped("files that are not UTF-8", f"skipped {path}: not valid UTF-8 (byte {byte}); convert it to UTF-8")


def markdown_title(text: str, fallback: str) -> str:
    """The first heading of a markdown text: ATX (`# Title`) or setext (`Title` underlined by === or ---), else
    the fallback."""
    lines = text.splitlines()
    for line, below in zip(lines, lines[1:] + [""]):
        match = _MD_HEADING.match(line)
        if match:
            return match.group(1)
        if underlined(line, below, _SETEXT_UNDERLINE):
            return line.strip()
    return fallback


def rst_title(text: str, fallback: str) -> str:
    """The first section title of a reStructuredText text (a line underlined, and perhaps overlined, by one
    punctuation mark at least as long as it), else the fallback."""
    lines = text.splitlines()
    for line, below in zip(lines, lines[1:]):
        if underlined(line, below, _RST_UNDERLINE) and len(below.rstrip()) >= len(line.rstrip()):
            return line.strip()
    return fallback


def underlined(line: str, below: str, underline: re.Pattern) -> bool:
    """A line of text (not itself an underline or overline) with an underline below it."""
    return bool(line.strip()) and not underline.match(line) and bool(underline.match(below))


class PageText(HTMLParser):
    """The text a browser shows of an HTML page, a line per block, and its title (<title>, else its first <h1>):
    scripts, styles and the head's other parts are no part of the document."""
    HIDDEN = {"script", "style", "head", "noscript", "template", "svg"}
    BLOCKS = {"p", "div", "br", "li", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "section", "article", "pre",
              "blockquote", "table", "ul", "ol", "dt", "dd", "hr", "header", "footer", "main", "nav"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts, self.hidden, self.pre, self.title, self.h1, self._in = [], 0, 0, "", "", None

    def handle_starttag(self, tag, attrs):
        if tag in self.HIDDEN:
            self.hidden += 1
        if tag == "pre":
            self.pre += 1
        if tag in ("title", "h1"):
            self._in = tag
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self.HIDDEN:
            self.hidden = max(0, self.hidden - 1)
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
        if tag == self._in:
            self._in = None
        if tag in self.BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data):
        if self._in == "title":
            self.title += data
        elif self._in == "h1" and not self.hidden:
            self.h1 += data
        if not self.hidden:   # a line break in the source is a space on the page, but in <pre>
            self.parts.append(data if self.pre else data.replace("\r", " ").replace("\n", " "))

    def text(self) -> str:
        lines = (" ".join(line.split()) for line in "".join(self.parts).splitlines())
        return "\n".join(line for line in lines if line)


def page_text(html: str) -> tuple[str, str]:
    """(the page's title, or "", and its text)."""
    page = PageText()
    page.feed(html)
    page.close()
    return " ".join((page.title or page.h1).split()), page.text()


def read_pdf_document(path: Path, root: Path) -> Document | None:
    """A PDF is one document: its pages' text layer (pypdf), a page to a paragraph, titled by its metadata title,
    else its file name. One kvf cannot read (damaged, encrypted, a scan with no text layer) is skipped with a
    warning saying which, as a binary .txt is."""
    import logging
    from pypdf import PdfReader
    from pypdf.errors import PyPdfError
    logging.getLogger("pypdf").setLevel(logging.ERROR)   # its notes on a PDF's slips would reach stderr as stray lines
    try:
        reader = PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            skipped("PDFs kvf cannot read", f"skipped {path}: the PDF is encrypted; save a copy without a password "
                    "to include it")
            return None
        pages = [page.extract_text() or "" for page in reader.pages]
        title = (reader.metadata.title if reader.metadata else None) or ""
    except (PyPdfError, ValueError, KeyError, TypeError, OSError) as e:   # pypdf's own errors, and those of a torn file
        instead = binary_stand_in(path)
        skipped("PDFs kvf cannot read", f"skipped {path}: {'it ' + instead if instead else f'not a readable PDF ({e})'}")
        return None
    text = "\n\n".join(page.strip() for page in pages if page.strip())
    if not text:
        skipped("PDFs without a text layer", f"skipped {path}: its PDF has no text layer (a scan?); run OCR on it "
                "(e.g. ocrmypdf) to include it")
        return None
    return Document(doc_id=file_document_id(path, root), title=" ".join(str(title).split()) or path.stem, text=text,
                    source_file=str(path))


def read_plain_document(path: Path, root: Path) -> Document | None:
    """One text file is one document, keyed by its path relative to the corpus root; its title is its first
    heading (markdown, reStructuredText; an HTML page's title), else its name without extensions."""
    text = read_text_file(path)
    if text is None:
        return None
    name = path.name[:-3] if path.name.lower().endswith(".gz") else path.name   # notes.md.gz: markdown, "notes"
    stem = Path(name).stem
    if is_supported(Path(name), HTML_EXTENSIONS):
        title, text = page_text(text)
        title = title or stem
    elif is_supported(Path(name), MARKDOWN_EXTENSIONS):
        title = markdown_title(text, stem)
    elif is_supported(Path(name), RST_EXTENSIONS):
        title = rst_title(text, stem)
    else:
        title = stem
    return Document(doc_id=file_document_id(path, root), title=title, text=text, source_file=str(path))


# the fields of the corpus formats users bring: kvf's own {id, title, text}, BEIR's {_id, title, text},
# and pyserini's JsonCollection {id, contents}; a table's columns by the same names
ID_FIELDS, TEXT_FIELDS = ("id", "_id"), ("text", "contents")
ROW_SHAPE = 'each line must be a JSON object with "id" (or BEIR\'s "_id") and a string "text" (or pyserini\'s "contents")'
TABLE_SHAPE = 'a table of documents needs an "id" (or "_id") column and a "text" (or "contents") column'
JSON_SHAPE = 'a .json file of documents holds one array of objects, each with "id" (or "_id") and "text" (or "contents")'


def is_run_record(row: dict) -> bool:
    """A line `kvf run -o` wrote: every run record carries these fields, and no document or question does."""
    return "method" in row and "settings" in row


def parse_jsonl_row(line: str, where: str) -> Document:
    """One JSONL row -> Document; a bad row is a hard error, since silently dropping it would skew evals."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise KvfError(f"{where}: not valid JSON ({json_reason(e)}); {ROW_SHAPE}") from e
    if not isinstance(row, dict):
        raise KvfError(f"{where}: {ROW_SHAPE}")
    return parse_row(row, where, ROW_SHAPE)


def parse_row(row: dict, where: str, shape: str) -> Document:
    """One row of a .jsonl file or of a table -> Document, its fields checked (shape: what a row must hold)."""
    id_field = next((f for f in ID_FIELDS if row.get(f) not in (None, "")), None)
    text = next((row[f] for f in TEXT_FIELDS if f in row), None)
    if is_run_record(row) and text is None:   # kvf run -o's file given as the corpus
        raise KvfError(f"{where}: a kvf run record, not a document; this is a run file (kvf eval reads it): pass the "
                       "folder or file of your documents")
    if "question" in row and text is None:   # kvf run -q's file given as the corpus
        raise KvfError(f"{where}: a question, not a document; this is a questions file (kvf run -q reads it): pass the "
                       "folder or file of your documents")
    if id_field is None or not isinstance(text, str):
        raise KvfError(f"{where}: {shape}; this one has {', '.join(map(repr, row)) or 'no fields'}")
    doc_id = id_text(row[id_field])
    if doc_id is None:
        raise KvfError(f"{where}: \"{id_field}\" must be a string or a whole number; this one is {shown(row[id_field])}")
    title = title_text(row.get("title"))
    if title is None:
        raise KvfError(f"{where}: \"title\" must be a string (or left out); this one is {shown(row['title'])}")
    return Document(doc_id=doc_id, title=title, text=text, source_file=where)


def id_text(value) -> str | None:
    """A record's id as text: a non-empty string, or a whole number as its digits. None for what is no id: a list,
    an object, true/false or NaN, which str() would make "['x']", "True" or "nan"."""
    if isinstance(value, str):
        return value or None
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else None


def title_text(value) -> str | None:
    """A record's title as text: a string, or a number as written; null or NaN (a table's missing value) is no
    title, "". None for what is no title at all: a list, an object or true/false, which str() would make "['x']"."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return str(value)


def iter_jsonl_documents(path: Path, on_bytes=None) -> Iterator[Document]:
    """Each non-blank line of a .jsonl (or .jsonl.gz) file is one document, read a line at a time."""
    if not check_text_file(path):
        return
    with open_lines(path, on_bytes) as (f, progress):
        for line_no, raw in enumerate(f, start=1):
            progress()
            line = raw.decode("utf-8")
            if line_no == 1:
                line = line.removeprefix("\ufeff")   # a leading BOM is not part of the first row
            if line.strip():
                yield parse_jsonl_row(line, f"{path}:{line_no}")
        progress()


def iter_json_array_documents(path: Path, on_bytes=None) -> Iterator[Document]:
    """A .json file holding one array of rows (an export: `df.to_json(orient="records")`) is one document per row.
    Valid JSON of another shape (package.json beside the documents) is skipped with a warning; JSON that does
    not parse is one line naming the file. The array is read whole: a corpus larger than memory belongs in .jsonl."""
    text = read_text_file(path)
    if on_bytes is not None:
        on_bytes(path.stat().st_size)
    if text is None or not text.strip():
        return   # skipped with a warning; an empty file holds no document, as an empty .jsonl file holds none
    try:
        rows = json.loads(text)
    except json.JSONDecodeError as e:
        raise KvfError(f"corpus file {path}: not valid JSON ({json_reason(e)}, line {e.lineno}); {JSON_SHAPE}") from None
    first = rows[0] if isinstance(rows, list) and rows else None
    if not isinstance(first, dict) or not has_document_fields(list(first)):
        kind = json_kind(rows)
        held = (f"an array of objects with {', '.join(map(repr, list(first)[:8])) or 'no fields'}"
                if isinstance(first, dict) else f"an array of {json_kind(first)}s" if first is not None
                else "an empty array" if kind == "array" else ("an " if kind[0] in "ao" else "a ") + kind)
        skipped(".json files of other things", f"skipped {path}: not an array of documents ({JSON_SHAPE}; it holds {held})")
        return
    for row_no, row in enumerate(rows, start=1):
        if not isinstance(row, dict):
            raise KvfError(f"{path} row {row_no}: {JSON_SHAPE}; this one is {shown(row)}")
        yield parse_row(row, f"{path} row {row_no}", JSON_SHAPE)


def json_kind(value) -> str:
    """What a JSON value is, in JSON's words."""
    return {list: "array", dict: "object", str: "string", bool: "boolean", type(None): "null"}.get(type(value), "number")


TABLE_ROWS = 10_000   # rows of a table read at a time: a corpus table need not fit in memory


def iter_table_documents(path: Path, on_bytes=None) -> Iterator[Document]:
    """Each row of a .csv / .tsv (or gzipped) or .parquet table is one document, read TABLE_ROWS at a time. Cells
    are read as written: no id becomes a number, no empty title becomes NaN."""
    if path.stat().st_size == 0 or (is_supported(path, CSV_EXTENSIONS) and not check_text_file(path)):
        return   # an empty file holds no document, as an empty .jsonl file holds none
    if is_supported(path, PARQUET_EXTENSIONS):   # binary, so read_text_file's checks do not apply; a pointer's do
        instead = binary_stand_in(path)
        if instead is not None:
            skipped("files that stand in for data", f"skipped {path}: it {instead}")
            return
    row_no = 0
    for columns, rows in table_batches(path):
        if row_no == 0 and not has_document_fields(columns):   # a spreadsheet of figures, kvf eval's summary.csv
            skipped("tables of other things", f"skipped {path}: not a table of documents ({TABLE_SHAPE}; its columns "
                    f"are {', '.join(map(repr, columns[:8])) or 'none'}{', ...' if len(columns) > 8 else ''})")
            return
        for row in rows:
            row_no += 1
            yield parse_row(row, f"{path} row {row_no}", TABLE_SHAPE)
    if on_bytes is not None:
        on_bytes(path.stat().st_size)


def table_batches(path: Path) -> Iterator[tuple[list[str], list[dict]]]:
    """(the table's columns, its rows as dicts), TABLE_ROWS rows at a time; a file that is no such table is one
    line naming it."""
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if is_supported(path, PARQUET_EXTENSIONS):
            for batch in pq.ParquetFile(path).iter_batches(batch_size=TABLE_ROWS):
                yield batch.schema.names, batch.to_pylist()
            return
        sep = "\t" if is_supported(path, (".tsv", ".tsv.gz")) else ","
        with pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, encoding="utf-8-sig",
                         chunksize=TABLE_ROWS) as reader:
            for frame in reader:
                yield list(frame.columns), frame.to_dict("records")
    except (pa.ArrowException, pd.errors.ParserError, pd.errors.EmptyDataError, gzip.BadGzipFile, EOFError,
            zlib.error) as e:
        kind = "Parquet" if is_supported(path, PARQUET_EXTENSIONS) else "CSV" if sep == "," else "TSV"
        raise KvfError(f"corpus file {path}: not a readable {kind} table ({str(e).splitlines()[0] or 'it ends early'}); "
                       f"{TABLE_SHAPE}, one row per document") from None


def has_document_fields(columns: list[str]) -> bool:
    """Whether a table's columns (or a JSON row's fields) hold documents: an id and a text. One that does not is
    skipped with a warning, as a file of another kind is."""
    return any(f in columns for f in ID_FIELDS) and any(f in columns for f in TEXT_FIELDS)


def iter_corpus(path: str | Path, files: list[Path] | None = None, on_bytes=None) -> Iterator[Document]:
    """Every document under `path`, in sorted file order, one at a time (a corpus need not fit in memory);
    unreadable files and empty docs are skipped with a warning. files: list_corpus_files(path), when the
    caller has it; on_bytes(n): n more bytes of those files read."""
    root = Path(path)
    files = list_corpus_files(root) if files is None else files
    notes = SkipNotes()
    _SKIP_NOTES.set(notes)   # what this read skips is counted, the first few of each kind named
    try:
        yield from corpus_documents(root, files, on_bytes)
    finally:
        _SKIP_NOTES.set(None)
        notes.summarize()


def corpus_documents(root: Path, files: list[Path], on_bytes=None) -> Iterator[Document]:
    """iter_corpus's documents, file by file, each id once."""
    first_seen = {}   # doc id -> where it was first read
    for file in files:
        if is_supported(file, JSONL_EXTENSIONS):
            file_docs = iter_jsonl_documents(file, on_bytes)
        elif is_supported(file, JSON_EXTENSIONS):
            file_docs = iter_json_array_documents(file, on_bytes)
        elif is_supported(file, CSV_EXTENSIONS + PARQUET_EXTENSIONS):
            file_docs = iter_table_documents(file, on_bytes)
        else:   # one document per file
            read = read_pdf_document if is_supported(file, PDF_EXTENSIONS) else read_plain_document
            file_docs = [d for d in [read(file, root)] if d is not None]
            if on_bytes is not None:
                on_bytes(file.stat().st_size)
        for doc in file_docs:
            if not doc.text.strip():
                skipped("empty documents", f"skipped empty document {doc.doc_id!r} in {doc.source_file}")
                continue
            # doc ids key gold answers in evals, so two docs under one id is an input error
            if doc.doc_id in first_seen:
                raise KvfError(f"{doc.source_file}: document id {doc.doc_id!r} already used in "
                               f"{first_seen[doc.doc_id]}; give every document a unique id")
            first_seen[doc.doc_id] = doc.source_file
            yield doc
    if not first_seen:
        # a skipped file or document was warned about; an empty file is skipped without a word
        why = "its files are empty" if all(f.stat().st_size == 0 for f in files) else "see the warnings above"
        raise KvfError(f"corpus {root} has no readable non-empty documents ({why}); put {SUPPORTED} "
                       f"documents in it")


def read_corpus(path: str | Path) -> list[Document]:
    """All documents under `path` (iter_corpus), as a list."""
    return list(iter_corpus(path))
