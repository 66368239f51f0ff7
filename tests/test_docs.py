"""The docs run against today's CLI and configs (issue 34 item 4). Nothing runs: no model
loads, nothing compiles, nothing is downloaded.

Where commands and keys are read from: the markdown docs (DOCS: the READMEs, RESULTS.md,
BENCHMARKS.md, docs/, results/), the notebooks (markdown cells; code cells' `!car-jax` lines,
subprocess calls and the backticked spans of their comments), the comments of the shipped
YAML configs (CONFIG_COMMENTS) and the docstrings of the CLI and config modules (DOCSTRINGS).
In markdown, a command is a code-block line (a trailing `\\` joins the next) or an inline
code span; in comments and docstrings, an indented line that starts with one.

What is checked:
- every `car-jax ...` command parses with the real parser (`car_jax.cli.build_parser`;
  argparse's SystemExit is caught and its message reported), and builds its config as its
  sub-command does: the --config file (which must exist when it is under configs/ or a
  committed results/ folder) with the dotted overrides, through the class `config_of` names
  (TrainConfig for train / plan / control, EvalConfig, PilotConfig, ExperimentConfig); each
  override's key must be one of that class; `control`'s --arms / --split and its units'
  configs, `plan`'s --chip / --mesh and `eval --gate`'s TAU and mode are checked as those
  commands check them. A span that is only `car-jax <sub-command>` names the sub-command;
- a span of `key=value` overrides outside a command (`rl.loss.tis_cap=C`,
  `'run.loggers=[tensorboard,wandb]'`), a `dotted.key: value` span and a bare dotted key
  whose first part is a config section (`rollout.max_concurrent`) must name a key of some
  config class; a concrete value must load onto that class's defaults (or onto a shipped
  config of it: `rl.steps=0` needs the SFT warm start its doc describes). `key: value`
  without a dot must name a key of some section;
- a quoted error line (`car-jax train: error: rl.steps: -3 must be ...`) must be what the
  loader says for that key and value;
- every `configs/...` path a markdown doc names exists.

What a doc leaves for the reader to fill in (placeholders):
- `[...]` at the start of a word is an optional group: the command is checked with every
  group left out, and with each group in on its own; a word `a|b` (no spaces) is a choice,
  checked once per choice;
- `<...>`, an ALL-CAPS word (`CONFIG`, `TAU`, `DIR`) and `...` as an option's value parse
  as PH for an option that takes a string, as PLACEHOLDER_ARG ("1") for a numeric one;
  `...` anywhere else stands for more arguments and is left out, and so is the usage's
  generic `key=value`;
- an override whose value is a placeholder (the above, a single letter as in
  `rl.loss.tis_cap=C` or `samples=k`, a path or list with such a part: `configs/X.yaml`,
  `fsdp=F,tp=T`) has its key checked, not its value.
ALLOWED lists the few snippets that look like commands or keys of this CLI and are not.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import difflib
import io
import json
import re
import shlex
import tokenize
import types
import typing
from bisect import bisect_right
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# the docs whose commands and keys are checked (globs from the repository root)
DOCS = ("README.md", "tpu_scripts/README.md", "notebooks/README.md", "notebooks/*.ipynb", "RESULTS.md",
        "BENCHMARKS.md", "docs/*.md", "car_jax/tools/README.md", "results/**/*.md")
# YAML configs whose comments give commands (`#   car-jax train --config ...`)
CONFIG_COMMENTS = ("configs/**/*.yaml",)
# modules whose docstrings give usage (each sub-command's, the configs')
DOCSTRINGS = ("car_jax/cli/*.py", "car_jax/train/config.py", "car_jax/eval/config.py", "car_jax/eval/pilot.py",
              "car_jax/experiment/config.py")

# Text in a doc that looks like a command or a key but is not one of today's CLI: (doc,
# exact snippet) -> why. Keep it short; a wrong command is fixed in the doc, not listed here.
ALLOWED: dict[tuple[str, str], str] = {
    ("BENCHMARKS.md", "glibc.malloc.hugetlb=1"): "a glibc tunable (GLIBC_TUNABLES), not a config key",
}

PH = "__PLACEHOLDER__"  # what `<...>` becomes before the shell reads a command
PLACEHOLDER_ARG = "1"  # a placeholder option value: str, int, float and the comma lists all take "1"
ALL_CAPS = re.compile(r"[A-Z][A-Z0-9_]*")
OVERRIDE = re.compile(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*)=(.*)", re.S)
DOTTED_KEY = re.compile(r"[a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)+")
ERROR_LINE = re.compile(r"car-jax ([a-z-]+): error: (.*)")
CAR_JAX = re.compile(r"(?<![\w.-])(?:[\w.~-]*/)?car-jax(?![\w-])")
LAUNCH = re.compile(r"(?<![\w.-])(?:[\w.~-]*/)?launch\.sh(?![\w-])")  # tpu_scripts/launch.sh: `car-jax train --config`
SHELL_OPERATORS = set("();<>|&")


@dataclasses.dataclass(frozen=True)
class Snippet:
    """Text of a doc to read commands and keys from: a code-block line (continuations joined)
    or an inline code span (`kind` "block" / "span"), at `where` (doc:line)."""
    where: str
    text: str
    kind: str
    doc: str = ""


@dataclasses.dataclass(frozen=True)
class Problem:
    where: str
    text: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.text}\n    {self.message}"


# --- reading the docs --------------------------------------------------------------------

def _line_of(starts: list[int], offset: int) -> int:
    return bisect_right(starts, offset)  # 1-based: starts[0] == 0


def markdown_snippets(text: str, where: str, line0: int = 0, doc: str = "") -> list[Snippet]:
    """The code-block lines (a trailing `\\` joins the next line) and the inline code spans
    (CommonMark: a run of n backticks up to the next run of exactly n; a span may cross
    lines) of a markdown text. Line numbers count from line0 + 1."""
    out: list[Snippet] = []
    lines = text.split("\n")
    prose: list[str] = []  # the text outside fences, with fence lines blanked (offsets kept)
    fence, lang, i = None, "", 0
    while i < len(lines):
        line = lines[i]
        opener = re.match(r" {0,3}(`{3,}|~{3,})\s*([\w+-]*)", line)
        if fence is None and opener:
            fence, lang = opener.group(1), opener.group(2).lower()
            prose.append("")
        elif fence is not None and re.match(r" {0,3}" + re.escape(fence[0]) + "{" + str(len(fence)) + r",}\s*$", line):
            fence = None
            prose.append("")
        elif fence is not None:
            prose.append("")
            if lang in ("python", "py"):
                block = [line]
                while i + 1 < len(lines) and not lines[i + 1].lstrip().startswith(fence):
                    i += 1
                    block.append(lines[i])
                    prose.append("")
                out += python_snippets("\n".join(block), where, line0 + i - len(block) + 1, doc)
            elif lang not in ("json", "yaml", "text"):
                first, joined = i, line
                while joined.endswith("\\") and i + 1 < len(lines):
                    i += 1
                    joined = joined[:-1].rstrip() + " " + lines[i].strip()
                    prose.append("")
                out.append(Snippet(f"{where}:{line0 + first + 1}", joined, "block", doc))
        else:
            prose.append(line)
        i += 1
    body = "\n".join(prose)
    starts = [0] + [m.end() for m in re.finditer("\n", body)]
    pos = 0
    while True:
        m = re.compile(r"`+").search(body, pos)
        if not m:
            break
        ticks = m.group(0)
        close = re.compile(r"(?<!`)" + ticks + r"(?!`)").search(body, m.end())
        if not close:
            pos = m.end()
            continue
        span = body[m.end():close.start()].replace("\n", " ")
        if span.strip():
            out.append(Snippet(f"{where}:{line0 + _line_of(starts, m.start())}", span.strip(), "span", doc))
        pos = close.end()
    return out


def python_snippets(source: str, where: str, line0: int = 0, doc: str = "") -> list[Snippet]:
    """A code cell's commands: `!car-jax ...` shell lines, subprocess calls whose argument
    list starts with car-jax, and the backticked spans of its comments."""
    out: list[Snippet] = []
    lines = source.split("\n")
    python = []
    for n, line in enumerate(lines):
        if line.lstrip().startswith(("!", "%")):
            out.append(Snippet(f"{where}:{line0 + n + 1}", line.lstrip().lstrip("!%"), "block", doc))
            python.append("")
        else:
            python.append(line)
    source = "\n".join(python)
    try:
        tree = ast.parse(source)
        comments = [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT]
    except (SyntaxError, tokenize.TokenError):
        return out
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name not in ("run", "check_call", "check_output", "call", "Popen"):
                continue
            arg = node.args[0]
            words = ([e.value for e in arg.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                     if isinstance(arg, (ast.List, ast.Tuple)) else
                     [arg.value] if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else [])
            if words and CAR_JAX.search(words[0]):
                text = words[0] if len(words) == 1 else shlex.join(words)
                out.append(Snippet(f"{where}:{line0 + node.lineno}", text, "block", doc))
    for t in comments:
        out += markdown_snippets(t.string.lstrip("#").strip(), where, line0 + t.start[0] - 1, doc)
    return out


def doc_snippets(path: Path) -> list[Snippet]:
    """Every snippet of a doc: a markdown file, a notebook (markdown and code cells) or a YAML
    config (its comments, as code-block lines)."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    if path.suffix == ".ipynb":
        out = []
        for n, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell["source"])
            where = f"{rel} cell {n} line"
            if cell["cell_type"] == "markdown":
                out += markdown_snippets(source, where, doc=rel)
            elif cell["cell_type"] == "code":
                out += python_snippets(source, where, doc=rel)
        return [dataclasses.replace(s, where=s.where.replace(" line:", " line ")) for s in out]
    if path.suffix == ".yaml":
        lines = path.read_text().split("\n")
        return _comment_snippets([m.group(1) if (m := re.match(r"\s*#\s?(.*)", line)) else None for line in lines],
                                 rel)
    if path.suffix == ".py":  # the module docstring: indented car-jax lines are code, the rest prose
        tree = ast.parse(path.read_text())
        doc = ast.get_docstring(tree, clean=False) or ""  # a module's: its lines as written
        return _comment_snippets(doc.split("\n"), rel, tree.body[0].lineno - 1 if doc else 0)
    return markdown_snippets(path.read_text(), rel, doc=rel)


def _comment_snippets(lines: list[str | None], rel: str, line0: int = 0) -> list[Snippet]:
    """Snippets of comment or docstring lines (None: a line that is neither): a line indented
    by 2 or more (in a `- ` list item, by more than the item's text) that starts with a
    command is a code line (a trailing `\\` joins the next); the other lines are prose, read
    paragraph by paragraph for inline code spans."""
    out, prose, item, i = [], [], False, 0

    def flush():
        if prose:
            out.extend(markdown_snippets("\n".join(t for _, t in prose), rel, line0 + prose[0][0], rel))
            prose.clear()

    while i < len(lines):
        text, first = lines[i], i
        if text is None or not text.strip():
            flush()
            item = False
        else:
            item = text.startswith("- ") or (item and text.startswith("  "))
            indent = 4 if item and not text.startswith("- ") else 2
            if re.match(r" {%d,}(?:[A-Z_]+=\S*\s+)*(?:\S*/)?car-jax\s" % indent, text):
                flush()
                while text.rstrip().endswith("\\") and i + 1 < len(lines) and lines[i + 1] is not None:
                    i += 1
                    text = text.rstrip()[:-1].rstrip() + " " + lines[i].strip()
                out.append(Snippet(f"{rel}:{line0 + first + 1}", text.strip(), "block", rel))
            else:
                prose.append((first, text))
        i += 1
    flush()
    return out


def doc_paths(patterns=DOCS) -> list[Path]:
    return sorted({p for pattern in patterns for p in ROOT.glob(pattern) if p.is_file()})


# --- commands ----------------------------------------------------------------------------

def command_texts(snippet: Snippet) -> list[str]:
    """The text of each car-jax command in a snippet, from `car-jax` to the end of the snippet
    (the shell reading cuts it at an operator or a comment). An error line (`car-jax train:
    error: ...`), the bare name `car-jax` and a mention in a code line's `#` comment are not
    commands. `tpu_scripts/launch.sh [--dry-run] CONFIG [key=value ...]` runs
    `car-jax train --config CONFIG [key=value ...]` on the workers, and is read as that."""
    def commented(m) -> bool:  # after a `#` in a code line
        return snippet.kind == "block" and bool(re.search(r"(^|\s)#", snippet.text[:m.start()]))

    out = []
    for m in CAR_JAX.finditer(snippet.text):
        rest = snippet.text[m.end():]
        if re.match(r"\s+\S", rest) and not re.match(r"\s*[a-z-]+: error:", rest) and not commented(m):
            out.append("car-jax" + rest)
    for m in LAUNCH.finditer(snippet.text):  # launch.sh [its flags] CONFIG [overrides]: car-jax train's
        rest = re.sub(r"(?<!\S)--(?:dry-run|no-check)(?!\S)", " ", snippet.text[m.end():])
        if re.match(r"\s+[^\s-]", rest) and not commented(m):
            out.append("car-jax train --config" + rest)
    return out


def variants(text: str) -> list[str]:
    """A command with its optional groups `[...]` all left out, and with each group in on its
    own (a usage line's groups may exclude each other: `[--check] [--print]`), once per choice
    of an `a|b` word in it. `<...>` placeholders become PH."""
    text = re.sub(r"<[A-Za-z][^<>\n]*>", PH, text)
    groups = list(re.finditer(r"(?<!\S)\[([^\[\]]*)\]", text))
    choice = re.compile(r"(?<!\S)([^\s|'\"]+(?:\|[^\s|'\"]+)+)(?!\S)")

    def keep(only):
        out, pos = [], 0
        for g in groups:
            out += [text[pos:g.start()], g.group(1) if g is only else " "]
            pos = g.end()
        return re.sub(r"[ \t]+", " ", "".join(out) + text[pos:]).strip()

    out = []
    for base in [keep(None)] + [keep(g) for g in groups]:
        choices = [m.group(1).split("|") for m in choice.finditer(base)]
        for k in range(max((len(c) for c in choices), default=1)):
            it = iter(choices)
            out.append(choice.sub(lambda m: (lambda c: c[min(k, len(c) - 1)])(next(it)), base))
    return list(dict.fromkeys(out))


def is_placeholder(value: str) -> bool:
    """A value the reader fills in: `<...>` (PH), an ALL-CAPS word, a single letter, anything
    with `...` in it, or a path or list with such a part (`configs/X.yaml`, `RUN/tb`,
    `fsdp=F,tp=T`, `tfds:NAME:SPLIT`)."""
    def word(part: str) -> bool:
        return bool(ALL_CAPS.fullmatch(part) or re.fullmatch(r"[A-Za-z]", part))

    return PH in value or "..." in value or any(word(part.split(".")[0]) for part in re.split(r"[/=,:]", value))


def _subparser(parser, name):
    for action in parser._actions:  # argparse keeps its sub-parsers on a _SubParsersAction
        if isinstance(action.choices, dict) and name in action.choices:
            return action.choices[name]
    return None


def argv_of(text: str, parser) -> list[str]:
    """The arguments after `car-jax` as the shell reads them (cut at the first operator or
    comment), with placeholders as PLACEHOLDER_ARG and `...` / `key=value` left out when they
    stand for more arguments. Raises ValueError for text the shell cannot read."""
    lex = shlex.shlex(text, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    words = []
    for word in lex:
        if set(word) <= SHELL_OPERATORS:
            break
        words.append(word)
    words = words[1:]  # car-jax
    sub = _subparser(parser, words[0]) if words else None

    def value_of(option: str) -> str | None:
        """The placeholder value of `option` (PH for a string, PLACEHOLDER_ARG for a number),
        None if it is no option of the sub-command that takes a value."""
        action = sub._option_string_actions.get(option) if sub is not None and option.startswith("-") else None
        if action is None or action.nargs == 0:
            return None
        return PH if action.type is None else PLACEHOLDER_ARG

    argv = []
    for word in words:
        if word in ("...", "\u2026"):
            value = value_of(argv[-1]) if argv else None
            if value is not None:
                argv.append(value)
            continue
        if word == "key=value":
            continue
        if word == PH or ALL_CAPS.fullmatch(word):
            argv.append((value_of(argv[-1]) if argv else None) or PH)
            continue
        argv.append(word)
    return argv


def parse(parser, argv: list[str]):
    """argparse's namespace, or its error line (SystemExit(0) of --help / --version: None)."""
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            return parser.parse_args(argv), None
    except SystemExit as e:
        if not e.code:
            return None, None
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        return None, lines[-1] if lines else f"exit {e.code}"


# --- configs -----------------------------------------------------------------------------

def config_of() -> dict[str, type]:
    """The config class each config-driven sub-command loads its --config and overrides into
    (`car_jax/cli/*.py`; `test_config_of_is_what_each_command_loads` keeps it so); control's
    overrides reach every unit's TrainConfig."""
    from car_jax.eval.config import EvalConfig
    from car_jax.eval.pilot import PilotConfig
    from car_jax.experiment.config import ExperimentConfig
    from car_jax.train.config import TrainConfig

    return {"train": TrainConfig, "plan": TrainConfig, "control": TrainConfig, "eval": EvalConfig,
            "pilot": PilotConfig, "experiment": ExperimentConfig}


def config_classes(configs: dict[str, type] | None = None) -> list[type]:
    """The top-level config classes (a key outside a command may belong to any)."""
    return list(dict.fromkeys((configs or config_of()).values()))


def _key_types(cls: type) -> dict[str, typing.Any]:
    from car_jax.config import _keys  # the loader's own notion of a key

    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in _keys(cls)}


def key_error(cls: type, key: str) -> str | None:
    """None when `key` (dotted) is a key of config class `cls`, else why not (with the loader's
    kind of "did you mean")."""
    def walk(tp, parts, done):
        if not parts or tp is typing.Any:
            return None
        origin, args = typing.get_origin(tp), typing.get_args(tp)
        if origin in (typing.Union, types.UnionType):
            errors = [walk(a, parts, done) for a in args if a is not type(None)]
            return None if None in errors else next((e for e in errors if e), None)
        if origin is dict:
            return walk(args[1] if args else typing.Any, parts[1:], done + [parts[0]])
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            keys = _key_types(tp)
            if parts[0] not in keys:
                close = difflib.get_close_matches(parts[0], list(keys), n=1, cutoff=0.6)
                hint = f"; did you mean {'.'.join(done + close)!r}?" if close else ""
                return f"unknown key {'.'.join(done + parts[:1])!r} in {tp.__name__}{hint}"
            return walk(keys[parts[0]], parts[1:], done + parts[:1])
        return f"{'.'.join(done)!r} is a value ({tp}), not a section with a key {parts[0]!r}"

    return walk(cls, key.split("."), [])


def load_command(command: str, cls: type, config: str | None, overrides: list[str]):
    """The config a sub-command builds from --config and its overrides (ConfigError if bad)."""
    from car_jax.config import load_config

    if command == "experiment":
        from car_jax.experiment.config import ExperimentConfig, load_experiment
        if cls is ExperimentConfig:
            return load_experiment(config, overrides)
    return load_config(cls, config, overrides)


def _tracked_path(path: str) -> bool:
    """Whether a path the docs name must exist: one under configs/ (shipped), or under a
    committed results/ folder (results/X/... once results/X exists; an experiment's comments
    name the folder it will write)."""
    parts = Path(path).parts
    if is_placeholder(path) or not parts:
        return False
    return parts[0] == "configs" or (parts[0] == "results" and len(parts) > 2 and (ROOT / parts[0] / parts[1]).is_dir())


def command_problems(args, configs: dict[str, type]) -> list[str]:
    """What is wrong with a parsed command beyond argparse: its --config file, its override
    keys, the config it builds, and the few values its sub-command checks itself."""
    from car_jax.config import ConfigError

    errors: list[str] = []
    config = getattr(args, "config", None)
    if config is not None and _tracked_path(config) and not (ROOT / config).is_file():
        errors.append(f"--config {config}: no such file")
    if args.command == "plan" and args.table and _tracked_path(args.table) and not (ROOT / args.table).is_dir():
        errors.append(f"--table {args.table}: no such folder")
    overrides = list(getattr(args, "overrides", None) or [])
    if args.command == "pilot":
        from car_jax.cli.pilot import overrides as pilot_overrides
        overrides = pilot_overrides(args)
    cls = configs.get(args.command)
    if cls is None:
        return errors + [f"override {o!r}: {args.command} takes no overrides" for o in overrides]
    concrete = []
    for item in overrides:
        m = OVERRIDE.fullmatch(item)
        if not m:
            errors.append(f"{item!r} is not a dotted key=value override")
            continue
        why = key_error(cls, m.group(1))
        if why:
            errors.append(f"{item}: {why}")
        elif not is_placeholder(m.group(2)):
            concrete.append(item)
    if errors:
        return errors
    path = str(ROOT / config) if config is not None and (ROOT / config).is_file() else None
    try:
        if args.command == "control" and cls is config_of()["control"]:
            _control_configs(args, concrete)
        else:
            cfg = load_command(args.command, cls, path, concrete)
            if args.command == "eval" and args.gate is not None:
                _gate_check(cfg, args.gate)
    except ConfigError as err:
        errors.append(f"the config does not load: {err}")
    if args.command == "plan":
        from car_jax.plan import parse_mesh
        from car_jax.train.flops import chip_named
        try:
            if args.chip and not is_placeholder(args.chip):
                chip_named(args.chip)
            if args.mesh and not is_placeholder(args.mesh):
                parse_mesh(args.mesh)
        except ValueError as err:
            errors.append(str(err))
    return errors


def _gate_check(cfg, tau: float) -> None:
    """`car-jax eval --gate TAU`'s checks: TAU in [0, 1], a tool mode."""
    from car_jax.cli.eval import check_gate
    check_gate(cfg, tau)


def _control_configs(args, overrides: list[str]) -> None:
    """`car-jax control`'s checks of --arms and --split and the configs of its units."""
    from car_jax.config import ConfigError
    from car_jax.data import chance
    from car_jax.experiment import control

    arms = args.arms or (list(control.QUICK_ARMS) if args.quick else list(control.DEFAULT_ARMS))
    unknown = [a for a in arms if a not in control.ARMS]
    if unknown:
        raise ConfigError(f"--arms: unknown arm {unknown[0]!r}; choose from {', '.join(control.ARMS)}")
    split = args.split or (control.QUICK_SPLIT if args.quick else "train")
    if split not in chance.SPLITS:
        raise ConfigError(f"--split: {split!r} is not one of {', '.join(chance.SPLITS)}")
    overrides = [f"data.train_split={split}", *overrides]
    control.warm_config(Path(args.out), 0, overrides)
    default = control.QUICK_STEPS if args.quick else control.BUDGETS[split].steps
    steps = args.steps if args.steps is not None else default
    if steps < 1:
        raise ConfigError(f"--steps: {steps} must be >= 1")
    for arm in arms:
        control.arm_config(Path(args.out), control.ARMS[arm], 0, steps, overrides)


# --- the checker -------------------------------------------------------------------------

def check_command(snippet: Snippet, text: str, parser, configs) -> list[Problem]:
    """argparse's verdict on each variant of a command, then `command_problems`."""
    problems = []
    for variant in variants(text):
        try:
            argv = argv_of(variant, parser)
        except ValueError as err:
            problems.append(Problem(snippet.where, text, f"the shell cannot read it: {err}"))
            continue
        if not argv:
            continue
        if snippet.kind == "span" and len(argv) == 1 and not argv[0].startswith("-"):
            if _subparser(parser, argv[0]) is None:  # "`car-jax build-index`": the sub-command's name
                problems.append(Problem(snippet.where, text, f"no sub-command {argv[0]!r}"))
            continue
        args, error = parse(parser, argv)
        try:
            plain = shlex.split(text, comments=True)[1:] == argv
        except ValueError:
            plain = False
        shown = text if plain else f"{text}  (read as: car-jax {shlex.join(argv)})"
        if error:
            problems.append(Problem(snippet.where, shown, f"argparse: {error}"))
        elif args is not None:
            problems += [Problem(snippet.where, shown, e) for e in command_problems(args, configs)]
    return problems


def check_error_line(snippet: Snippet, configs) -> list[Problem]:
    """A quoted error line `car-jax CMD: error: KEY: VALUE message` must be what the loader
    says for KEY=VALUE with CMD's config class (the doc may cut it short with `...`)."""
    from car_jax.config import ConfigError

    m = re.search(ERROR_LINE.pattern, snippet.text)
    if not m:
        return []
    command, message = m.group(1), m.group(2).strip().removesuffix("...").strip()
    key = re.match(r"([a-z_][\w.]*): (\S+)", message)
    cls = configs.get(command)
    if not key or cls is None:
        return [Problem(snippet.where, snippet.text, "an error line that names no config key and value: "
                                                     "reproduce it here or list it in ALLOWED")]
    try:
        load_command(command, cls, None, [f"{key.group(1)}={key.group(2)}"])
        actual = "(it loads)"
    except ConfigError as err:
        actual = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    if not actual.startswith(message):
        return [Problem(snippet.where, snippet.text, f"car-jax {command} prints: car-jax {command}: error: {actual}")]
    return []


def _sections(cls: type) -> set[str]:
    """The top-level keys of a config class that are sections (a dataclass or a dict)."""
    def section(tp) -> bool:
        tps = [a for a in typing.get_args(tp) if a is not type(None)] if typing.get_origin(tp) in (
            typing.Union, types.UnionType) else [tp]
        return any(typing.get_origin(t) is dict or (isinstance(t, type) and dataclasses.is_dataclass(t)) for t in tps)

    return {name for name, tp in _key_types(cls).items() if section(tp)}


def _all_keys(cls: type) -> set[str]:
    """Every key name of a config class, at any depth."""
    out: set[str] = set()

    def walk(tp):
        if typing.get_origin(tp) in (typing.Union, types.UnionType, dict, tuple, list):
            for a in typing.get_args(tp):
                walk(a)
        elif isinstance(tp, type) and dataclasses.is_dataclass(tp) and tp.__name__ not in seen:
            seen.add(tp.__name__)
            for name, sub in _key_types(tp).items():
                out.add(name)
                walk(sub)

    seen: set[str] = set()
    walk(cls)
    return out


def _shipped_configs() -> list[Path]:
    return sorted((ROOT / "configs").glob("**/*.yaml"))


def _loads_somewhere(cls: type, override: str) -> str | None:
    """None when `override` loads onto `cls`'s defaults or onto some shipped config of `cls`
    (a value may need the context its doc gives it: `rl.steps=0` with an SFT warm start), else
    the error from the defaults."""
    from car_jax.config import ConfigError, load_config

    try:
        load_config(cls, None, [override])
        return None
    except ConfigError as err:
        first = str(err)
    for path in _shipped_configs():
        try:
            load_config(cls, path, [])
        except (ConfigError, FileNotFoundError):
            continue  # not a config of this class
        try:
            load_config(cls, path, [override])
            return None
        except ConfigError:
            pass
    return first


def check_keys(snippet: Snippet, configs) -> list[Problem]:
    """A span of `key=value` overrides (one or several), `dotted.key: value`, or a bare dotted
    key whose first part is a config section: each key must be one of some config class, each
    concrete value load. `key: value` without a dot names a key of an unnamed section: some
    section must have it."""
    classes = config_classes(configs)
    yaml_style = re.fullmatch(r"([a-z_][a-z0-9_]*(?:\.[a-z0-9_]+)*): (\S.*)", snippet.text)
    if yaml_style and "." not in yaml_style.group(1):  # `max_concurrent: 0`: a key of some section
        leaf = yaml_style.group(1)
        if not any(leaf in _all_keys(c) for c in classes):
            return [Problem(snippet.where, snippet.text, f"no config section has a key {leaf!r}")]
        return []
    try:
        words = shlex.split(snippet.text) if not yaml_style else ["=".join(yaml_style.groups())]
    except ValueError:
        return []
    matches = [OVERRIDE.fullmatch(w) for w in words]
    if words and all(matches):
        items = [(m.group(1), m.group(2)) for m in matches]
    elif len(words) == 1 and DOTTED_KEY.fullmatch(words[0]) and any(
            words[0].split(".")[0] in _sections(c) for c in classes):
        items = [(words[0], None)]
    else:
        return []
    problems = []
    for key, value in items:
        if "." not in key and not any(key in _key_types(c) for c in classes):
            continue  # `fsdp=4`: no top-level key of a config, read as prose
        owners = [c for c in classes if key_error(c, key) is None]
        if not owners:
            why = "; ".join(dict.fromkeys(key_error(c, key) for c in classes))
            problems.append(Problem(snippet.where, snippet.text, f"no config has the key {key!r}: {why}"))
            continue
        if value is None or value == "" or is_placeholder(value):
            continue
        errors = [_loads_somewhere(cls, f"{key}={value}") for cls in owners]
        if all(errors):
            problems.append(Problem(snippet.where, snippet.text, f"{key}={value} does not load: "
                                    + "; ".join(f"{c.__name__}: {e}" for c, e in zip(owners, errors))))
    return problems


CONFIG_PATH = re.compile(r"(?<![\w./-])configs/[\w./<>-]*")


def check_config_paths(path: Path) -> list[Problem]:
    """Every `configs/...` path a doc names exists (placeholders like configs/X.yaml aside)."""
    rel = path.relative_to(ROOT).as_posix()
    problems = []
    for n, line in enumerate(path.read_text().split("\n"), 1):
        for m in CONFIG_PATH.finditer(line):
            name = m.group(0).rstrip(".")
            if "<" in name or any(ALL_CAPS.fullmatch(Path(part).stem) for part in Path(name).parts):
                continue
            if not (ROOT / name).exists():
                problems.append(Problem(f"{rel}:{n}", name, "no such file or folder"))
    return problems


_CHECKED: dict[tuple[str, str], list[tuple[str, str]]] = {}  # (kind, text) -> its (text, message)s, default configs


def check_snippets(snippets: list[Snippet], configs: dict[str, type] | None = None) -> list[Problem]:
    """Every problem of a doc's snippets: commands that do not parse or whose config does not
    build, unknown keys, values that do not load, error lines the CLI no longer prints. (With
    the real configs a snippet's verdict is kept: a text checked once is not checked again.)"""
    from car_jax.cli import build_parser

    cache = _CHECKED if configs is None else {}
    configs = configs or config_of()
    parser = None
    problems = []
    for s in snippets:
        if (s.doc, s.text) in ALLOWED:
            continue
        if (s.kind, s.text) not in cache:
            parser = parser or build_parser()
            found = check_error_line(s, configs)
            commands = command_texts(s)
            for text in commands:
                found += check_command(s, text, parser, configs)
            if s.kind == "span" and not commands:
                found += check_keys(s, configs)
            cache[s.kind, s.text] = [(p.text, p.message) for p in found]
        problems += [Problem(s.where, text, message) for text, message in cache[s.kind, s.text]]
    return list(dict.fromkeys(problems))  # a mistake outside the optional groups: once, not per variant


def check_markdown(text: str, where: str = "doc.md", configs: dict[str, type] | None = None) -> list[Problem]:
    return check_snippets(markdown_snippets(text, where, doc=where), configs)


def _report(problems: list[Problem]) -> str:
    return f"{len(problems)} doc mismatch(es):\n" + "\n".join(map(str, problems))


# --- the tests ---------------------------------------------------------------------------

DOC_FILES = [p.relative_to(ROOT).as_posix() for p in doc_paths()]
CONFIG_FILES = [p.relative_to(ROOT).as_posix() for p in doc_paths(CONFIG_COMMENTS)
                if CAR_JAX.search(p.read_text())]
MODULE_FILES = [p.relative_to(ROOT).as_posix() for p in doc_paths(DOCSTRINGS)]


@pytest.mark.parametrize("doc", DOC_FILES + CONFIG_FILES + MODULE_FILES)
def test_doc_commands_and_keys_work_today(doc):
    problems = check_snippets(doc_snippets(ROOT / doc))
    assert not problems, _report(problems)


@pytest.mark.parametrize("doc", DOC_FILES)
def test_doc_config_paths_exist(doc):
    problems = check_config_paths(ROOT / doc)
    assert not problems, _report(problems)


def test_the_docs_are_read():
    """The extractor finds the commands it should (a broken reader would pass everything)."""
    def commands(doc):
        return [t for s in doc_snippets(ROOT / doc) for t in command_texts(s)]

    readme = commands("README.md")
    assert len(readme) >= 40
    for sub in ("train", "eval", "plan", "pilot", "control", "experiment", "run", "assets", "convert"):
        assert any(t.startswith(f"car-jax {sub}") for t in readme), sub
    assert any(re.search(r"qwen2.5-7b_car_mscr.yaml +run.dir=", t) for t in readme)  # a `\` continuation
    tpu = commands("tpu_scripts/README.md")
    assert any(t.startswith("car-jax train --check") for t in tpu)
    launch = r"car-jax train --config +configs/qwen2.5-3b_car_mscr.yaml +model.path=\S+ +data.train=\S+"
    assert any(re.fullmatch(launch, t) for t in tpu)  # launch.sh CONFIG overrides
    assert any(t.startswith("car-jax eval") for t in commands("notebooks/quickstart.ipynb"))
    assert any(t.startswith("car-jax build-index") for t in commands("car_jax/tools/README.md"))
    assert CONFIG_FILES
    spans = [s.text for s in doc_snippets(ROOT / "README.md") if s.kind == "span"]
    assert "rl.loss.tis_cap=C" in spans and "'run.loggers=[tensorboard,wandb]'" in spans


def test_placeholders_and_optional_groups():
    from car_jax.cli import build_parser

    parser = build_parser()
    assert variants("car-jax plan --config c.yaml [--json] [--xla]") == [
        "car-jax plan --config c.yaml", "car-jax plan --config c.yaml --json", "car-jax plan --config c.yaml --xla"]
    assert variants("car-jax build-index --out i/ [--backend dense|bm25]") == [
        "car-jax build-index --out i/", "car-jax build-index --out i/ --backend dense",
        "car-jax build-index --out i/ --backend bm25"]
    assert argv_of(variants("car-jax experiment --config x.yaml --report-to <dir>")[0], parser) == [
        "experiment", "--config", "x.yaml", "--report-to", PH]
    assert argv_of("car-jax eval --gate TAU key=value ...", parser) == ["eval", "--gate", PLACEHOLDER_ARG]
    assert argv_of("car-jax serve-retriever --faiss-index ... --corpus x", parser) == [
        "serve-retriever", "--faiss-index", PH, "--corpus", "x"]
    assert argv_of("car-jax eval ... output.resume=true  # continue", parser) == ["eval", "output.resume=true"]
    assert argv_of("car-jax plan --table configs/fit > docs/PLAN.md", parser) == ["plan", "--table", "configs/fit"]
    assert argv_of("car-jax pilot 'kinds=[evidence]' \"run.dir=/a b\" && ls", parser) == [
        "pilot", "kinds=[evidence]", "run.dir=/a b"]
    assert all(map(is_placeholder, ["C", "k", "PATH", "...", f"runs/{PH}", "http://..."]))
    assert not any(map(is_placeholder, ["0.0", "true", "runs/car/hf", "[a,b]", "brier"]))


BAD_DOC = """\
# A doc gone stale

```
car-jax train --config configs/smollm2_world_cpu.yaml rl.stepz=3
car-jax eval --limit 80
car-jax eval mode=drect
car-jax train --config configs/no_such.yaml
car-jax experiment --config configs/experiment/world_car.yaml --prunee
car-jax control --arms brier,coin
```

Inline: `rl.loss.tis_capp=2`, `car-jax eval --mode direct`, `rollout.max_concurent`,
`rl.steps=many`, and the error `car-jax train: error: rl.steps: -3 must be >= 7`.
Fine: `rl.loss.tis_cap=C`, `'run.loggers=[tensorboard,wandb]'`, `car-jax eval mode=direct`.
YAML: `max_concurent: 0`, `sft.steps: many`; fine: `max_concurrent: 0`, `sft.data: world`.
"""


def test_the_checker_reports_each_stale_command_and_key():
    problems = check_markdown(BAD_DOC)
    found = {(p.where, p.message.split(":")[0]) for p in problems}
    text = _report(problems)
    assert ("doc.md:4", "rl.stepz=3") in found, text
    assert "did you mean 'rl.steps'" in text
    assert ("doc.md:5", "argparse") in found and "unrecognized arguments: --limit" in text
    assert any(p.where == "doc.md:6" and "'drect' is not one of" in p.message for p in problems), text
    assert ("doc.md:7", "--config configs/no_such.yaml") in found, text
    assert any(p.where == "doc.md:8" and "--prunee" in p.message for p in problems), text
    assert any(p.where == "doc.md:9" and "unknown arm 'coin'" in p.message for p in problems), text
    assert any(p.where == "doc.md:12" and p.text == "rl.loss.tis_capp=2" for p in problems), text
    assert any(p.where == "doc.md:12" and "--mode" in p.message for p in problems), text
    assert any(p.where == "doc.md:12" and p.text == "rollout.max_concurent" for p in problems), text
    assert any(p.where == "doc.md:13" and p.text == "rl.steps=many" for p in problems), text
    assert any(p.where == "doc.md:13" and "must be >= 0" in p.message for p in problems), text
    assert any(p.where == "doc.md:15" and p.text == "max_concurent: 0" for p in problems), text
    assert any(p.where == "doc.md:15" and p.text == "sft.steps: many" for p in problems), text
    assert len(problems) == 13, text  # nothing on the fine line 14, nor for the fine part of 15


def test_renaming_a_documented_key_or_flag_fails():
    """The README as it is passes; with a key or a flag renamed in it (as if the code had
    renamed them and the README not), it fails at that line."""
    readme = (ROOT / "README.md").read_text()
    assert not check_markdown(readme, "README.md")
    for old, new in (("rl.loss.tis_cap=C", "rl.loss.tis_capp=C"), ("reward.kind=brier", "reward.kinds=brier"),
                     ("--prune", "--prunee"), ("output.resume=true", "output.resume=maybe")):
        assert old in readme
        problems = check_markdown(readme.replace(old, new, 1), "README.md")
        line = readme[:readme.index(old)].count("\n") + 1
        assert problems and {p.where for p in problems} == {f"README.md:{line}"}, (old, _report(problems))


def test_notebook_cells_comments_and_docstrings_are_read(tmp_path):
    cells = [{"cell_type": "markdown", "metadata": {}, "source": ["Next: `car-jax eval --limit 80`.\n"]},
             {"cell_type": "code", "metadata": {}, "execution_count": None, "outputs": [], "source": [
                 "!car-jax eval --mode direct\n", "import subprocess\n",
                 "subprocess.run([\"car-jax\", \"train\", \"rl.stepz=3\"])  # then `car-jax plan --chip v9`\n"]}]
    notebook = tmp_path / "x.ipynb"
    notebook.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    problems = check_snippets(doc_snippets(notebook))
    assert [p.where.split(" cell ")[1] for p in problems] == ["0 line 1", "1 line 1", "1 line 3", "1 line 3"], \
        _report(problems)
    yaml = tmp_path / "x.yaml"
    yaml.write_text("# Run it with\n#   car-jax train --config configs/x.yaml \\\n#     rl.stepz=3\n"
                    "# - a list item whose text goes on:\n#   car-jax train starts from it, and `rl.stepz=4`\n"
                    "rl:\n  steps: 3  # not car-jax\n")
    snippets = doc_snippets(yaml)
    assert [(s.where.split(":")[1], s.kind, s.text) for s in snippets] == [
        ("2", "block", "car-jax train --config configs/x.yaml rl.stepz=3"), ("5", "span", "rl.stepz=4")]
    module = tmp_path / "x.py"
    module.write_text('"""`car-jax eval` usage:\n\n    car-jax eval mode=drect\n"""\nX = 1\n')
    assert [(s.where.split(":")[1], s.text) for s in doc_snippets(module)] == [
        ("1", "car-jax eval"), ("3", "car-jax eval mode=drect")]


@dataclasses.dataclass(frozen=True)
class RL:  # test_a_key_renamed_in_the_code_fails: rl.steps renamed rl.n_steps
    n_steps: int = 1


@dataclasses.dataclass(frozen=True)
class Train:
    rl: RL = RL()


def test_a_key_renamed_in_the_code_fails():
    """The keys come from the config classes: a class whose `rl.steps` is called otherwise
    refuses the doc's `rl.steps=3`."""
    configs = {**config_of(), "train": Train, "plan": Train, "control": Train}
    doc = "`car-jax train rl.steps=3` and `rl.steps=3`"
    assert not check_markdown(doc)
    problems = check_markdown(doc, configs=configs)
    assert len(problems) == 2 and all("unknown key 'rl.steps' in RL" in p.message for p in problems), _report(problems)


def test_config_of_is_what_each_command_loads(monkeypatch):
    """config_of() names the class each sub-command hands the loader (its function run with
    the loader replaced by one that records the class and stops)."""
    import importlib

    from car_jax.cli import COMMAND_MODULES, build_parser

    class Loaded(Exception):
        pass

    def record(cls, *args, **kwargs):
        raise Loaded(cls)

    for name in COMMAND_MODULES:
        module = importlib.import_module(name)
        if hasattr(module, "load_config_args"):
            monkeypatch.setattr(module, "load_config_args", record)
    import car_jax.experiment.config as experiment_config
    monkeypatch.setattr(experiment_config, "load_experiment",
                        lambda *args, **kwargs: record(experiment_config.ExperimentConfig))
    parser = build_parser()
    for command, cls in config_of().items():
        if command == "control":
            continue  # no config of its own: its overrides go to every unit's TrainConfig (_control_configs)
        args = parser.parse_args([command])
        with pytest.raises(Loaded) as got:
            args.func(args)
        assert got.value.args[0] is cls, command
