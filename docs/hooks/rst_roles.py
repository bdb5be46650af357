"""MkDocs hook: Sphinx roles in the docstrings read as plain code on the API pages.

ringcomm's docstrings cross-reference with Sphinx roles (``:class:`~ringcomm.errors.X```);
mkdocstrings renders them verbatim (``:class:`` before the code span). This drops the role
and, as Sphinx does for ``~``, keeps only the last dotted part.
"""

from __future__ import annotations

import re
from typing import Any

from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

_ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj|const|ref):(<code>)(~?)([^<]*)")


def _plain(match: re.Match[str]) -> str:
    target = match.group(3)
    if match.group(2):  # ~a.b.C -> C
        target = target.rsplit(".", 1)[-1]
    return f"{match.group(1)}{target}"


def on_page_content(html: str, page: Page, config: Any, files: Files) -> str:
    if not page.file.src_uri.startswith("api/"):
        return html
    return _ROLE.sub(_plain, html)
