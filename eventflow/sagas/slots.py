"""A pydantic model's private attribute without pydantic's per-instance cost.

pydantic copies the default of every ``PrivateAttr`` into each instance it validates
(``init_private_attributes``, run after ``model_validate``): the saga's ``_meta`` and
``_effects`` cost that once per input, though most inputs never read one of them.
:class:`PrivateSlot` keeps the value where pydantic keeps private attributes (the
instance's ``__pydantic_private__`` dict, so copies, pickling and equality treat it as
pydantic would) and makes its default only when it is first read. The model lists the
class in ``ignored_types`` so pydantic leaves the attribute alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar, overload

from pydantic import BaseModel

__all__ = ["PrivateSlot"]

T = TypeVar("T")
_private = BaseModel.__dict__["__pydantic_private__"]  # the slot's own descriptor
_get_private, _set_private = _private.__get__, _private.__set__


def _values(obj: BaseModel) -> dict[str, Any]:
    """The instance's private values, made empty when it has none yet (a model without
    pydantic private attributes validates with ``__pydantic_private__`` at None)."""
    values: dict[str, Any] | None = _get_private(obj)
    if values is None:
        values = {}
        _set_private(obj, values)
    return values


class PrivateSlot(Generic[T]):
    """A private attribute of a pydantic model whose default (``factory()``) is made when
    it is first read, not when the instance is validated."""

    def __init__(self, factory: Callable[[], T]) -> None:
        self.factory = factory
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, obj: None, owner: type | None = None) -> PrivateSlot[T]: ...

    @overload
    def __get__(self, obj: BaseModel, owner: type | None = None) -> T: ...

    def __get__(self, obj: BaseModel | None, owner: type | None = None) -> T | PrivateSlot[T]:
        if obj is None:
            return self
        values = _values(obj)
        try:
            value: T = values[self.name]
        except KeyError:
            value = values[self.name] = self.factory()
        return value

    def __set__(self, obj: BaseModel, value: T) -> None:
        _values(obj)[self.name] = value
