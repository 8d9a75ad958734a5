"""The documentation's links and commands point at things that exist.

Checks README.md and docs/*.md, in process and without TensorFlow:
- every relative link resolves to a file of the repository, and a `#anchor` into a
  Markdown file to one of its headings (GitHub's anchors);
- every docs/*.md page is linked from README.md or from another docs page;
- every `python -m X` command names a module that can be found with the repository on
  sys.path (importlib.util.find_spec, which imports only X's parent packages).
"""

import importlib.util
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs")


def _pages():
    pages = [os.path.join(ROOT, "README.md")]
    if os.path.isdir(DOCS):
        pages += sorted(os.path.join(DOCS, name) for name in os.listdir(DOCS)
                        if name.endswith(".md"))
    return pages


PAGES = _pages()

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target) and ![alt](target); the target ends at whitespace or ")".
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
# python -m X, and the exec form ["python", "-m", "X"] of Kubernetes manifests.
_MODULE_COMMANDS = (
    re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)"),
    re.compile(r"[\"']python3?[\"']\s*,\s*[\"']-m[\"']\s*,\s*[\"']([A-Za-z_][\w.]*)[\"']"),
)


def _rel(path):
    return os.path.relpath(path, ROOT)


def _read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def _prose_lines(text):
    """The lines outside fenced code blocks, with their line numbers."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _links(path):
    """(line number, target) of every Markdown link outside code."""
    for number, line in _prose_lines(_read(path)):
        for match in _LINK.finditer(_INLINE_CODE.sub("", line)):
            yield number, match.group(1)


def _is_external(target):
    return re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) is not None  # http:, mailto:, ...


def _slug(heading):
    """GitHub's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links: their text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path):
    anchors, seen = set(), {}
    for _, line in _prose_lines(_read(path)):
        match = _HEADING.match(line)
        if not match:
            continue
        slug = _slug(match.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _resolve(page, target):
    """(file the link points at, its anchor or "")."""
    target, _, anchor = target.partition("#")
    if not target:
        return page, anchor
    return os.path.normpath(os.path.join(os.path.dirname(page), target)), anchor


def _link_ids(pages):
    return [_rel(page) for page in pages]


@pytest.mark.parametrize("page", PAGES, ids=_link_ids(PAGES))
def test_relative_links_resolve(page):
    problems = []
    for number, target in _links(page):
        if _is_external(target):
            continue
        path, anchor = _resolve(page, target)
        where = f"{_rel(page)}:{number}: {target}"
        if os.path.commonpath([path, ROOT]) != ROOT:
            problems.append(f"{where}: outside the repository")
        elif not os.path.exists(path):
            problems.append(f"{where}: no file {_rel(path)}")
        elif anchor and path.endswith(".md") and anchor not in _anchors(path):
            problems.append(f"{where}: no heading #{anchor} in {_rel(path)}")
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_linked():
    linked = set()
    for page in PAGES:
        for _, target in _links(page):
            if not _is_external(target):
                path, _ = _resolve(page, target)
                if path != page:
                    linked.add(path)
    orphans = [_rel(page) for page in PAGES
               if os.path.dirname(page) == DOCS and page not in linked]
    assert not orphans, ("docs pages that neither README.md nor another docs page links "
                         f"to: {', '.join(orphans)}")


def _module_commands():
    commands = []
    for page in PAGES:
        text = _read(page)
        for pattern in _MODULE_COMMANDS:
            for match in pattern.finditer(text):
                number = text.count("\n", 0, match.start()) + 1
                commands.append((_rel(page), number, match.group(1).rstrip(".")))
    return commands


def test_pages_name_python_m_commands():
    assert any(module == "pytest" for _, _, module in _module_commands())


@pytest.mark.parametrize(
    "module", sorted({module for _, _, module in _module_commands()}))
def test_python_m_modules_exist(module, monkeypatch):
    monkeypatch.syspath_prepend(ROOT)
    where = ", ".join(f"{page}:{number}" for page, number, name in _module_commands()
                      if name == module)
    try:
        spec = importlib.util.find_spec(module)
    except ModuleNotFoundError:
        spec = None
    assert spec is not None, f"python -m {module} ({where}): no such module"
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        main = importlib.util.find_spec(module + ".__main__")
        assert main is not None, f"python -m {module} ({where}): the package has no __main__"

