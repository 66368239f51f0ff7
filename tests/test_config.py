"""car_jax.config: YAML + dotted overrides into nested frozen dataclasses."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal

import pytest

from car_jax.config import (
    ConfigError,
    apply_overrides,
    build_config,
    dump_config,
    load_config,
    parse_yaml,
    require,
    save_config,
)


@dataclasses.dataclass(frozen=True)
class ModelCfg:
    name: str = "smollm2"
    d_model: int = 64
    dtype: Literal["float32", "bfloat16"] = "float32"
    norm_eps: float = 1e-6


@dataclasses.dataclass(frozen=True)
class RLCfg:
    kl_coef: float = 0.001
    group_size: int = 5
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = "token-mean"
    dual_clip: float | None = None
    use_kl: bool = True

    def __post_init__(self):
        if self.group_size < 2:
            raise ValueError(f"group_size={self.group_size} must be >= 2 for GRPO")


@dataclasses.dataclass(frozen=True)
class RolloutCfg:
    stops: tuple[str, ...] = ("</answer>",)
    stop_ids: tuple[int, ...] = ()
    nested: tuple[str | tuple[str, ...], ...] = ()
    pair: tuple[int, float] = (1, 2.0)
    weights: dict[str, float] = dataclasses.field(default_factory=dict)
    extra: Any = None


@dataclasses.dataclass(frozen=True)
class TrainCfg:
    model: ModelCfg = ModelCfg()
    rl: RLCfg = dataclasses.field(default_factory=RLCfg)
    rollout: RolloutCfg = RolloutCfg()
    small: ModelCfg = dataclasses.field(default_factory=lambda: ModelCfg(d_model=8))
    seed: int = 0
    run_name: str | None = None


@dataclasses.dataclass(frozen=True)
class Required:
    steps: int


@dataclasses.dataclass(frozen=True)
class Outer:
    req: Required
    opt: RLCfg | None = None


def _write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_defaults_without_file():
    assert load_config(TrainCfg, None) == TrainCfg()


def test_yaml_and_overrides(tmp_path):
    p = _write(tmp_path, """
model:
  name: qwen
  norm_eps: 1e-5
rl:
  kl_coef: 0
  dual_clip: 3
rollout:
  stops: ["</search>"]
""")
    cfg = load_config(TrainCfg, p, ["rl.kl_coef=0.0", 'rollout.stops=["</search>","</answer>"]',
                                    "rl.use_kl=false", "rollout.stop_ids=[1, 2]",
                                    "run_name=exp 1", "rollout.weights.brier=0.5"])
    assert cfg.model == ModelCfg(name="qwen", norm_eps=1e-5)
    assert isinstance(cfg.model.norm_eps, float) and cfg.model.norm_eps == 1e-5
    assert cfg.rl.kl_coef == 0.0 and isinstance(cfg.rl.kl_coef, float)
    assert cfg.rl.dual_clip == 3.0 and isinstance(cfg.rl.dual_clip, float)
    assert cfg.rl.use_kl is False
    assert cfg.rollout.stops == ("</search>", "</answer>")
    assert cfg.rollout.stop_ids == (1, 2)
    assert cfg.rollout.weights == {"brier": 0.5}
    assert cfg.run_name == "exp 1"
    assert cfg.rl.group_size == 5 and cfg.seed == 0  # untouched keys keep defaults


def test_scientific_floats_are_floats():
    assert parse_yaml("[1e-6, 5E3, -2e+4, 1.5, .5, 1_0, .inf]") == [
        1e-6, 5e3, -2e4, 1.5, 0.5, 10, float("inf")]
    assert isinstance(parse_yaml("10"), int)


def test_nested_tuple_and_fixed_tuple():
    cfg = build_config(TrainCfg, {"rollout": {"nested": ["a", ["b", "c"]], "pair": [3, 4]}})
    assert cfg.rollout.nested == ("a", ("b", "c"))
    assert cfg.rollout.pair == (3, 4.0) and isinstance(cfg.rollout.pair[1], float)
    with pytest.raises(ConfigError, match=r"rollout\.pair.*exactly 2"):
        build_config(TrainCfg, {"rollout": {"pair": [1, 2, 3]}})
    with pytest.raises(ConfigError, match=r"rollout\.nested\[1\]\[0\].*expected str.*got int 5"):
        build_config(TrainCfg, {"rollout": {"nested": ["a", [5]]}})


def test_partial_section_merges_onto_field_default():
    cfg = build_config(TrainCfg, {"small": {"name": "tiny"}})
    assert cfg.small == ModelCfg(name="tiny", d_model=8)
    assert build_config(TrainCfg, {"small": None, "rl": None}) == TrainCfg()  # `small:`


def test_unknown_key_full_path_and_suggestion(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(TrainCfg, None, ["rl.kl_cof=0.1"])
    msg = str(e.value)
    assert "'rl.kl_cof'" in msg and "did you mean 'rl.kl_coef'" in msg
    assert "allowed keys: kl_coef, group_size, loss_agg, dual_clip, use_kl" in msg
    p = _write(tmp_path, "modle:\n  name: x\n")
    with pytest.raises(ConfigError, match=r"'modle'.*did you mean 'model'"):
        load_config(TrainCfg, p)


def test_wrong_types_name_path_value_and_type():
    cases = [
        ("rl.group_size=2.5", r"rl\.group_size: expected int, got float 2\.5"),
        ("rl.kl_coef=abc", r"rl\.kl_coef: expected float, got str 'abc'"),
        ("rl.use_kl=1", r"rl\.use_kl: expected bool, got int 1"),
        ("rl.use_kl=yes please", r"rl\.use_kl: expected bool, got str"),
        ("rl.kl_coef=true", r"rl\.kl_coef: expected float, got bool True"),
        ("model.name=123", r"model\.name: expected str, got int 123; quote it"),
        ("rollout.stops=</answer>", r"rollout\.stops: expected tuple.*YAML list"),
        ("rl.dual_clip=x", r"rl\.dual_clip: expected float \| None, got str 'x'"),
        ("model=3", r"model: expected a mapping for section ModelCfg, got int 3"),
        ("rollout.weights=[1]", r"rollout\.weights: expected dict"),
        ("rollout.weights.a=x", r"rollout\.weights\.a: expected float"),
    ]
    for override, pattern in cases:
        with pytest.raises(ConfigError, match=pattern):
            load_config(TrainCfg, None, [override])


def test_literal_lists_allowed_values():
    with pytest.raises(ConfigError) as e:
        load_config(TrainCfg, None, ["rl.loss_agg=token-sum"])
    assert "rl.loss_agg" in str(e.value) and "'token-sum'" in str(e.value)
    assert "'token-mean', 'seq-mean-token-mean'" in str(e.value)
    assert load_config(TrainCfg, None, ["model.dtype=bfloat16"]).model.dtype == "bfloat16"


@dataclasses.dataclass(frozen=True)
class Checked:
    lr: float = 0.1
    steps: int = 1
    note: str = ""

    def __post_init__(self):
        require(self.lr > 0, "lr", self.lr, "> 0")
        if self.steps < 0:
            raise ValueError(f"Checked.steps={self.steps} must be >= 0")
        if self.note == "bad":
            raise ValueError("the note is bad")  # names no field: reported at the section


@dataclasses.dataclass(frozen=True)
class Top:
    inner: Checked = Checked()
    rl: RLCfg = RLCfg()

    def __post_init__(self):
        if self.inner.steps > self.rl.group_size:  # a check across sections names its dotted key
            raise ValueError(f"inner.steps={self.inner.steps} must be <= rl.group_size={self.rl.group_size}")


@dataclasses.dataclass(frozen=True)
class Placed:
    x: int = 0

    def __post_init__(self):
        if self.x > 3:  # a message may already give the full dotted key (it knows where it sits)
            raise ValueError(f"outer.x={self.x} must be <= 3")


@dataclasses.dataclass(frozen=True)
class Wrapper:
    top: Top = Top()
    outer: Placed = Placed()

    def __post_init__(self):
        if self.top.inner.lr > 1:  # a check of a section below names its dotted key from here
            raise ValueError(f"top.inner.lr={self.top.inner.lr} must be <= 1 here")


def test_post_init_errors_name_the_dotted_key():
    cases = [
        (TrainCfg, "rl.group_size=1", "rl.group_size: 1 must be >= 2 for GRPO"),
        (Top, "inner.lr=0", "inner.lr: 0.0 must be > 0"),
        (Top, "inner.steps=-2", "inner.steps: -2 must be >= 0"),  # "Class.field=" too
        (Top, "inner.steps=9", "inner.steps: 9 must be <= rl.group_size=5"),
        (Top, "inner.note=bad", "inner (Checked): the note is bad"),
        (Wrapper, "top.inner.lr=2", "top.inner.lr: 2.0 must be <= 1 here"),
        (Wrapper, "outer.x=5", "outer.x: 5 must be <= 3"),
    ]
    for cls, override, message in cases:
        with pytest.raises(ConfigError) as e:
            load_config(cls, None, [override])
        assert str(e.value) == message


def test_required_keys_and_optional_sections():
    with pytest.raises(ConfigError, match=r"req\.steps: missing required key"):
        build_config(Outer, {"req": {}})
    with pytest.raises(ConfigError, match=r"req: missing required key"):
        build_config(Outer, {})
    out = build_config(Outer, {"req": {"steps": 3}, "opt": {"group_size": 4}})
    assert out == Outer(Required(3), RLCfg(group_size=4))
    assert build_config(Outer, {"req": {"steps": 3}, "opt": None}).opt is None
    # an error inside an optional section names the inner key, not just the union
    with pytest.raises(ConfigError, match=r"unknown key 'opt\.bad'"):
        build_config(Outer, {"req": {"steps": 3}, "opt": {"bad": 1}})


def test_bad_overrides_and_files(tmp_path):
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides({}, ["rl.kl_coef"])
    with pytest.raises(ConfigError, match="list of 'key=value'"):
        apply_overrides({}, "rl.kl_coef=1")
    with pytest.raises(ConfigError, match=r"seed is a value \(0\), not a section"):
        apply_overrides({"seed": 0}, ["seed.x=1"])
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(TrainCfg, _write(tmp_path, "model: [1,\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(TrainCfg, _write(tmp_path, "- 1\n- 2\n", "list.yaml"))
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(TrainCfg, tmp_path / "nope.yaml")
    assert load_config(TrainCfg, _write(tmp_path, "", "empty.yaml")) == TrainCfg()
    # apply_overrides copies: the input dict is not modified
    data = {"rl": {"kl_coef": 1.0}}
    assert apply_overrides(data, ["rl.kl_coef=2.0"]) == {"rl": {"kl_coef": 2.0}}
    assert data == {"rl": {"kl_coef": 1.0}}


def test_dump_save_load_round_trip(tmp_path):
    cfg = load_config(TrainCfg, None, [
        "model.norm_eps=1e-7", "rl.dual_clip=3.0", "rollout.nested=[a, [b, c]]",
        "rollout.weights={x: 1.5, y: 2}", "rollout.extra={k: [1, 2]}",
        "model.name='123'", "run_name='1e5'"])
    assert cfg.model.name == "123" and cfg.run_name == "1e5"
    d = dump_config(cfg)
    assert d["rollout"]["stops"] == ["</answer>"] and d["rl"]["dual_clip"] == 3.0
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    again = load_config(TrainCfg, path)
    assert again == cfg
    assert load_config(TrainCfg, None) != cfg  # the round trip is not trivially defaults
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_unsupported_and_non_dataclass():
    with pytest.raises(ConfigError, match="not a dataclass"):
        build_config(dict, {})
    with pytest.raises(ConfigError, match="cannot dump"):
        dump_config(object())
