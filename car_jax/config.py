"""YAML configs for nested frozen dataclasses, with dotted command-line overrides.

Each concern owns a small frozen dataclass; a top-level config composes them
(`TrainConfig(model: PolicyConfig, rl: RLConfig, ...)` for `car-jax train`,
`EvalConfig(model: EvalModelConfig, episode: EpisodeConfig, ...)` for `car-jax eval`; both
commands read `[--config X.yaml] key=value ...`). This module is the generic machinery:

    cfg = load_config(TrainConfig, "configs/tiny_test.yaml", ["rl.loss.kl_coef=0.0",
                                                             "run.loggers=[tensorboard,wandb]"])
    save_config(cfg, run_dir / "config.yaml")   # load_config(TrainConfig, that) == cfg

Rules:
- Values are checked against the field annotations (resolved with `typing.get_type_hints`,
  so `from __future__ import annotations` is fine; the dataclasses must be importable at
  module level for their annotations to resolve). Supported: int, float (an int is accepted
  and converted), bool (only true/false: no 0/1 or "yes" strings), str, None, `X | Y`,
  `tuple[X, ...]`, `tuple[X, Y]`, `list[X]`, `dict[str, X]`, `Literal[...]`, `Any`, and
  nested dataclasses. YAML lists become tuples where the annotation says tuple.
- Missing sections and keys take the dataclass defaults; a nested section given in part is
  merged onto the field's default instance (so `default_factory=lambda: PolicyConfig(dtype="bfloat16")`
  keeps bfloat16 unless the YAML sets it).
- Overrides are `dotted.key=value`; the value is parsed as YAML (`0.0`, `true`, `[1, 2]`,
  `null`; an empty value is null). An override replaces the whole value at its key.
- Numbers like `1e-6` are floats (PyYAML alone would read them as strings); `yes`, `no`,
  `on` and `off` are strings (PyYAML alone would read them as bools, YAML 1.1 style).
- Numbers must be usable: a float that is inf, -inf or nan is refused, and so is one beyond
  float32's range (3.4e38: the device computes in float32) or an int beyond int32's (counts
  and sizes become device shapes; a PRNG key holds 32 bits of a seed), in lists and dicts
  too: `rollout.temperature: nan must be finite ...`. A field that takes any number says
  so with `metadata={"finite": False}`; one that may be absent is `float | None` (null).
- A YAML text is bounded before anything is built from it: at most MAX_DEPTH levels of
  nesting, MAX_NODES values with its aliases expanded (a "billion laughs" file of a few
  lines expands to 10^9), no alias inside its own anchor (`x: &x [*x]`), integers of at
  most MAX_INT_DIGITS digits, and a config file of at most MAX_BYTES.
- Every error is a `ConfigError` naming the dotted path of the bad key, the value, and
  what was expected. A dataclass checks its own ranges in `__post_init__` (with `require`,
  or by raising ValueError); a message that starts with `field=` (`Class.field=`, or a
  dotted `section.field=` below it) comes back at that key: `rl.steps: -3 must be >= 1`;
  any other message comes back prefixed with the path of the section that raised it.
- Every init field of a config dataclass is a key: a value the code computes at run time
  (the rollout's log-prob temperature, Dr.GRPO's horizon) is a function's argument instead.

Why not draccus (levanter's config library, 0.11.6 tried on the test dataclasses of
tests/test_config.py): it loses the error quality this module guarantees. A misspelt key
from the command line is argparse's `error: unrecognized arguments: --rl.kl_cof=0.1` after
the usage text and a SystemExit (no dotted path in context, no "did you mean", no allowed
keys); in a YAML file it is `DecodingError The fields `modle` are not valid for TrainCfg`
(again no suggestion, and no list of the valid ones); a wrong type reads
`DecodingError `rl.group_size`: Couldn't parse '2.5' into an int` (path and type, but a
bool accepts only its own spellings: `rl.use_kl=1` gives "Couldn't parse '1' into a bool"
with no hint); and overrides must be written `--rl.kl_coef=0.1`, not the `rl.kl_coef=0.1`
that configs/, tpu_scripts/ and the README use.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import yaml

T = TypeVar("T")

__all__ = ["ConfigError", "load_config", "build_config", "apply_overrides", "dump_config",
           "save_config", "parse_yaml", "require"]


MAX_BYTES = 1 << 20  # a config file's size
MAX_DEPTH = 100  # nested sections and lists in a YAML text
MAX_NODES = 100_000  # values in a YAML text once its aliases are expanded
MAX_INT_DIGITS = 100  # characters of a YAML integer (Python refuses more than 4,300 digits)
FLOAT32_MAX = 3.4028234663852886e38  # the largest float32; a config float must fit
INT32 = (-2**31, 2**31 - 1)  # the range of a config int


class ConfigError(ValueError):
    """A config file, override or value does not fit the config dataclasses."""


def require(ok: bool, field: str, value: Any, expected: str) -> None:
    """A range check for a config's `__post_init__`: unless `ok`, raises
    ValueError("field=value must be <expected>"), which the loader reports at the field's
    dotted key (`rollout.group_size: 1 must be >= 2 ...`)."""
    if not ok:
        raise ValueError(f"{field}={value!r} must be {expected}")


# --- YAML --------------------------------------------------------------------------------

class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6`, `5E3`, `-2e+4` as floats and only true / false as
    bools (YAML 1.2 style), and refuses integers of more than MAX_INT_DIGITS characters."""

    def construct_yaml_int(self, node):
        if len(node.value) > MAX_INT_DIGITS:
            raise yaml.constructor.ConstructorError(
                None, None, f"an integer of {len(node.value):,} characters (at most {MAX_INT_DIGITS})",
                node.start_mark)
        return super().construct_yaml_int(node)


_FLOAT_RE = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes strings like '1e-6', so they load back as strings."""


for _cls in (_Loader, _Dumper):
    _cls.yaml_implicit_resolvers = {
        k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:float"]
        for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()}
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))
# the loader's bools are true / false only (the dumper still quotes 'yes', for other readers)
_Loader.yaml_implicit_resolvers = {k: [(tag, rx) for tag, rx in v if tag != "tag:yaml.org,2002:bool"]
                                   for k, v in _Loader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def parse_yaml(text: str) -> Any:
    """Parses YAML text with the safe loader (plus `1e-6` floats), within the bounds of
    `_check_size`. Errors -> ConfigError, one line."""
    try:
        _check_size(text)
        return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)
    except ConfigError:
        raise
    except yaml.MarkedYAMLError as e:
        what = ": ".join(s for s in (e.context, e.problem) if s)
        raise ConfigError(f"invalid YAML{_at(e.problem_mark or e.context_mark)}: {what}") from None
    except (yaml.YAMLError, ValueError) as e:  # ValueError: a date like 2001-13-45, say
        raise ConfigError(f"invalid YAML: {e}") from None


def _check_size(text: str) -> None:
    """Reads the events of `text` (no values are built) and refuses nesting deeper than
    MAX_DEPTH, more than MAX_NODES values with the aliases expanded, and an alias inside its
    own anchor (a structure that contains itself)."""
    open_: list[list] = []  # [anchor, values so far] of each collection being read
    sizes: dict[str, int] = {}  # anchor -> its values, aliases expanded
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1])
            if len(open_) > MAX_DEPTH:
                raise ConfigError(f"YAML{_at(event.start_mark)}: nested deeper than {MAX_DEPTH} levels")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, n = open_.pop()
        elif isinstance(event, yaml.AliasEvent):
            if any(a == event.anchor for a, _ in open_):
                raise ConfigError(f"YAML{_at(event.start_mark)}: alias *{event.anchor} inside its own anchor "
                                  f"&{event.anchor} (a structure that contains itself)")
            anchor, n = None, sizes.get(event.anchor, 1)  # undefined: the composer says so
        elif isinstance(event, yaml.ScalarEvent):
            anchor, n = event.anchor, 1
        else:
            continue
        if anchor is not None:
            sizes[anchor] = n
        if open_:
            open_[-1][1] += n
            if open_[-1][1] > MAX_NODES:
                raise ConfigError(f"YAML{_at(event.start_mark)}: more than {MAX_NODES:,} values with its "
                                  f"aliases expanded (aliases of aliases: a 'billion laughs')")


def _at(mark) -> str:
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""


# --- overrides ---------------------------------------------------------------------------

def apply_overrides(data: Mapping[str, Any] | None, overrides: Sequence[str]) -> dict:
    """Returns a copy of the nested dict `data` with `a.b.c=value` overrides applied.

    Intermediate sections are created when missing. Key names are checked later, by
    `build_config`, against the dataclasses.
    """
    out = _deep_copy(dict(data or {}))
    if isinstance(overrides, str):
        raise ConfigError(f"overrides must be a list of 'key=value' strings, got the "
                          f"single string {overrides!r}; wrap it in a list")
    for item in overrides:
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value "
                              f"(e.g. rl.loss.kl_coef=0.0)")
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"override {item!r}: empty name in dotted key {key!r}")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(
                    f"override {item!r}: {'.'.join(parts[:i + 1])} is a value "
                    f"({child!r}), not a section, so it has no key {parts[i + 1]!r}")
            node = child
        try:
            node[parts[-1]] = parse_yaml(raw) if raw.strip() else None
        except ConfigError as e:
            raise ConfigError(f"{key}: {e}") from None
    return out


def _deep_copy(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


# --- building dataclasses ----------------------------------------------------------------

def load_config(cls: type[T], path: str | os.PathLike | None,
                overrides: Sequence[str] = ()) -> T:
    """Reads the YAML file at `path` (None: start from the defaults), applies the dotted
    `overrides`, and builds a `cls` instance (a dataclass), checking every value.

    Raises ConfigError (unknown key, wrong type, missing required key, invalid YAML,
    `__post_init__` failure, a file that is a folder, too big or not UTF-8) and
    FileNotFoundError for a missing file.
    """
    data: Any = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                raw = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            raise FileNotFoundError(f"config file {str(path)!r} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {str(path)!r} is a folder, not a YAML file") from None
        except OSError as e:
            raise ConfigError(f"config file {str(path)!r} cannot be read: {e.strerror}") from None
        if len(raw) > MAX_BYTES:
            raise ConfigError(f"config file {str(path)!r} is over {MAX_BYTES:,} bytes: not a config")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {str(path)!r} is not UTF-8 text (byte {raw[e.start]:#04x} "
                              f"at offset {e.start})") from None
        try:
            data = parse_yaml(text)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of sections, got "
                              f"{type(data).__name__} {data!r}")
    return build_config(cls, apply_overrides(data, overrides))


def build_config(cls: type[T], data: Mapping[str, Any] | T | None, path: str = "") -> T:
    """Builds dataclass `cls` from a nested mapping, checking types against annotations.

    `path` is the dotted prefix used in error messages ("" for the root).
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise ConfigError(f"{cls!r} is not a dataclass type")
    return _convert(cls, data, path)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except NameError as e:
        raise ConfigError(
            f"cannot resolve the annotations of {cls.__qualname__} ({e}); define config "
            f"dataclasses at module level and import every type they name") from None


def _build_dataclass(cls: type, data: Any, path: str) -> Any:
    if isinstance(data, cls):
        return data
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{_where(path)}: expected a mapping for section "
                          f"{cls.__name__}, got {type(data).__name__} {data!r}")
    hints = _hints(cls)
    fields = {f.name: f for f in _keys(cls)}
    for key in data:
        if key not in fields:
            raise ConfigError(_unknown_key(cls, path, key, list(fields)))
    kwargs = {}
    for name, f in fields.items():
        sub = f"{path}.{name}" if path else name
        if name in data:
            value = data[name]
            default = _default(f)
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                if value is None and not _allows_none(hints[name]):
                    value = {}  # an empty YAML section (`rl:`) means "all defaults"
                if isinstance(value, Mapping):  # a partial section, on the field's default
                    value = _merge(dump_config(default), value)
            kwargs[name] = _convert(hints[name], value, sub)
            if f.metadata.get("finite", True):
                _check_numbers(kwargs[name], sub)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{sub}: missing required key (no default in "
                              f"{cls.__name__}); set it in the YAML or with {sub}=...")
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError, AssertionError) as e:
        raise ConfigError(_post_init_message(cls, path, str(e), list(fields))) from e


_KEY_RE = re.compile(r"([A-Za-z_][\w.]*)=")


def _post_init_message(cls: type, path: str, msg: str, keys: list[str]) -> str:
    """A `__post_init__` error of section `path` as one line at its dotted key: a message
    "key=value rest" whose key names a field of `cls` (bare, after the name of `cls` or of a
    base class and a dot, dotted below it, or already the full dotted path) becomes
    "path.key: value rest"."""
    m = _KEY_RE.match(msg)
    if m:
        key, rest = m.group(1), msg[m.end():]
        for klass in cls.__mro__:  # "EpisodeConfig.top_k=" raised by a subclass's section too
            key = key.removeprefix(f"{klass.__name__}.")
        if key.split(".")[0] in keys:
            return f"{path}.{key}: {rest}" if path else f"{key}: {rest}"
        if path and key.startswith(f"{path}."):  # already the full dotted key
            return f"{key}: {rest}"
    return f"{_where(path)} ({cls.__name__}): {msg}"


def _check_numbers(value: Any, path: str) -> None:
    """Refuses a float that is not finite or beyond float32 and an int beyond int32, in a
    converted value and its lists, tuples and dicts (a nested section checked its own)."""
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{path}: {value!r} must be finite (a number, not inf or nan)")
        if abs(value) > FLOAT32_MAX:
            raise ConfigError(f"{path}: {value!r} must be at most {FLOAT32_MAX:.4g} in magnitude "
                              f"(float32's range: the device computes in float32)")
    elif isinstance(value, int) and not isinstance(value, bool):
        if not INT32[0] <= value <= INT32[1]:
            raise ConfigError(f"{path}: {value!r} must fit in int32 ({INT32[0]} to {INT32[1]}): counts and "
                              f"sizes become device shapes, and a PRNG key holds 32 bits of a seed")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_numbers(v, f"{path}[{i}]")
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _check_numbers(v, f"{path}.{k}")


def _keys(cls: type) -> list[dataclasses.Field]:
    """The fields of a dataclass that are config keys (its init fields)."""
    return [f for f in dataclasses.fields(cls) if f.init]


def _allows_none(tp: Any) -> bool:
    return tp is Any or tp is None or tp is type(None) or type(None) in typing.get_args(tp)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _merge(base: dict, update: Mapping) -> dict:
    out = dict(base)
    for k, v in update.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(
            out.get(k), dict) else v
    return out


def _unknown_key(cls: type, path: str, key: Any, allowed: list[str]) -> str:
    full = f"{path}.{key}" if path else str(key)
    msg = f"unknown key {full!r} in {cls.__name__}"
    close = difflib.get_close_matches(str(key), allowed, n=1, cutoff=0.6)
    if close:
        msg += f"; did you mean {(f'{path}.' if path else '') + close[0]!r}?"
    return msg + f"; allowed keys: {', '.join(allowed) or '(none)'}"


def _where(path: str) -> str:
    return path or "<root>"


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return "None" if tp is type(None) else tp.__name__
    return str(tp).replace("typing.", "")


def _bad(path: str, value: Any, tp: Any, hint: str = "") -> ConfigError:
    msg = (f"{_where(path)}: expected {_type_name(tp)}, got {type(value).__name__} "
           f"{value!r}")
    return ConfigError(msg + (f"; {hint}" if hint else ""))


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Checks `value` against annotation `tp`; returns it converted (lists -> tuples...)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is None and tp in (tuple, list, dict):
        origin = tp  # bare `tuple`: items unchecked
    if tp is Any:
        return value
    if tp is type(None) or tp is None:
        if value is not None:
            raise _bad(path, value, type(None))
        return None
    if origin is typing.Union or origin is types.UnionType:
        return _convert_union(tp, args, value, path)
    if origin is typing.Literal:
        for allowed in args:
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise ConfigError(f"{_where(path)}: {value!r} is not one of the allowed values "
                          f"{', '.join(repr(a) for a in args)}")
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, value, path)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _bad(path, value, tp, "write a YAML list, e.g. [a, b]")
        if origin is list:
            item = args[0] if args else Any
            return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
        if not args or (len(args) == 2 and args[1] is Ellipsis):
            item = args[0] if args else Any
            return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):
            raise _bad(path, value, tp, f"need exactly {len(args)} items")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(
            zip(args, value)))
    if origin is dict:
        if not isinstance(value, Mapping):
            raise _bad(path, value, tp, "write a YAML mapping")
        ktp, vtp = args if args else (Any, Any)
        return {_convert(ktp, k, f"{path}.<key {k!r}>"): _convert(vtp, v, f"{path}.{k}")
                for k, v in value.items()}
    if tp is bool:
        if not isinstance(value, bool):
            raise _bad(path, value, bool, "write true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _bad(path, value, int)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _bad(path, value, float)
        try:
            return float(value)
        except OverflowError:  # an int beyond any float
            raise ConfigError(f"{_where(path)}: a {value.bit_length()}-bit integer must be at most "
                              f"{FLOAT32_MAX:.4g} in magnitude (float32's range)") from None
    if tp is str:
        if not isinstance(value, str):
            raise _bad(path, value, str, f"quote it to make it a string: '{value}'")
        return value
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise _bad(path, value, tp)
    raise ConfigError(f"{_where(path)}: annotation {tp!r} is not supported by "
                      f"car_jax.config; use int/float/bool/str/tuple/dict/Literal/dataclass")


def _convert_union(tp: Any, args: tuple, value: Any, path: str) -> Any:
    # Exact type matches first, so `int | float` keeps an int and `float | str` a float.
    if value is None and type(None) in args:
        return None
    errors = []
    for a in sorted(args, key=lambda a: 0 if (isinstance(a, type) and type(value) is a) else 1):
        try:
            return _convert(a, value, path)
        except ConfigError as e:
            if _type_kind(a) == _value_kind(value):
                errors.append(str(e))
    if len(errors) == 1:  # one member of the value's shape: its error is the useful one
        raise ConfigError(errors[0])
    raise ConfigError(f"{_where(path)}: expected {_type_name(tp)}, got "
                      f"{type(value).__name__} {value!r}")


def _value_kind(value: Any) -> str:
    """'map', 'seq' or 'scalar': the YAML shape of a value."""
    if isinstance(value, Mapping) or dataclasses.is_dataclass(value):
        return "map"
    return "seq" if isinstance(value, (list, tuple)) else "scalar"


def _type_kind(tp: Any) -> str:
    """'map', 'seq' or 'scalar': the YAML shape an annotation accepts."""
    origin = typing.get_origin(tp) or tp
    if origin is dict or (isinstance(tp, type) and dataclasses.is_dataclass(tp)):
        return "map"
    return "seq" if origin in (tuple, list) else "scalar"


# --- dumping -----------------------------------------------------------------------------

def dump_config(obj: Any) -> Any:
    """Returns a dataclass config as plain YAML-able data: dicts, lists, scalars.

    `load_config(type(obj), file_with(dump_config(obj))) == obj` for supported types.
    """
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: dump_config(getattr(obj, f.name)) for f in _keys(type(obj))}
    if isinstance(obj, (list, tuple)):
        return [dump_config(v) for v in obj]
    if isinstance(obj, Mapping):
        return {k: dump_config(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise ConfigError(f"cannot dump {type(obj).__name__} {obj!r} to YAML; config values "
                      f"must be dataclasses, lists/tuples, dicts, str, int, float, bool, None")


def save_config(obj: Any, path: str | os.PathLike) -> None:
    """Writes `dump_config(obj)` as YAML to `path` (atomically: temp file + rename)."""
    text = yaml.dump(dump_config(obj), Dumper=_Dumper, sort_keys=False,
                     default_flow_style=False, allow_unicode=True)
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".config-", suffix=".yaml.tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
