"""The docs' reference parts against the code: the configuration table (every key of `kv_connector_extra_config`
with its default), the metrics tables (every series a worker and the proxy serve, with their labels) and every
option of every `p2pkv` command somewhere in the docs; the `p2pkv` command lines in the docs and examples (each
option one the command takes); `docs/design.md`'s parts (every module of the package) and its protocol section
(its version, and every message with its fields in order); the front page's and the benchmarks page's length, and
no diary entries anywhere in the tree."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import re
from pathlib import Path

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from p2pkv import PROTOCOL_VERSION, protocol
from p2pkv.cli.main import build_parser
from p2pkv.config import ExtraConfig
from p2pkv.engine.metrics import EngineMetrics
from p2pkv.proxy.metrics import ProxyMetrics

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DESIGN = DOCS / "design.md"
CONFIGURATION = DOCS / "configuration.md"
METRICS = DOCS / "metrics.md"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
_CODE = re.compile(r"`([^`]*)`")


def table_after(text: str, heading: str) -> list[list[str]]:
    """The cells of each body row of the first table after `heading` (a whole line of `text`)."""
    lines = text.splitlines()
    at = lines.index(heading)
    rows: list[list[str]] = []
    for line in lines[at + 1 :]:
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"no table after {heading!r}"
    assert set(rows[1][0]) <= set("-: "), f"the table after {heading!r} has no header row"
    return rows[2:]


def _default_as_written(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def _same_default(written: str, value: object) -> bool:
    """`written`: the table's default cell; the first code span in it, or "unset" (an empty string or 0)."""
    spans = _CODE.findall(written)
    if not spans:
        return written == "unset" and not value
    token = spans[0]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return float(token) == float(value)
        except ValueError:
            return False
    return token == _default_as_written(value)


def test_the_configuration_table_lists_every_key_once_with_its_default() -> None:
    rows = table_after(CONFIGURATION.read_text(), "## Keys (`kv_connector_extra_config`)")
    listed: dict[str, str] = {}
    for row in rows:
        for key in _CODE.findall(row[0]):
            assert key not in listed, f"{key} listed twice"
            listed[key] = row[1]
    defaults = {f.name: f.default for f in dataclasses.fields(ExtraConfig)}
    assert sorted(listed) == sorted(defaults)
    wrong = {key: (written, defaults[key]) for key, written in listed.items()
             if not _same_default(written, defaults[key])}
    assert not wrong, f"defaults in docs/configuration.md differ from the code's: {wrong}"


def served(metrics: object) -> dict[str, list[str]]:
    """Each series a metrics holder registers, as a scrape names it (counters end in `_total`), with its labels."""
    found: dict[str, list[str]] = {}
    for value in vars(metrics).values():
        if isinstance(value, (Counter, Gauge, Histogram)):
            name = value._name + ("_total" if isinstance(value, Counter) else "")
            found[name] = list(value._labelnames)
    return found


def documented(heading: str) -> dict[str, list[str]]:
    rows = table_after(METRICS.read_text(), heading)
    out: dict[str, list[str]] = {}
    for row in rows:
        names = _CODE.findall(row[0])
        assert len(names) == 1, row
        out[names[0]] = _CODE.findall(row[1])
    return out


def test_the_metrics_tables_list_every_series_a_worker_and_the_proxy_serve_with_their_labels() -> None:
    assert documented("## Each worker (`metrics_port`)") == served(EngineMetrics())
    assert documented("## The proxy (`GET /metrics`)") == served(ProxyMetrics())


def options(parser: argparse.ArgumentParser, command: str = "p2pkv") -> dict[str, list[str]]:
    """Each command's long options (help aside), by command (`p2pkv bench transfer`)."""
    out: dict[str, list[str]] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.update(options(sub, f"{command} {name}"))
        else:
            out.setdefault(command, []).extend(o for o in action.option_strings
                                               if o.startswith("--") and o != "--help")
    return out


def test_every_option_of_every_command_is_in_the_docs() -> None:
    text = "\n".join(page.read_text() for page in PAGES)
    by_command = options(build_parser())
    assert "p2pkv up" in by_command and "p2pkv bench transfer" in by_command
    missing = [f"{command} {option}" for command, found in by_command.items() for option in found
               if not re.search(re.escape(option) + r"(?![\w-])", text)]
    assert not missing, f"options the docs never name: {missing}"


_COMMAND_LINE = re.compile(r"p2pkv (proxy|up|tiny-model|bench \w+)\b([^`\n|]*)")
_QUOTED = re.compile(r"\"(?:[^\"\\]|\\.)*\"|'[^']*'")


def test_every_p2pkv_command_line_in_the_docs_and_examples_uses_options_that_command_has() -> None:
    """`p2pkv up --decode 2 ...` as the docs write it: each option before a lone `--` (after which the arguments
    are vLLM's), outside quotes, is one that command takes."""
    by_command = options(build_parser())
    wrong = []
    for path in [*PAGES, *sorted(p for p in (ROOT / "examples").rglob("*") if p.is_file())]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for command, rest in _COMMAND_LINE.findall(line):
                own = _QUOTED.sub("", rest).split(" -- ")[0]
                known = by_command.get(f"p2pkv {command}")
                assert known is not None, f"{path.name}:{number}: no command p2pkv {command}"
                wrong += [f"{path.name}:{number}: p2pkv {command} {option}"
                          for option in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", own) if option not in known]
    assert not wrong, f"options those commands do not take: {wrong}"


def protocol_section() -> str:
    text = DESIGN.read_text()
    start = text.index("## Protocol (")
    return text[start : text.index("\n## ", start)]


def test_the_design_names_the_protocol_version_the_code_speaks() -> None:
    heading = protocol_section().splitlines()[0]
    assert heading == f"## Protocol (version {PROTOCOL_VERSION})"


def test_the_design_gives_every_message_with_its_fields_in_order() -> None:
    """`Name(field, ...)` in the protocol section, for each message struct (the layout digest is described in words)."""
    section = " ".join(protocol_section().split())
    structs = {name: kind for name, kind in vars(protocol).items()
               if isinstance(kind, type) and issubclass(kind, msgspec.Struct) and kind is not msgspec.Struct}
    given: dict[str, list[str]] = {}
    for name, args in re.findall(r"(\w+)\(([^()`]*)\)", section):
        if name in structs:
            fields = [a.strip() for a in args.split(",") if a.strip()]
            assert given.setdefault(name, fields) == fields, f"{name} given twice, differently"
    assert sorted(given) == sorted(set(structs) - {"LayoutDigest"})
    wrong = {name: (fields, list(structs[name].__struct_fields__)) for name, fields in given.items()
             if fields != list(structs[name].__struct_fields__)}
    assert not wrong, f"messages whose fields the design gives otherwise (design, code): {wrong}"


def test_the_design_names_every_module_of_the_package_in_its_parts() -> None:
    """Each module directly under `p2pkv/` (a package counts as one) has a row in the parts table, or is named in
    one (`p2pkv.kv.tp`, `p2pkv.kv.stages`, `p2pkv.kv.slices` share a row)."""
    rows = table_after(DESIGN.read_text(), "## Parts")
    named = {name for row in rows for name in _CODE.findall(row[0])}
    package = ROOT / "p2pkv"
    modules = {f"p2pkv.{p.stem}" for p in package.glob("*.py") if p.stem not in ("__init__", "__main__")}
    modules |= {f"p2pkv.{p.name}" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert sorted(modules - named) == []
    assert sorted(named - modules) == []


def test_the_front_page_fits_a_screen_and_the_benchmarks_page_is_reference() -> None:
    assert len(README.read_text().splitlines()) <= 200
    assert len((DOCS / "benchmarks.md").read_text().splitlines()) <= 400


_DIARY = re.compile(r"\b(\w+(st|nd|rd|th)|first|second|third|fifth|eighth|ninth|twelfth|last|earlier|this|that|"
                    r"previous|next)[- ]session\b|\bsessions?\)|session note", re.IGNORECASE)


def test_no_diary_entries_in_the_tree() -> None:
    """The repository speaks of the project: a figure cites a docs section by its heading, not a work session."""
    tracked = [p for p in ROOT.rglob("*") if p.is_file() and p.suffix in (".py", ".md", ".sh", ".toml", ".yaml",
                                                                          ".yml", ".txt", ".cfg")
               and not any(part.startswith(".") or part in ("build", "dist") for part in p.relative_to(ROOT).parts)]
    assert len(tracked) > 50
    found = [f"{p.relative_to(ROOT)}:{n}" for p in tracked if p != Path(__file__)
             for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1) if _DIARY.search(line)]
    assert not found, f"diary entries: {found}"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces as
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_docs_names_a_page_and_heading_that_exist() -> None:
    wrong = []
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(((?:docs/)?[\w-]+\.md)(?:#([^)]*))?\)", page.read_text()):
            linked = (page.parent / target).resolve()
            if not linked.exists():
                wrong.append(f"{page.name}: {target}")
            elif anchor and anchor not in {_anchor(line.lstrip("#")) for line in linked.read_text().splitlines()
                                           if line.startswith("#")}:
                wrong.append(f"{page.name}: {target}#{anchor}")
    assert not wrong, f"links to pages or headings that do not exist: {wrong}"
