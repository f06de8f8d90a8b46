"""The documentation site: the reference pages are current, the site builds in strict mode
(a broken link or anchor, a page outside the navigation or any warning fails), the README's
links resolve, and a real browser (Debian's Chromium, headless) renders the home page and a
tutorial with their title, navigation and images, leaving a screenshot under out/docs/."""
from __future__ import annotations

import functools
import html
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import ROOT

SITE = ROOT / "out" / "site"
SHOTS = ROOT / "out" / "docs"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = {"index.html": "psrt", "tutorials/ps-vs-ring.html": "Parameter server vs ring in ten minutes - psrt"}


def _run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


@functools.lru_cache(maxsize=None)
def _built() -> subprocess.CompletedProcess:
    pytest.importorskip("mkdocs", reason="make docs installs MkDocs (scripts/install.sh)")
    pytest.importorskip("material", reason="make docs installs mkdocs-material (scripts/install.sh)")
    return _run(sys.executable, "-m", "mkdocs", "build", "--strict")


def test_the_reference_pages_are_what_the_code_says():
    run = _run(sys.executable, "scripts/gen_reference.py", "--check")
    assert run.returncode == 0, run.stderr[-2000:]


def test_the_site_builds_in_strict_mode():
    run = _built()
    assert run.returncode == 0, run.stderr[-3000:]
    assert (SITE / "index.html").exists() and (SITE / "reference" / "cli.html").exists()


def _slug(title: str) -> str:
    """GitHub's anchor of a heading (also the site's: mkdocs.yml uses the same slugs)."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"(?ms)^```.*?^```", "", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"(?m)^#+ (.+)$", text)}


def test_the_readme_links_resolve():
    text = (ROOT / "README.md").read_text()
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = ROOT / file if file else ROOT / "README.md"
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"README.md links to nothing: {broken}"


def test_the_readme_is_short_and_keeps_the_quick_start():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "make demo" in text and "make test" in text


# --------------------------------------------------------------------- in a browser

PROBE = """<!doctype html><title>probe</title><body><script>
const pages = %s;
const results = {};
function load(i) {
  if (i === pages.length) {
    const pre = document.createElement("pre"); pre.id = "result";
    pre.textContent = JSON.stringify(results); document.body.appendChild(pre); return;
  }
  const frame = document.createElement("iframe");
  frame.style.width = "1280px"; frame.style.height = "900px";
  frame.onload = () => {
    const doc = frame.contentDocument, images = [...doc.images];
    Promise.all(images.map(im => im.complete ? null : new Promise(r => { im.onload = im.onerror = r; }))).then(() => {
      results[pages[i]] = {
        title: doc.title,
        nav: [...doc.querySelectorAll("nav.md-nav--primary .md-nav__link")].map(a => a.textContent.trim()),
        images: images.map(im => [im.getAttribute("src"), im.naturalWidth]),
      };
      frame.remove(); load(i + 1);
    });
  };
  frame.src = "site/" + pages[i];
  document.body.appendChild(frame);
}
load(0);
</script></body>"""


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """out/site over HTTP on localhost, beside a probe page that reads each page's DOM."""
    if _built().returncode != 0:
        pytest.fail("the site did not build (test_the_site_builds_in_strict_mode says why)")
    root = tmp_path_factory.mktemp("served")
    (root / "site").symlink_to(SITE)
    (root / "probe.html").write_text(PROBE % json.dumps(list(PAGES)))
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _chromium(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("chromium") or pytest.skip("no chromium: scripts/install.sh installs Debian's")
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([exe, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120)


def test_a_browser_renders_the_home_page_and_a_tutorial(served):
    run = _chromium("--virtual-time-budget=20000", "--dump-dom", f"{served}/probe.html")
    found = re.search(r'<pre id="result">(.*?)</pre>', run.stdout, re.S)
    assert found, f"the probe page reported nothing\n{run.stderr[-2000:]}"
    results = json.loads(html.unescape(found.group(1)))
    for page, title in PAGES.items():
        seen = results[page]
        assert seen["title"] == title, (page, seen["title"])
        for section in ("Tutorials", "How-to guides", "Reference", "Explanation"):
            assert section in seen["nav"], (page, seen["nav"])
        assert seen["images"] and all(width > 0 for _, width in seen["images"]), (page, seen["images"])
    SHOTS.mkdir(parents=True, exist_ok=True)
    for page in PAGES:
        shot = SHOTS / (Path(page).stem + ".png")
        shot.unlink(missing_ok=True)
        _chromium("--window-size=1280,900", "--hide-scrollbars", f"--screenshot={shot}", f"{served}/site/{page}")
        assert shot.exists() and shot.stat().st_size > 10_000, f"no screenshot of {page}"
