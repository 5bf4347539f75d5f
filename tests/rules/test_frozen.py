"""handlers/frozen.py: a frozen record built by ``direct_init`` is the one the dataclass builds."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pickle
import pkgutil
from typing import Any

import pytest

import handlers
from handlers.frozen import direct_init


def frozen_dataclasses() -> list[type[Any]]:
    """Every frozen, slotted dataclass defined in handlers/."""
    found = []
    for module_info in pkgutil.iter_modules(handlers.__path__):
        module = importlib.import_module(f"handlers.{module_info.name}")
        for value in vars(module).values():
            if (isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == module.__name__
                    and getattr(value, "__dataclass_params__").frozen and "__slots__" in vars(value)):
                found.append(value)
    return sorted(found, key=lambda cls: f"{cls.__module__}.{cls.__qualname__}")


FROZEN = frozen_dataclasses()


def test_there_are_frozen_records_to_check() -> None:
    assert len(FROZEN) >= 30


@pytest.mark.parametrize("cls", FROZEN, ids=lambda cls: cls.__qualname__)
def test_every_frozen_record_is_built_directly(cls: type[Any]) -> None:
    assert callable(getattr(cls.__init__, "generated", None)), f"{cls.__qualname__} lacks @direct_init"


def arguments(cls: type[Any], leave_out_defaults: bool) -> dict[str, Any]:
    """A distinct object for each field (those with a default left out, if asked)."""
    chosen = {}
    for f in dataclasses.fields(cls):
        has_default = f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING
        if not (leave_out_defaults and has_default):
            chosen[f.name] = [f.name]  # a list: distinct, and unhashable only where nothing hashes it
    return chosen


def built_both_ways(cls: type[Any], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    direct = cls(*args, **kwargs)
    generated = object.__new__(cls)
    cls.__init__.generated(generated, *args, **kwargs)
    return direct, generated


@pytest.mark.parametrize("cls", FROZEN, ids=lambda cls: cls.__qualname__)
def test_each_field_holds_what_the_dataclass_init_puts_there(cls: type[Any]) -> None:
    for leave_out in (False, True):
        given = arguments(cls, leave_out_defaults=leave_out)
        for direct, generated in (built_both_ways(cls, **given), built_both_ways(cls, *given.values())):
            for f in dataclasses.fields(cls):
                mine, theirs = getattr(direct, f.name), getattr(generated, f.name)
                if f.name in given:
                    assert mine is given[f.name] and theirs is given[f.name]
                elif f.default_factory is not dataclasses.MISSING:
                    assert mine == theirs and mine is not theirs  # a fresh one each time
                else:
                    assert mine is f.default and theirs is f.default


@pytest.mark.parametrize("cls", FROZEN, ids=lambda cls: cls.__qualname__)
def test_the_same_signature_and_the_same_refusals(cls: type[Any]) -> None:
    assert list(inspect.signature(cls).parameters) == list(inspect.signature(cls.__init__.generated).parameters)[1:]
    with pytest.raises(TypeError):
        cls(**arguments(cls, leave_out_defaults=False), not_a_field=1)
    required = arguments(cls, leave_out_defaults=True)
    if required:
        with pytest.raises(TypeError):
            cls(**dict(list(required.items())[1:]))


@pytest.mark.parametrize("cls", FROZEN, ids=lambda cls: cls.__qualname__)
def test_still_frozen_equal_and_replaceable(cls: type[Any]) -> None:
    built = cls(**arguments(cls, leave_out_defaults=False))
    first = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, first, ["other"])
    if cls.__dataclass_params__.eq:
        assert built == cls(**{name: list(value) for name, value in arguments(cls, leave_out_defaults=False).items()})
    assert getattr(dataclasses.replace(built, **{first: ["other"]}), first) == ["other"]


def test_a_record_round_trips_through_pickle() -> None:
    from handlers.rows import VMTracking

    told = VMTracking(pending_episode="p", left_node="n")
    assert pickle.loads(pickle.dumps(told)) == told


def test_refuses_what_it_would_not_reproduce() -> None:
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclasses.dataclass(frozen=True, slots=True)
    class KeywordOnly:
        a: int = dataclasses.field(kw_only=True)

    @dataclasses.dataclass(frozen=True, slots=True)
    class InitOnly:
        a: int
        b: dataclasses.InitVar[int]

    @dataclasses.dataclass(slots=True)
    class NotFrozen:
        a: int

    for cls in (NoSlots, PostInit, KeywordOnly, InitOnly, NotFrozen):
        with pytest.raises(TypeError):
            direct_init(cls)
