"""Build the project's shipped English corpus from the Python standard library, offline.

Every CPython install carries a few MB of English prose written for people: module, class and function
docstrings, the comments in its sources and the language reference topics in ``pydoc_data.topics``.
This script collects them (by parsing sources with ``ast``/``tokenize``, never importing them) into a
JSON-lines file with one document per line: ``{"text": ..., "source": ...}``.

The text is covered by the Python Software Foundation License (PSF-2.0); see data/README.md.
The output depends only on the interpreter's standard library, so the same CPython version always
produces byte-identical output:

    python tools/build_corpus.py --output data/stdlib_prose.jsonl.gz
"""
from __future__ import annotations

import argparse
import ast
import gzip
import io
import json
import os
import sys
import sysconfig
import tokenize

# Directories whose text is not prose meant for readers (tests, generated tables, GUI demos).
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "lib2to3", "__pycache__", "turtledemo",
              "dist-packages", "ensurepip", "config-3"}
_MIN_DOC_CHARS = 200


def _skip_dir(rel_parts) -> bool:
    return any(p in _SKIP_DIRS or p.startswith("test") or p.startswith("config-") for p in rel_parts)


def _stdlib_sources(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        parts = [] if rel == "." else rel.split(os.sep)
        if _skip_dir(parts):
            dirnames[:] = []
            continue
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                yield os.path.join(dirpath, name), ".".join(parts + [name[:-3]])


def _docstring_documents(tree: ast.Module, module: str):
    """One document per module docstring and per top-level class/function (methods folded in)."""
    docs = []
    text = ast.get_docstring(tree)
    if text:
        docs.append((module, text))
    for node in tree.body:
        if not isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        parts = []
        own = ast.get_docstring(node)
        if own:
            parts.append(own)
        if isinstance(node, ast.ClassDef):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    sub_doc = ast.get_docstring(sub)
                    if sub_doc:
                        parts.append(f"{sub.name}: {sub_doc}")
        if parts:
            docs.append((f"{module}.{node.name}", "\n\n".join(parts)))
    return docs


def _comment_document(source: str):
    """The file's comments that read as prose (3+ words), consecutive lines joined into paragraphs."""
    paragraphs, current, last_line = [], [], -2
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type != tokenize.COMMENT:
                continue
            text = tok.string.lstrip("#").strip()
            line = tok.start[0]
            if len(text.split()) < 3 or text.startswith(("!", "-*-", "noqa", "type:", "pragma")):
                continue
            if line != last_line + 1 and current:
                paragraphs.append(" ".join(current))
                current = []
            current.append(text)
            last_line = line
    except (tokenize.TokenError, SyntaxError, IndentationError):
        pass
    if current:
        paragraphs.append(" ".join(current))
    return "\n".join(paragraphs)


def iter_documents():
    root = sysconfig.get_paths()["stdlib"]
    for path, module in _stdlib_sources(root):
        try:
            with open(path, encoding="utf-8") as f:
                source = f.read()
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for name, text in _docstring_documents(tree, module):
            if len(text) >= _MIN_DOC_CHARS:
                yield {"text": text, "source": f"docstring:{name}"}
        comments = _comment_document(source)
        if len(comments) >= _MIN_DOC_CHARS:
            yield {"text": comments, "source": f"comments:{module}"}
    from pydoc_data import topics  # the language reference as plain text

    for key in sorted(topics.topics):
        text = topics.topics[key].strip()
        if len(text) >= _MIN_DOC_CHARS:
            yield {"text": text, "source": f"reference:{key}"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="output .jsonl or .jsonl.gz path")
    args = parser.parse_args(argv)
    n_docs = n_chars = 0
    with open(args.output, "wb") as raw:
        # filename="" and mtime=0 keep the gzip header free of the path and time: reproducible bytes.
        out = gzip.GzipFile(filename="", fileobj=raw, mode="wb", compresslevel=9, mtime=0) \
            if args.output.endswith(".gz") else raw
        for doc in iter_documents():
            out.write((json.dumps(doc, ensure_ascii=False) + "\n").encode("utf-8"))
            n_docs += 1
            n_chars += len(doc["text"])
        if out is not raw:
            out.close()
    print(f"wrote {n_docs} documents, {n_chars} characters of text, from Python "
          f"{sys.version.split()[0]} to {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
