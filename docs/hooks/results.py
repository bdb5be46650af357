"""MkDocs hook: the recorded results in ``benchmarks/results/`` become pages of the site.

* Every ``*.md`` and ``*.png`` there is added under ``results/`` as it is (no copy kept in
  ``docs/``), so each results file is a page and the plots can be shown.
* ``results/index.md`` holds the marker ``<!-- recorded-results -->``, replaced by
  ``benchmarks/results/README.md`` (the record's own index: machine, commands, headline
  tables), with its file names (``bench_gloo_W2.{md,json,png}``) linked to their pages.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files
from mkdocs.structure.pages import Page

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
MARKER = "<!-- recorded-results -->"
# `name.md`, `name.{md,json,png}`, `name.{md,json}` ... in the record's prose and tables
_NAME = re.compile(r"`([A-Za-z0-9_]+)\.(md|\{md[a-z,]*\})`")


def on_files(files: Files, config: Any) -> Files:
    for src in sorted(RESULTS.iterdir()):
        if src.suffix in (".md", ".png") and src.name != "README.md":
            files.append(File.generated(config, f"results/{src.name}", abs_src_path=str(src)))
    return files


def _link(match: re.Match[str]) -> str:
    name = match.group(1)
    if not (RESULTS / f"{name}.md").is_file():
        return match.group(0)
    return f"[{match.group(0)}]({name}.md)"


def on_page_markdown(markdown: str, page: Page, config: Any, files: Files) -> str:
    if page.file.src_uri != "results/index.md" or MARKER not in markdown:
        return markdown
    record = (RESULTS / "README.md").read_text(encoding="utf-8")
    record = re.sub(r"^# .*\n", "", record, count=1)  # the page has its own title
    record = re.sub(r"^(#+) ", r"#\1 ", record, flags=re.MULTILINE)  # one level down
    return markdown.replace(MARKER, _NAME.sub(_link, record))
