"""The docs stay true to the tests: every test that docs/promises.md names exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {node.name for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")}


def test_every_test_named_in_the_promise_table_exists():
    table = (ROOT / "docs" / "promises.md").read_text(encoding="utf-8")
    named = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", table)
    assert len(named) >= 40, "the table lost its rows"
    missing = [f"{file}::{name}" for file, name in named
               if not (ROOT / file).exists() or name not in _test_names(ROOT / file)]
    assert missing == [], f"docs/promises.md names tests that do not exist: {missing}"


def test_the_architecture_map_names_every_module_and_only_modules_that_exist():
    """docs/architecture.md is the reader's map of the folders: each module of the library is
    named there (by path, or by name inside its folder's row), and each path it names exists."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    library = ROOT / "duplexrt"
    named_paths = set(re.findall(r"`(duplexrt/[\w/]+(?:\.py|/))`", text))
    missing_paths = [p for p in sorted(named_paths) if not (ROOT / p).exists()]
    assert missing_paths == [], f"docs/architecture.md names paths that do not exist: {missing_paths}"
    unnamed = []
    for path in sorted(library.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if path.name == "__init__.py" or relative in named_paths:
            continue
        if f"`{path.stem}`" not in text and f"`{path.name}`" not in text:
            unnamed.append(relative)
    assert unnamed == [], f"modules docs/architecture.md does not name: {unnamed}"


# Links, anchors and the benchmark reference -------------------------------------------------

def _markdown_files() -> list[Path]:
    skip = {".venv", ".git", "mutants", "build", "dist"}
    return sorted(p for p in ROOT.rglob("*.md")
                  if not skip.intersection(p.relative_to(ROOT).parts) and ".egg-info" not in str(p))


def _prose(text: str) -> list[str]:
    """The lines outside fenced code blocks (a ``#`` or a bracket there is code, not markdown)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """The fragment each heading gets on GitHub: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen, and -1, -2 ... after a repeated one."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text(encoding="utf-8")):
        heading = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_every_relative_link_in_the_docs_reaches_a_file_and_its_heading():
    broken = []
    for md in _markdown_files():
        for line in _prose(md.read_text(encoding="utf-8")):
            for target in re.findall(r"\]\(<?([^)\s>]+)>?\)", re.sub(r"`[^`]*`", "", line)):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                    continue
                file_part, _, fragment = target.partition("#")
                linked = (md.parent / file_part).resolve() if file_part else md
                where = f"{md.relative_to(ROOT)} -> {target}"
                if not linked.exists():
                    broken.append(f"{where} (no such file)")
                elif fragment and linked.suffix == ".md" and fragment not in _anchors(linked):
                    broken.append(f"{where} (no such heading)")
    assert broken == []


def test_the_benchmark_reference_is_short_and_covers_each_kept_script():
    """docs/benchmarks.md is a reference of today's figures, not a notebook: one section heading
    names each script in benchmarks/ (so a new script comes with its figures), and the history
    stays in git."""
    text = (ROOT / "docs" / "benchmarks.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 400
    headings = "\n".join(line for line in _prose(text) if line.startswith("#"))
    scripts = sorted(p.name for p in (ROOT / "benchmarks").iterdir() if p.suffix in (".py", ".sh"))
    assert [name for name in scripts if f"benchmarks/{name}" not in headings] == []
    assert "git log -p docs/benchmarks.md" in text


def test_every_benchmark_script_the_repository_names_exists():
    """Docs, library comments and the CLI point to the script that measures a figure; the
    pointer must not outlive the script."""
    sources = [*_markdown_files(), *(ROOT / "duplexrt").rglob("*.py"), *(ROOT / "cli").rglob("*.py"),
               ROOT / "Makefile"]
    missing = set()
    for source in sources:
        text = source.read_text(encoding="utf-8")
        if source.name == "benchmarks.md":  # names removed scripts on purpose, with `git show`
            text = re.sub(r"git show\s+\w+:benchmarks/\S+", "", text)
        for name in re.findall(r"\bbenchmarks/([\w.-]+\.(?:py|sh))", text):
            if not (ROOT / "benchmarks" / name).exists() and source.name != "CHANGELOG.md":
                missing.add(f"{source.relative_to(ROOT)}: benchmarks/{name}")
    assert sorted(missing) == []


def test_the_readme_settings_tables_name_every_config_key_and_only_those():
    """The operator guide's two settings tables (everyday settings, then tuning) are where a user looks a
    key up: each key the config has is in one of them, and each key they name exists."""
    import attrs

    from duplexrt.config import Config

    config = Config()
    keys = {f"{section.name}.{field.name}"
            for section in attrs.fields(Config)
            for field in attrs.fields(type(getattr(config, section.name)))
            if (section.name, field.name) != ("backend", "options")}  # backend options: Backends
    guide = (ROOT / "docs" / "operator.md").read_text(encoding="utf-8")
    start = guide.index("\n## Configuration\n")
    section = guide[start:guide.index("\n## ", start + 1)]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    named = {key for row in rows for key in re.findall(r"`([a-z_]+\.[a-z_]+)`", row.split("|")[1])}
    assert sorted(named - keys) == [], "the operator guide names keys the config does not have"
    assert sorted(keys - named) == [], "config keys the operator guide's tables do not name"
    assert section.count("| key | default | meaning |") == 2, "everyday settings, then tuning"


def test_the_changelog_is_written_for_users():
    """Keep a Changelog: ``## [Unreleased]`` on top, then released versions with their dates;
    what a user sees, so no benchmark scripts and no private names (``Session._take_nowait``)."""
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    versions = re.findall(r"^## (.*)$", text, flags=re.MULTILINE)
    assert versions[0] == "[Unreleased]" and versions.count("[Unreleased]") == 1
    released = [re.fullmatch(r"\[(\d+)\.(\d+)\.(\d+)\] - \d{4}-\d{2}-\d{2}", v) for v in versions[1:]]
    assert released and all(released), versions
    numbers = [tuple(map(int, m.groups())) for m in released]
    assert numbers == sorted(numbers, reverse=True), "newest release first"
    assert re.findall(r"benchmarks/\S+", text) == []
    code = re.findall(r"`([^`]+)`", text)
    private = [c for c in code if re.search(r"(?:^|[.\s(])_(?!_)[A-Za-z]", c)]
    assert private == [], "private names in the CHANGELOG"


def test_the_readme_is_a_quick_start_that_names_every_preset_and_links_the_guides():
    """Issue 40: the README opens with one screen (the two commands, the first call, the presets),
    then links the operator and integrator guides, where the reference went."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 100
    assert "## The two commands" in text and "make run " in text and "make test " in text
    quick = text[text.index("## The first call"):text.index("## The guides")]
    presets = sorted(p.stem for p in (ROOT / "configs").glob("*.toml"))
    assert [name for name in presets if f"`{name}`" not in quick] == []
    assert "duplexrt simulate --url" in quick and "duplexrt client" in quick
    assert "(docs/operator.md)" in text and "(docs/integrator.md)" in text
    for guide, heading in (("operator.md", "## Configuration"), ("integrator.md", "## Routes")):
        assert heading in (ROOT / "docs" / guide).read_text(encoding="utf-8")
