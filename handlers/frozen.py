"""Frozen dataclasses built as fast as plain ones.

CPython's generated ``__init__`` for ``@dataclass(frozen=True)`` sets each field with
``object.__setattr__(self, "name", value)``: a look-up of the attribute by its name and the
generic setter, for every field of every object. That makes a frozen record about four
times as slow to build as a plain one (three fields: 850 ns against 220 ns on the
benchmark machine, Python 3.11), and the engine builds several per input — the records of
the objects it watches, its state changes, its outputs. Built directly (325 ns for the
three), the 1 % drain mix ran 4 % faster (benchmarks/README.md, "Figures of 2026-12-04
(later)").

:func:`direct_init` gives a frozen, slotted dataclass an ``__init__`` of the same signature
that writes each slot through the slot's own descriptor. Everything else stays the
dataclass's: equality, hash, repr, ``dataclasses.replace``, pickling, and ``__setattr__``
refusing every write after the object is built. Every frozen slotted dataclass in
handlers/ is built this way (tests/rules/test_frozen.py).
"""

from __future__ import annotations

import inspect
from dataclasses import MISSING, fields, is_dataclass
from types import MemberDescriptorType
from typing import Any, TypeVar

T = TypeVar("T")

_NO_VALUE = object()  # an argument left out whose field has a default factory


def direct_init(cls: type[T]) -> type[T]:
    """``cls`` (a ``@dataclass(frozen=True, slots=True)``) with an ``__init__`` that sets its
    slots directly. Refuses what it does not reproduce: ``__post_init__``, init-only or
    keyword-only fields, fields left out of ``__init__``."""
    params = getattr(cls, "__dataclass_params__", None)
    if not is_dataclass(cls) or params is None or not params.frozen or "__slots__" not in vars(cls):
        raise TypeError(f"{cls.__qualname__}: direct_init takes a @dataclass(frozen=True, slots=True)")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__qualname__}: direct_init does not call __post_init__")
    generated = vars(cls)["__init__"]
    names: dict[str, Any] = {"_NO_VALUE": _NO_VALUE}
    arguments: list[str] = []
    body: list[str] = []
    for f in fields(cls):
        if not f.init or f.kw_only:
            raise TypeError(f"{cls.__qualname__}.{f.name}: direct_init takes positional fields in __init__ only")
        slot = getattr(cls, f.name)  # the slot's member descriptor (a base class's, if inherited)
        if not isinstance(slot, MemberDescriptorType):
            raise TypeError(f"{cls.__qualname__}.{f.name}: not a slot")
        names[f"_set_{f.name}"] = slot.__set__
        value = f.name
        if f.default is not MISSING:
            names[f"_default_{f.name}"] = f.default
            arguments.append(f"{f.name}=_default_{f.name}")
        elif f.default_factory is not MISSING:
            names[f"_factory_{f.name}"] = f.default_factory
            arguments.append(f"{f.name}=_NO_VALUE")
            value = f"_factory_{f.name}() if {f.name} is _NO_VALUE else {f.name}"
        else:
            arguments.append(f.name)
        body.append(f"_set_{f.name}(self, {value})")
    source = (f"def __make__({', '.join(names)}):\n"
              f" def __init__(self, {', '.join(arguments)}):\n"
              f"  {'; '.join(body) or 'pass'}\n"
              f" return __init__\n")
    namespace: dict[str, Any] = {}
    exec(source, {}, namespace)  # as dataclasses itself makes __init__
    init = namespace["__make__"](**names)
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = generated.__doc__
    init.generated = generated  # the dataclass's own, which tests compare it with
    if _shape(inspect.signature(init)) != _shape(inspect.signature(generated)):
        raise TypeError(f"{cls.__qualname__}: its __init__ has parameters direct_init does not reproduce")
    cls.__init__ = init  # type: ignore[method-assign]
    return cls


def _shape(signature: inspect.Signature) -> list[tuple[str, Any, bool]]:
    """Each parameter's name, kind and whether it may be left out."""
    return [(p.name, p.kind, p.default is not inspect.Parameter.empty) for p in signature.parameters.values()]
