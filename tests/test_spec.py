"""Options declared once and a spec read once: every option is in the API reference, every declared value round
trips through the spec string and reaches its owner, every bound is enforced in one line, and no key is routed by
guessing (a key the method and its memory both declare reaches either)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gradsift.cli.reference import declared_options
from gradsift.compressors import available
from gradsift.errors import OptionError
from gradsift.memory.factory import make_compressor
from gradsift.memory.spec import MEMORY_CLASSES, Spec
from gradsift.options import Option, check_options

API = (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()


def test_every_declared_option_is_in_the_api_reference_under_its_owner():
    sections = re.split(r"^### ", API.split("## Options", 1)[1], flags=re.M)
    by_heading = {s.splitlines()[0].strip(): s for s in sections[1:]}
    count = 0
    for heading, _, options in declared_options():
        assert heading in by_heading, heading
        for name, option in options.items():
            assert isinstance(option, Option) and option.doc, (heading, name)
            assert f"| `{name}` |" in by_heading[heading], (heading, name)
            count += 1
    assert count >= 60  # every method's, memory's, local SGD's and the settings' (a list that cannot be empty)


def non_default(option: Option):
    """A value the option takes that is not its default."""
    if option.kind == "flag":
        return not option.default
    if option.kind == "choice":
        return next(c for c in option.choices if c != option.default)
    if option.kind == "integer":
        return (option.default or option.lo or 0) + 1
    lo = option.lo if option.lo is not None else 0.0
    hi = option.hi if option.hi is not None else lo + 2.0
    return lo + (hi - lo) / 4 + (0.0 if option.default != lo + (hi - lo) / 4 else (hi - lo) / 8)


@pytest.mark.parametrize("name", list(available()))
def test_each_method_option_round_trips_and_reaches_the_method(name):
    cls = available()[name]
    for key, option in cls.OPTIONS.items():
        value = non_default(option)
        if (name, key) in {("rtopk", "r_over_k")}:
            value = 2.0  # 0 (the worker count) or >= 1: the method's own rule beside the declaration
        if (name, key) in {("randomk", "scale"), ("gs", "unbiased"), ("rsb", "unbiased"), ("gsb", "unbiased")}:
            spec = Spec.of(name, {key: value, "memory": "none"})
        else:
            spec = Spec.of(name, {key: value})
        assert Spec.parse(str(spec)) == spec, str(spec)
        built = make_compressor(str(spec), 0.1, world_size=2)
        assert built.inner.options[key] == value, (name, key)


def test_each_memory_option_round_trips_and_reaches_the_memory():
    for memory, cls in MEMORY_CLASSES.items():
        if cls is None:
            continue
        for key, option in cls.OPTIONS.items():
            value = non_default(option)
            spec = Spec.of("topk", {"memory": memory, key: value})
            assert Spec.parse(str(spec)) == spec
            assert make_compressor(spec, 0.1).memory_options[key] == value, (memory, key)


def test_bounds_and_types_are_enforced_in_one_line():
    cases = [("topk:ratio=0", "ratio"), ("sidco:stages=0", "stages"), ("sidco:dist=normal", "dist"),
             ("gsb:alpha=0", "alpha"), ("gsb:tau=2.5", "tau"), ("dgc:sample_ratio=true", "sample_ratio"),
             ("topk:memory=adam,beta2=1", "beta2"), ("topk:memory=momentum,momentum=1.5", "momentum"),
             ("topk:residual_dtype=fp4", "residual_dtype"), ("topk:warmup=-1", "warmup"),
             ("topk:value_dtype=fp8", "value_dtype"), ("topk:memory=sometimes", "memory")]
    for spec, key in cases:
        with pytest.raises(OptionError) as e:
            make_compressor(spec, 0.1)
        assert key in str(e.value) and "\n" not in str(e.value), (spec, str(e.value))
    assert Spec.parse("rsb:tau=0").options["tau"] == 0  # rsb has no global distribution to refresh: 0 is never


def test_a_key_has_one_owner_from_the_declarations():
    # random-k's scale and the Adam memory's: the plain key is the method's, memory.scale the memory's
    c = make_compressor("randomk:memory=adam,memory.scale=worker", 0.1)
    assert c.memory_options["scale"] == "worker" and c.inner.options["scale"] is False
    assert str(Spec.parse("randomk:memory=adam,memory.scale=worker")) == "randomk:memory=adam,memory.scale=worker"
    with pytest.raises(OptionError, match="belongs to Adam's direction"):
        make_compressor("randomk:memory=ef,memory.scale=worker", 0.1)
    # a memory's key before the memory is chosen: kept for it, checked when the compressor is built
    s = Spec.parse("topk:beta1=0.8")
    assert s.memory is None and s.memory_options == {"beta1": 0.8}
    assert make_compressor(s.replace(memory="adam"), 0.1).memory_options["beta1"] == 0.8
    with pytest.raises(OptionError, match="belongs to Adam's direction.*memory is ef"):
        make_compressor(s, 0.1)
    with pytest.raises(OptionError, match="beta1"):  # a value no memory that declares the key takes: now
        Spec.parse("topk:beta1=2")
    with pytest.raises(OptionError, match="unknown option 'nosuch'"):
        Spec.parse("topk:nosuch=1")
    with pytest.raises(OptionError, match="seed"):  # the run places a compressor; a spec cannot
        Spec.parse("topk:seed=3")
    with pytest.raises(OptionError, match="both in the spec"):
        make_compressor("topk:memory=ef", 0.1, memory="none")


def test_replace_returns_a_new_checked_spec():
    s = Spec.parse("sidco:ratio=0.01,stages=2")
    t = s.replace(memory="adam", stages=4)
    assert (t.memory, t.options["stages"], t.ratio) == ("adam", 4, 0.01) and s.options["stages"] == 2
    assert s.replace(ratio=None).ratio is None and str(s.replace(ratio=None)) == "sidco:stages=2"
    assert Spec.parse("topk:feedback=false") == Spec.parse("topk:memory=none")
    assert Spec.parse("dgc:feedback=true").memory == "momentum"  # the method's own memory
    with pytest.raises(OptionError, match="stages"):
        s.replace(stages=0)


def test_check_options_fills_defaults_in_declaration_order():
    declared = {"a": Option.integer(3, lo=1, doc="a"), "b": Option.flag(False, doc="b")}
    assert check_options(declared, {"b": True}, "owner") == {"a": 3, "b": True}
    assert check_options(declared, {"a": 4.0}, "owner")["a"] == 4  # an integral float is the integer
    with pytest.raises(OptionError, match=r"owner: unknown option 'c'; allowed: a, b"):
        check_options(declared, {"c": 1}, "owner")
    with pytest.raises(ValueError):  # a declaration whose default breaks its own bounds fails at import
        Option.integer(0, lo=1, doc="x")


def test_the_settings_type_takes_its_defaults_from_the_declarations():
    """Settings' fields and the declarations list the same settings with the same defaults (one source)."""
    import dataclasses

    from gradsift.runtime.settings import SETTINGS, Settings

    fields = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert set(SETTINGS) == set(fields) - {"compressor", "ratio", "options"}
    assert {name: fields[name] for name in SETTINGS} == {name: o.default for name, o in SETTINGS.items()}


def test_a_runs_own_options_are_declared_and_checked_by_their_declarations():
    """RunConfig's own fields take their defaults from their declarations and are refused by them in one line, the
    command line's options too (a momentum of 1 or more was taken as it was before they were declared)."""
    import dataclasses

    from gradsift.cli.options import add_run_options, OneLineParser, UsageError
    from gradsift.errors import ConfigError
    from gradsift.runtime.runconfig import RUN_OPTIONS, RUN_SETTINGS, RunConfig

    fields = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert not set(RUN_OPTIONS) & set(RUN_SETTINGS) and set(RUN_OPTIONS) <= set(fields)
    assert {n: fields[n] for n in RUN_OPTIONS} == {n: o.default for n, o in RUN_OPTIONS.items()}
    for name, bad in (("momentum", 1.0), ("steps", 0), ("lr", -0.1), ("warmup_steps", -1), ("optimizer", "lbfgs"),
                      ("schedule", "step"), ("paired_ddp", 1001), ("clip_norm", 0.0), ("stop_at", float("nan"))):
        with pytest.raises(ConfigError, match=f"^{name.replace('_', '-')} must be "):
            RunConfig(**{name: bad}).validate()
    assert RunConfig(warmup_steps=0, steps=3.0).validate().steps == 3
    p = OneLineParser(prog="gradsift train")
    add_run_options(p)
    with pytest.raises(UsageError, match=r"argument --momentum: momentum must be a number in \[0, 1\), got 1.5"):
        p.parse_args(["--momentum", "1.5"])
    assert p.parse_args(["--warmup-steps", "0"]).warmup_steps == 0
