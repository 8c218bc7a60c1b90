"""The docs name only what exists: every module, file, class, function and server flag that
README.md and docs/*.md name must be in the tree, so a rename or a removal fails here, naming the
doc, the line and the name, instead of leaving the docs pointing at nothing.

What counts as a reference (anything else in a doc is prose, a field name, a shell example):
- a path with a source extension (`lockstep/foo.py`, `csrc/layer.cpp`, `benchmarks/x.sh`,
  `docs/y.md`), in backticks or in a code block: a file whose path ends with it (a pytest id
  `tests/t.py::test_x` also needs the test); a folder `name/` in backticks: a folder so named;
  `python -m lockstep.x`: an importable module. Absolute, home (`~`) and `../` paths are outside
  the tree and not checked.
- a dotted name in backticks whose first part is a lockstep module (`kernels.linear_parts`,
  `lockstep.sampling_params.SamplingParams`, `utils/process.keep_freed_memory`) or a lockstep class
  (`Scheduler.collect_inputs`): each part must resolve, as an attribute, a submodule, or an
  attribute a class's methods set (`self.x = ...`).
- a CamelCase name in backticks (`BlockWeight`, `RadixCache`): a lockstep class or function, or
  one of EXTERNAL_NAMES (other projects' names the docs mention on purpose).
- a call in backticks of a compound name (`fan_out()`, `resolve_model(path)`): a function or
  method defined in lockstep (one-word calls, `max(dim)`, `value()`, are too often Python's or
  C++'s own to tell).
- a flag in backticks (`--tp-size`, `--speculative-ngram-{min,max}-match-window-size`): one of
  `lockstep serve`'s or `lockstep router`'s flags, or a flag a script in the tree declares
  (`add_argument("--...")`: lockstep bench, benchmarks/*.py), unless it is in OTHER_FLAGS or its
  line names another program (OTHER_PROGRAMS: llama-server, sglang, ...).
- a pointer to a section, `docs/x.md#anchor` or `docs/x.md, "Heading"` (in docs, and in
  lockstep's comments and help texts, which point at docs/benchmarks.md's sections instead of
  quoting a run's figures): the doc must have a heading with that anchor (GitHub's rule: lower
  case, punctuation dropped, spaces to hyphens), or one that starts with that text.

HTTP paths (`/generate`) are not code references and are not checked."""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SOURCE_EXT = ("py", "cpp", "h", "md", "jinja", "sh", "toml", "png")
# Names from other projects the docs mention on purpose: each checked by eye, not by this test.
EXTERNAL_NAMES = frozenset({
    "RecursionError", "NaN", "OpenAI", "AsyncOpenAI", "AutoTokenizer", "PreTrainedTokenizerFast",
    "BaseModel", "FastAPI", "APIRouter", "SentenceTransformer", "LlamaForCausalLM", "JSONResponse",
})
# Other programs' flags the docs name beside lockstep's.
OTHER_FLAGS = frozenset({"--spec-type"})  # llama-server's speculation
# A flag on a line that names one of these belongs to that program, not to lockstep.
OTHER_PROGRAMS = ("llama-server", "llama_cpp", "llama.cpp", "llama-bench", "sglang", "vllm",
                  "pytest", "pip ", "ruff", "python -m sglang", "torchrun", "taskset", "numactl")

_PATH = re.compile(r"(?<![\w./~-])((?:[\w.-]+/)*[\w.-]+\.(?:" + "|".join(SOURCE_EXT)
                   + r"))(::\w+)?(?![\w/])")
_FOLDER = re.compile(r"^(?:[\w-]+/)+$")
_DOTTED = re.compile(r"^([A-Za-z_]\w*(?:[./][A-Za-z_]\w*)+)(\(.*\))?$")
_CLASS = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
_CALL = re.compile(r"^([A-Za-z]\w*_\w+)\(.*\)$")
_FLAG = re.compile(r"^--[a-z]")
_SECTION = re.compile(r"(docs/[\w-]+\.md|README\.md)#([\w-]+)")
_SECTION_TITLE = re.compile(r'(docs/[\w-]+\.md|README\.md),? \\?"([^"\\]+)\\?"')
_MODULE_RUN = re.compile(r"python3? -m (lockstep[\w.]*)")


# ---------------------------------------------------------------------------------------------
# What exists: the tree's files and lockstep's modules, classes and functions (read, not run)


@cache
def tree_files() -> tuple[str, ...]:
    skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "dist"}
    out = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if not skip.intersection(rel.parts) and not rel.parts[0].endswith(".egg-info"):
            out.append(rel.as_posix() + ("/" if path.is_dir() else ""))
    return tuple(out)


def path_exists(ref: str) -> bool:
    ref = ref.removeprefix("./")
    return any(f == ref or f.endswith("/" + ref) for f in tree_files())


@cache
def modules() -> dict[str, Path]:
    """lockstep's modules by dotted name."""
    out = {}
    for path in sorted((ROOT / "lockstep").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class Index:
    """Every module's top-level names, every class's members (its methods, class attributes,
    fields and the attributes its methods set on self) and bases, every function's name."""

    def __init__(self) -> None:
        self.names: dict[str, set[str]] = {}
        self.classes: dict[str, list[tuple[str, ast.ClassDef]]] = {}
        self.functions: set[str] = set()
        for mod, path in modules().items():
            tree = ast.parse(path.read_text())
            names = self.names.setdefault(mod, set())
            for node in tree.body:
                names.update(_bound(node))
                if isinstance(node, ast.ClassDef):
                    self._add_class(mod, node)
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.functions.add(node.name)

    def _add_class(self, mod: str, node: ast.ClassDef) -> None:
        self.classes.setdefault(node.name, []).append((mod, node))
        for inner in node.body:
            if isinstance(inner, ast.ClassDef):
                self._add_class(mod, inner)

    def members(self, cls: str, seen: frozenset[str] = frozenset()) -> tuple[set[str], bool]:
        """A class's members, its lockstep bases' included, and whether a base is another
        project's (nn.Module, BaseModel: members this index cannot see)."""
        out: set[str] = set()
        foreign = False
        for _mod, node in self.classes.get(cls, []):
            for inner in node.body:
                out.update(_bound(inner))
            for sub in ast.walk(node):
                for target in _targets(sub):
                    if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                            and target.value.id in ("self", "cls")):
                        out.add(target.attr)
            for base in node.bases:
                name = ast.unparse(base)
                if name == "object" or name.startswith(("Generic", "Protocol")):
                    continue
                if name not in self.classes:
                    foreign = True
                elif name not in seen:
                    inherited, foreign_base = self.members(name, seen | {cls})
                    out |= inherited
                    foreign = foreign or foreign_base
        return out, foreign


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        return node.targets
    if isinstance(node, (ast.AnnAssign, ast.AugAssign)):
        return [node.target]
    return []


def _bound(node: ast.stmt) -> set[str]:
    """The names a module- or class-level statement binds."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    names = {t.id for t in _targets(node) if isinstance(t, ast.Name)}
    for t in _targets(node):
        if isinstance(t, ast.Tuple):
            names.update(e.id for e in t.elts if isinstance(e, ast.Name))
    if isinstance(node, (ast.If, ast.Try)):  # TYPE_CHECKING imports, optional imports
        for inner in [*node.body, *getattr(node, "orelse", []), *getattr(node, "handlers", [])]:
            if isinstance(inner, ast.stmt):
                names |= _bound(inner)
            else:
                for stmt in inner.body:
                    names |= _bound(stmt)
    return names


@cache
def index() -> Index:
    return Index()


def resolve(dotted: str) -> str | None:
    """None when `dotted` names something lockstep has (or is not a lockstep name at all), else
    what is missing."""
    parts = dotted.replace("/", ".").split(".")
    idx, first = index(), parts[0]
    starts = [m for m in modules() if m == first or m.endswith("." + first)]
    if not starts and first not in idx.classes:
        return f"no lockstep class {first}" if _CLASS.match(first) and first not in EXTERNAL_NAMES \
            else None  # not a lockstep name: a field, a torch call, a JSON path
    problems = [_walk_module(m, parts[1:]) for m in starts]
    problems += [_walk_class(first, parts[1:])] if first in idx.classes else []
    return None if None in problems else problems[0]


def _walk_module(mod: str, rest: list[str]) -> str | None:
    for i, part in enumerate(rest):
        if f"{mod}.{part}" in modules():
            mod = f"{mod}.{part}"
            continue
        if part not in index().names[mod]:
            return f"{mod} has no {part}"
        return _walk_class(part, rest[i + 1:]) if part in index().classes else None
    return None


def _walk_class(cls: str, rest: list[str]) -> str | None:
    if not rest:
        return None
    members, foreign = index().members(cls)
    if rest[0] not in members and not (foreign and _runtime_attr(cls, rest[0])):
        return f"class {cls} has no {rest[0]}"
    return _walk_class(rest[0], rest[1:]) if rest[0] in index().classes else None


def _runtime_attr(cls: str, attr: str) -> bool:
    """Whether a class built on another project's (nn.Module, BaseModel) has `attr`, imported."""
    for mod, _node in index().classes[cls]:
        obj = getattr(importlib.import_module(mod), cls, None)
        if obj is not None and (hasattr(obj, attr) or attr in getattr(obj, "model_fields", {})):
            return True
    return False


# ---------------------------------------------------------------------------------------------
# What the docs name


def _lines(doc: Path) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, inside a code block)."""
    fenced = False
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        yield n, line, fenced


def _path_problems(text: str, in_code: bool) -> Iterator[str]:
    for m in _PATH.finditer(text):
        ref, test = m.group(1), m.group(2)
        start = m.start(1)
        if text[max(0, start - 1):start] == ":" or ref.startswith(("/", "~", "../")):
            continue
        if "/" not in ref and not in_code:
            continue  # a bare name in prose may be a project's (llama.cpp), not a file
        name = ref.rsplit("/", 1)[-1]
        if name.count(".") > 1 or name[0].isdigit() or re.match(r"^[A-Z]+\.", name):
            continue  # a version, another project's file name, a placeholder (OLD.cpp, X.cpp)
        if not path_exists(ref):
            yield f"no file {ref}"
        elif test and not _defines(ref, test[2:]):
            yield f"{ref} has no {test[2:]}"


def _defines(ref: str, name: str) -> bool:
    path = next(ROOT / f.rstrip("/") for f in tree_files() if f == ref or f.endswith("/" + ref))
    return re.search(rf"^\s*(async )?def {name}\(", path.read_text(), re.M) is not None


@cache
def known_flags() -> frozenset[str]:
    """lockstep serve's and lockstep router's flags, and those the tree's scripts declare."""
    from lockstep.cli import serve_parser
    from lockstep.router.server import build_parser

    flags = {s for parser in (serve_parser(), build_parser()) for action in parser._actions
             for s in action.option_strings}
    for f in tree_files():
        if f.endswith(".py") and f.startswith(("lockstep/", "benchmarks/")):
            flags.update(re.findall(r"add_argument\(\s*(?:\"-\w\",\s*)?\"(--[\w-]+)\"",
                                    (ROOT / f).read_text()))
    return frozenset(flags)


def _expand(flag: str) -> list[str]:
    """`--a-{min,max}-b` -> --a-min-b, --a-max-b."""
    m = re.search(r"\{([^}]*)\}", flag)
    if m is None:
        return [flag]
    return [x for alt in m.group(1).split(",")
            for x in _expand(flag[:m.start()] + alt + flag[m.end():])]


def span_problems(span: str, line: str) -> Iterator[str]:
    """What is wrong with one backticked span (`line` is the line it is on)."""
    span = span.strip()
    if _FOLDER.match(span):
        if not path_exists(span):
            yield f"no folder {span}"
        return
    if _FLAG.match(span):
        flag = span.split()[0]
        if flag not in OTHER_FLAGS and not any(p in line for p in OTHER_PROGRAMS):
            yield from (f"no flag {f} in lockstep's command lines or scripts"
                        for f in _expand(flag) if f not in known_flags())
        return
    if (dotted := _DOTTED.match(span)) and not _PATH.search(span):
        if (why := resolve(dotted.group(1))) is not None:
            yield why
        return
    if _CLASS.match(span):
        idx = index()
        if span not in idx.classes and span not in idx.functions and span not in EXTERNAL_NAMES \
                and not any(span in names for names in idx.names.values()):
            yield f"no lockstep class {span}"
        return
    if (call := _CALL.match(span)) and call.group(1) not in index().functions \
            and not _CLASS.match(call.group(1)):
        yield f"no lockstep function {call.group(1)}()"


def line_problems(line: str, fenced: bool = False) -> list[str]:
    """What is stale on one line of a doc (`fenced`: inside a code block)."""
    spans = [] if fenced else re.findall(r"`([^`]+)`", line)
    prose = line if fenced else re.sub(r"`[^`]+`", " ", line)
    found = list(_path_problems(prose, fenced)) + list(_section_problems(line))
    found += [f"no module {m}" for m in _MODULE_RUN.findall(line) if m.rstrip(".") not in modules()]
    for span in spans:
        whys = list(_path_problems(span, True)) if _PATH.search(span) else \
            list(span_problems(span, line))
        found += [f"`{span}`: {why}" for why in whys]
    return found


def doc_problems(doc: Path) -> list[str]:
    rel = doc.relative_to(ROOT).as_posix()
    return [f"{rel}:{n}: {why}" for n, line, fenced in _lines(doc)
            for why in line_problems(line, fenced)]


@cache
def headings(doc: str) -> tuple[str, ...]:
    return tuple(m.group(1).strip() for _n, line, fenced in _lines(ROOT / doc)
                 if not fenced and (m := re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)))


@cache
def anchors(doc: str) -> frozenset[str]:
    out, seen = set(), {}
    for heading in headings(doc):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        k = seen.get(slug, 0)
        seen[slug] = k + 1
        out.add(slug if k == 0 else f"{slug}-{k}")
    return frozenset(out)


def _section_problems(text: str) -> Iterator[str]:
    for doc, anchor in _SECTION.findall(text):
        if not (ROOT / doc).exists():
            yield f"no file {doc}"
        elif anchor not in anchors(doc):
            yield f"{doc} has no section #{anchor}"
    for doc, title in _SECTION_TITLE.findall(text):
        if not (ROOT / doc).exists():
            yield f"no file {doc}"
        elif not any(h.lower().startswith(title.lower()) for h in headings(doc)):
            yield f'{doc} has no section "{title}"'


# ---------------------------------------------------------------------------------------------
# The tests


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_only_what_exists(doc: Path) -> None:
    problems = doc_problems(doc)
    assert not problems, "stale references (doc:line: name: what is missing):\n" + "\n".join(problems)


def test_section_links_in_the_code_point_at_headings() -> None:
    """Comments and --help texts point at docs/benchmarks.md's sections instead of quoting a
    single run's figures: each such link must name a heading that exists."""
    problems = [f"{path.relative_to(ROOT)}:{n}: {why}"
                for path in modules().values()
                for n, line in enumerate(path.read_text().splitlines(), 1)
                for why in [*_section_problems(line), *_split_pointer(line)]]
    assert not problems, "\n".join(problems)


def _split_pointer(line: str) -> list[str]:
    if re.search(r'docs/[\w-]+\.md,\s*\\?"?\s*$', line):
        return ["a section pointer split over lines: keep `docs/x.md, \"Heading\"` on one line"]
    return []


@pytest.mark.parametrize(("span", "stale"), [
    ("kernels.decode.decode_attention", True), ("kernels.decode_attention", False),
    ("lockstep.sampling_params.SamplingParams", False), ("lockstep.core.NoSuchThing", True),
    ("utils/process.keep_freed_memory", False), ("Scheduler.collect_inputs", False),
    ("Scheduler.no_such_method", True), ("RMSNorm.scale", False), ("RMSNorm.gone", True),
    ("GenerateReqInput.model_validate", False), ("GenerateReqInput.sampling_params", False), ("BlockLinearParts", True), ("BlockWeight", False),
    ("resolve_model(path)", False), ("no_such_function()", True), ("--tp-size", False),
    ("--no-such-flag", True), ("--speculative-ngram-{min,max}-match-window-size", False),
    ("--speculative-ngram-{min,mux}-match-window-size", True), ("lockstep/", False), ("no_such_folder/", True),
    ("torch.where", False), ("usage.prompt_tokens_details", False), ("/generate", False),
    ("max_new_tokens", False), ("RecursionError", False), ("max(dim)", False),
])
def test_what_counts_as_a_stale_reference(span: str, stale: bool) -> None:
    assert bool(list(span_problems(span, ""))) == stale


@pytest.mark.parametrize(("line", "stale"), [
    ("see `lockstep/kernels/csrc/layer.cpp`", False), ("see `lockstep/foo.py`", True),
    ("`tests/project/test_doc_references.py::test_docs_name_only_what_exists`", False),
    ("`tests/project/test_doc_references.py::test_gone`", True), ("`csrc/layer.cpp`", False),
    ("python -m lockstep.bench.serving", False), ("python -m lockstep.nothing", True),
    ("`~/.cache/lockstep/kernels/x.py`", False), ("`../shared/tools/build.sh`", False),
    ("`python benchmarks/kernel_source_ab.py int8 OLD.cpp NEW.cpp`", False),
    ("`python benchmarks/no_such_script.py`", True), ("llama.cpp's kernels", False),
    ("docs/benchmarks.md#overlap-scheduling", False), ("docs/benchmarks.md#no-such-section", True),
    ('docs/benchmarks.md, "Overlap scheduling"', False), ('help="... (docs/benchmarks.md, \\"Overlap scheduling\\")"', False),
    ('help="... (docs/benchmarks.md, \\"Overlap schedules\\")"', True),
    ('docs/benchmarks.md, "No such section"', True), ('docs/nothing.md, "Overlap"', True),
])
def test_what_counts_as_a_stale_path(line: str, stale: bool) -> None:
    assert bool(line_problems(line)) == stale, line_problems(line)
