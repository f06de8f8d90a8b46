"""psrt.bench publish (make bench): a page's marked command blocks run and what they printed
lands in the page, with when, where and how long; a failed command changes nothing."""
from __future__ import annotations

import datetime as dt

import pytest

from psrt.bench import publish
from psrt.errors import PsrtError

PAGE = """# Title

## First section

<!-- bench: hello headline="^greeting: (.*)$" -->
<!-- docs: not run: a test page -->
```sh
echo "greeting: hello 1.5x"
echo to-stderr >&2
```

Prose between.

### Second section

```text
# a comment line of some output, not a heading
```

<!-- bench: broken -->
```sh
echo partial-output; exit 3
```

<!-- bench: twice stderr -->
```sh
echo out; echo err >&2
```
"""


def _page(tmp_path, text=PAGE):
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_blocks_are_read_with_their_options_and_section(tmp_path):
    hello, broken, twice = publish.blocks(_page(tmp_path))
    assert (hello.name, hello.headline, hello.section, hello.level) == ("hello", "^greeting: (.*)$", "First section", 2)
    assert hello.commands.startswith('echo "greeting') and not hello.stderr
    assert (broken.name, broken.section, broken.level) == ("broken", "Second section", 3)
    assert twice.stderr and twice.needs is None and twice.timeout == 3600


@pytest.mark.parametrize("text,why", [
    ("<!-- bench: x -->\nProse.\n```sh\necho\n```\n", "right before"),
    ("<!-- bench: x -->\n```text\nout\n```\n", "right before"),
    ("<!-- bench: x colour=red -->\n```sh\necho\n```\n", "unknown bench option 'colour'"),
    ("<!-- bench: x needs=tpu -->\n```sh\necho\n```\n", "needs='tpu'"),
])
def test_a_bad_mark_is_one_line_naming_the_page_and_line(tmp_path, text, why):
    with pytest.raises(PsrtError, match=why) as e:
        publish.blocks(_page(tmp_path, "# T\n\n" + text))
    assert "page.md:3" in str(e.value)


def test_publishing_writes_each_region_once_and_a_failure_changes_nothing(tmp_path):
    page = _page(tmp_path)
    failed = publish.publish(publish.blocks(page), "a test machine")
    assert failed == ["broken"]
    text = page.read_text()
    hello, broken, twice = publish.blocks(page)
    assert publish.published_output(text, hello) == "greeting: hello 1.5x"   # stdout only
    assert publish.published_output(text, twice) == "out\nerr"                 # stderr too
    assert publish.region(text, broken) is None and text.count("partial-output") == 1
    assert "on a test machine" in text and text.count("*Published by `make bench`") == 2
    # again: the regions are replaced, not added, and the page's other text stays
    publish.publish(publish.blocks(page), "another machine")
    again = page.read_text()
    assert again.count("<!-- bench output: hello -->") == 1 and again.count("<!-- /bench output -->") == 2
    assert "a test machine" not in again and "Prose between." in again
    assert again.replace("another machine", "a test machine").split("UTC")[0] == text.split("UTC")[0]


def test_the_region_says_when_where_and_how_long(tmp_path):
    hello = publish.blocks(_page(tmp_path))[0]
    when = dt.datetime(2026, 11, 28, 4, 5, tzinfo=dt.timezone.utc)
    region = publish.render(hello, "line 1  \nline 2\n", 150.0, when, "a 2-core machine")
    assert region.splitlines()[1] == ("*Published by `make bench` from the commands above: 2026-11-28 04:05 UTC "
                                      "on a 2-core machine, 2 min.*")
    assert "```text\nline 1\nline 2\n```" in region


def test_an_included_report_moves_under_its_section_with_its_images(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "plot.png").write_bytes(b"png")
    (out / "report.md").write_text("# Report title\n\n## Goals\n\n![a plot](plot.png)\n\n### Detail\n")
    img = tmp_path / "docs" / "img"
    img.mkdir(parents=True)
    monkeypatch.setattr(publish, "ROOT", tmp_path)
    text = publish._include(out / "report.md", "suite", 3)
    assert text.splitlines()[0] == "#### Goals" and "##### Detail" in text and "Report title" not in text
    assert "![a plot](IMG/suite-plot.png)" in text and (img / "suite-plot.png").read_bytes() == b"png"


def test_readme_headlines_come_from_the_published_output(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    page = docs / "results.md"
    page.write_text(PAGE)
    publish.publish(publish.blocks(page)[:1], "here")
    readme = tmp_path / "README.md"
    readme.write_text("# R\n\n<!-- bench headlines -->\n- typed by hand: 9.9x\n<!-- /bench headlines -->\nend\n")
    assert publish.write_headlines(tmp_path)
    assert readme.read_text() == ("# R\n\n<!-- bench headlines -->\n"
                                  "- **First section**: hello 1.5x ([output](docs/results.md#first-section)).\n"
                                  "<!-- /bench headlines -->\nend\n")


def test_a_stopped_publish_lets_the_running_block_clean_up(tmp_path):
    """SIGTERM to `publish` (a deadline, a batch system) reaches the running block's whole
    process group, not only its shell, and waits for it: a bench stopped there takes its
    emulated hosts down before the publish ends."""
    import signal
    import subprocess
    import sys
    import time
    cleaned = tmp_path / "cleaned"
    page = _page(tmp_path, f"# T\n\n<!-- bench: slow -->\n```sh\n{sys.executable} -c \"import signal, sys, time\n"
                 f"def stop(*a):\n    time.sleep(1); open('{cleaned}', 'w').write('down'); sys.exit(143)\n"
                 f"signal.signal(signal.SIGTERM, stop); print('started', flush=True); time.sleep(60)\"\n```\n")
    runner = tmp_path / "runner.py"
    runner.write_text(f"import signal\nfrom pathlib import Path\nfrom psrt.bench import publish\n"
                      f"signal.signal(signal.SIGTERM, signal.default_int_handler)\n"
                      f"publish.publish(publish.blocks(Path({str(page)!r})), 'here')\n")
    proc = subprocess.Popen([sys.executable, str(runner)], stderr=subprocess.PIPE, text=True)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)
    assert proc.returncode != 0 and cleaned.read_text() == "down"
    assert "bench output" not in page.read_text()


def test_a_blocks_commands_know_which_block_they_publish(tmp_path):
    """make test, published as a block, must not count that block's own region as missing."""
    block = publish.Block(tmp_path / "p.md", "test-time", 'echo "$BENCH_PUBLISHING"', 0, 1, "S", 2)
    code, out, _ = publish.run(block)
    assert code == 0 and out.strip() == "test-time"
