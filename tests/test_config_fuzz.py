"""Hostile config values and files (issue 33, items 9 and 10): every numeric key of every
config a command reads is tried with nan, inf, -inf, a negative and a huge value, and each is
refused as one line naming its dotted key unless ALLOWED says the value means something; the
named cases of the issue; and config files that used to end in a traceback (a folder, bytes
that are not UTF-8, a recursive alias, deep nesting, a 5,000-digit integer, a billion laughs)."""
import dataclasses
import tracemalloc
import typing

import pytest

from car_jax.cli import main
from car_jax.config import ConfigError, load_config
from car_jax.eval.config import EvalConfig
from car_jax.eval.pilot import PilotConfig
from car_jax.experiment.config import ExperimentConfig
from car_jax.train.config import TrainConfig

CLASSES = (TrainConfig, EvalConfig, ExperimentConfig, PilotConfig)  # car-jax train (and plan), eval, experiment, pilot
VALUES = {"nan": ".nan", "inf": ".inf", "-inf": "-.inf", "negative": "-1", "huge": None}  # huge: HUGE[kind]
HUGE = {int: str(10**15), float: "1e300"}
# (a key, or the end of one after a dot; the value's name) -> why the value is meaningful there
ALLOWED = {
    ("mesh.fsdp", "negative"): "-1: the devices the other axis leaves",
    ("park_slots", "negative"): "-1: a quarter of max_concurrent",
}


def numeric_keys(obj, prefix=""):
    """(dotted key, int or float, whether the key holds a list) for each numeric config key of
    the config instance `obj`; a dict of sections (experiment arms, eval splits) by its
    default's keys."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        if not f.init or not f.metadata.get("config", True):
            continue
        key, value = prefix + f.name, getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from numeric_keys(value, key + ".")
        elif isinstance(value, dict) and value and all(dataclasses.is_dataclass(v) for v in value.values()):
            for name, section in value.items():
                yield from numeric_keys(section, f"{key}.{name}.")
        else:
            args = typing.get_args(hints[f.name])
            is_list = typing.get_origin(hints[f.name]) is tuple
            types = set(args[:1] if is_list else args or [hints[f.name]])
            kind = float if float in types else int if int in types else None
            if kind:
                yield key, kind, is_list


KEYS = [(cls, key, kind, is_list) for cls in CLASSES for key, kind, is_list in numeric_keys(cls())]


def _allowed(key, name):
    return any((key == k or key.endswith("." + k)) and name == n for k, n in ALLOWED)


def test_the_walk_finds_the_keys_of_the_issue():
    keys = {key for cls, key, *_ in KEYS if cls is TrainConfig}
    assert {"seed", "rollout.temperature", "rollout.tool_timeout_s", "tools.code_timeout_s", "tools.topk",
            "rl.optim.lr", "sft.lr", "reward.b1", "reward.format_penalty", "rl.loss.kl_coef", "rl.loss.clip_high",
            "rl.loss.dual_clip", "rollout.max_response_tokens", "rl.prompts_per_step", "rollout.group_size",
            "rollout.max_turns"} <= keys
    assert {"seeds", "arms.car.b1", "eval.splits.id.limit", "train.rl.optim.eps"} <= {
        key for cls, key, *_ in KEYS if cls is ExperimentConfig}


@pytest.mark.parametrize("cls, key, kind, is_list", KEYS, ids=[f"{c.__name__}-{k}" for c, k, *_ in KEYS])
def test_every_numeric_key_refuses_absurd_values(cls, key, kind, is_list):
    wrong = []
    for name, value in VALUES.items():
        value = value or HUGE[kind]
        override = f"{key}=[{value}]" if is_list else f"{key}={value}"
        try:
            load_config(cls, None, [override])
            if not _allowed(key, name):
                wrong.append(f"{override} loaded")
        except ConfigError as e:
            msg = str(e)
            if _allowed(key, name):
                wrong.append(f"{override} (allowed) refused: {msg}")
            elif not msg.startswith((f"{key}: ", f"{key}[")) or "\n" in msg:
                wrong.append(f"{override} refused, but not as one line at its key: {msg}")
    assert not wrong, "; ".join(wrong)


@pytest.mark.parametrize("override, message", [
    ("rollout.temperature=.nan", "rollout.temperature: nan must be finite"),
    ("rollout.temperature=.inf", "rollout.temperature: inf must be finite"),
    ("tools.code_timeout_s=.nan", "tools.code_timeout_s: nan must be finite"),
    ("tools.code_timeout_s=1e300", "tools.code_timeout_s: 1e+300 must be at most 3.403e+38"),
    ("tools.code_timeout_s=86401", "tools.code_timeout_s: 86401.0 must be <= 86400 (seconds: a day)"),
    ("rollout.tool_timeout_s=.inf", "rollout.tool_timeout_s: inf must be finite"),
    ("rollout.tool_timeout_s=1e9", "rollout.tool_timeout_s: 1000000000.0 must be <= 86400"),
    ("rl.optim.lr=.inf", "rl.optim.lr: inf must be finite"),
    ("sft.lr=.inf", "sft.lr: inf must be finite"),
    ("reward.b1=.inf", "reward.b1: inf must be finite"),
    ("reward.format_penalty=.inf", "reward.format_penalty: inf must be finite"),
    ("rl.loss.kl_coef=.inf", "rl.loss.kl_coef: inf must be finite"),
    ("rl.loss.clip_high=.inf", "rl.loss.clip_high: inf must be finite"),
    ("rl.loss.dual_clip=.nan", "rl.loss.dual_clip: nan must be finite"),
    ("seed=18446744073709551617", "seed: 18446744073709551617 must fit in int32"),
    ("rollout.max_response_tokens=1000000000000", "rollout.max_response_tokens: 1000000000000 must fit in int32"),
    ("rollout.max_response_tokens=1000001", "rollout.max_response_tokens: 1000001 must be <= 1000000"),
    ("rollout.max_obs_tokens=2000000000", "rollout.max_obs_tokens: 2000000000 must be <= 1000000"),
    ("rollout.max_turns=1001", "rollout.max_turns: 1001 must be <= 1000"),
    ("rollout.group_size=1001", "rollout.group_size: 1001 must be <= 1000"),
    ("rl.prompts_per_step=1000001", "rl.prompts_per_step: 1000001 must be >= 1 and <= 1000000"),
    ("rl.prompts_per_step=1000000000000000", "rl.prompts_per_step: 1000000000000000 must fit in int32"),
    ("tools.topk=1000000000", "tools.topk: 1000000000 must be <= 1000"),
    ("run.resume=yes", "run.resume: expected bool, got str 'yes'; write true or false"),
    ("run.resume=on", "run.resume: expected bool, got str 'on'"),
    ("run.export_hf=no", "run.export_hf: expected bool, got str 'no'"),
])
def test_the_values_the_issue_names_are_refused(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_the_caps_themselves_load():
    cfg = load_config(TrainConfig, None, [
        "tools.code_timeout_s=86400", "rollout.tool_timeout_s=86400", "rollout.max_turns=1000",
        "rollout.max_response_tokens=1000000", "rollout.max_obs_tokens=1000000", "tools.topk=1000",
        "rollout.group_size=1000", "rl.prompts_per_step=1000000", "seed=2147483647", "rl.loss.dual_clip=null",
        "run.resume=false", "run.dir=yes"])
    assert cfg.rollout.max_response_length < 2**31 and cfg.run.dir == "yes" and cfg.run.resume is False


def test_a_field_may_take_any_number():
    @dataclasses.dataclass(frozen=True)
    class Bounds:
        low: float = dataclasses.field(default=0.0, metadata={"finite": False})
        size: int = dataclasses.field(default=0, metadata={"finite": False})

    cfg = load_config(Bounds, None, ["low=-.inf", "size=18446744073709551617"])
    assert cfg.low == float("-inf") and cfg.size == 2**64 + 1


# ------------------------------------------------------------------- hostile config files
LAUGHS = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join(['*' + a] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi"))  # 9^9 values
FILES = {  # name -> (the file's bytes, a piece of the one-line error)
    "folder": (None, "is a folder, not a YAML file"),
    "not_utf8": (b"seed: \xff\xfe\n", "is not UTF-8 text (byte 0xff at offset 6)"),
    "recursive_alias": (b"x: &x [*x]\n", "alias *x inside its own anchor &x"),
    "deep_nesting": (b"x: " + b"[" * 20_000 + b"]" * 20_000 + b"\n", "nested deeper than 100 levels"),
    "deep_mapping": (b"x: " + b"{a: " * 20_000 + b"1" + b"}" * 20_000 + b"\n", "nested deeper than 100 levels"),
    "long_int": (b"seed: " + b"7" * 5_000 + b"\n", "an integer of 5,000 characters (at most 100)"),
    "billion_laughs": (LAUGHS.encode(), "more than 100,000 values with its aliases expanded"),
    "bad_date": (b"seed: 2001-13-45\n", "invalid YAML: month must be in 1..12"),
}


def _config_file(tmp_path, name):
    data = FILES[name][0]
    if data is None:
        return tmp_path
    path = tmp_path / f"{name}.yaml"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("name", FILES)
def test_a_hostile_file_is_one_config_error_in_little_memory(tmp_path, name):
    path = _config_file(tmp_path, name)
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            load_config(TrainConfig, path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    msg = str(e.value)
    assert FILES[name][1] in msg and "\n" not in msg, msg
    assert peak < 32 * 2**20, f"{peak / 2**20:.0f} MiB to refuse {name}"  # nothing was built from it


@pytest.mark.parametrize("name", FILES)
def test_a_hostile_file_is_one_line_and_exit_2_on_the_command_line(tmp_path, name, capsys):
    assert main(["train", "--config", str(_config_file(tmp_path, name))]) == 2
    out = capsys.readouterr()
    assert out.err.startswith("car-jax train: error: ") and FILES[name][1] in out.err, out.err
    assert out.err.count("\n") == 1 and "Traceback" not in out.err + out.out


@pytest.mark.parametrize("override, message", [
    ("seed=&x [*x]", "seed: YAML at line 1, column 5: alias *x inside its own anchor &x"),
    ("seed=" + "[" * 20_000, "seed: YAML at line 1, column 101: nested deeper than 100 levels"),
    ("seed=" + "9" * 5_000, "seed: invalid YAML at line 1, column 1: an integer of 5,000 characters"),
    ("seed=[1,", "seed: invalid YAML at line 1, column 4: while parsing a flow node"),
])
def test_a_hostile_override_names_its_key(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, None, [override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)
