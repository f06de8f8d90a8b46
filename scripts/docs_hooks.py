"""MkDocs hook (mkdocs.yml): a page's link to a file of the repository outside docs/ (code,
examples, hostfiles/README.md) stays a link where the Markdown is read in the repository, and
becomes the path in code type on the site, which holds only docs/.  A link to a file that does
not exist is a warning, so the strict build fails on it as on a broken page link."""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

LINK = re.compile(r"(?<!!)\[([^\]]+)\]\(([^)#\s]+)(#[^)]*)?\)")
log = logging.getLogger("mkdocs.plugins.psrt")


def on_page_markdown(markdown: str, page, config, files) -> str:
    docs = Path(config["docs_dir"]).resolve()
    here = (docs / page.file.src_path).parent

    def outside(m: re.Match) -> str:
        target = m.group(2)
        if re.match(r"[a-z]+:", target):
            return m.group(0)
        path = Path(os.path.normpath(here / target))
        if docs in path.parents or path == docs:
            return m.group(0)
        if not path.exists():
            log.warning(f"{page.file.src_path}: link to {target}, which does not exist")
            return m.group(0)
        shown = path.relative_to(docs.parent).as_posix()
        text = m.group(1)
        return text if text.strip("`") == shown else f"{text} (`{shown}`)"

    return LINK.sub(outside, markdown)
