"""Typed settings: pydantic models whose every value is checked (on construction and on assignment), with an
error as one line that names the option, the value and what the option accepts, in words made from its type."""
from __future__ import annotations

import types
import typing
from typing import Any, Literal

import annotated_types as at
from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator
from pydantic.fields import FieldInfo

from .errors import VitlabError

UNSET: Any = object()  # a value not given (where None is a value someone may give): the one such marker



class Settings(BaseModel):
    """A set of declared options. Text coerces to the declared type (``"1e-3"`` is the float 0.001, ``"no"`` is
    False), as YAML files and command lines deliver it; a bad value (given or assigned) raises ValueError as one
    line."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, value: Any, info: ValidationInfo) -> Any:
        """true/false is not a number, nor 0/1 a yes/no: a YAML file's ``epochs: true`` is refused as the command
        line refuses ``--epochs true`` (pydantic alone would read it as 1)."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        kinds = {field.annotation, *typing.get_args(field.annotation)}
        numeric = bool({int, float} & kinds) and bool not in kinds
        if isinstance(value, bool) and numeric or bool in kinds and isinstance(value, (int, float)) and not \
                isinstance(value, bool):
            raise VitlabError(f"{info.field_name}={value!r} is not valid; accepted: {accepted(field)}")
        return value

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as e:
            raise VitlabError(one_line(e, type(self))) from None

    def __setattr__(self, name: str, value: Any) -> None:
        try:
            super().__setattr__(name, value)
        except ValidationError as e:
            raise VitlabError(one_line(e, type(self))) from None


def accepted(info: FieldInfo) -> str:
    """What a declared option accepts, in words: its ``accepted`` text if it has one, else made from its type."""
    extra = info.json_schema_extra
    if isinstance(extra, dict) and "accepted" in extra:
        return str(extra["accepted"])
    return describe(info.annotation, info.metadata)


def describe(annotation: Any, metadata: list | tuple = ()) -> str:
    """A type and its bounds in words: ``an integer >= 1``, ``auto, cpu, cuda``, ``text (or null)``."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is Literal:
        return ", ".join(map(str, args))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return describe(inner[0], metadata) + " (or null)" if len(inner) == 1 else str(annotation)
    base = {int: "an integer", float: "a number", bool: "true or false", str: "text",
            dict: "a mapping"}.get(typing.get_origin(annotation) or annotation, str(annotation))
    bounds = []
    for m in metadata:
        for cls, attr, sym in ((at.Gt, "gt", ">"), (at.Ge, "ge", ">="), (at.Lt, "lt", "<"), (at.Le, "le", "<=")):
            if isinstance(m, cls):
                bounds.append(f"{sym} {getattr(m, attr)}")
    return base + (" " + " and ".join(bounds) if bounds else "")


def field_at(model: type[BaseModel], loc: tuple) -> tuple[str, FieldInfo] | None:
    """The declared option an error location points at (through nested settings; an item index stops there)."""
    found = None
    for part in loc:
        fields = getattr(model, "model_fields", None)
        if not isinstance(part, str) or not fields or part not in fields:
            break
        found = part, fields[part]
        model = fields[part].annotation
    return found


def one_line(e: ValidationError, model: type[BaseModel]) -> str:
    """The first problem of a validation error as one line: option, value, what it accepts."""
    err = e.errors(include_url=False)[0]
    more = f" (and {len(e.errors()) - 1} more)" if len(e.errors()) > 1 else ""
    if err["type"] == "value_error":  # a check of our own: its message is already the line
        return str(err["msg"]).removeprefix("Value error, ") + more
    found = field_at(model, tuple(err["loc"]))
    if err["type"] == "extra_forbidden":
        where = field_at(model, tuple(err["loc"])[:-1])
        names = where[1].annotation.model_fields if where else model.model_fields
        return f"unknown option {err['loc'][-1]}; accepted: {', '.join(names)}{more}"
    if found is None:
        return f"{'.'.join(map(str, err['loc']))}: {err['msg']}{more}"
    name, info = found
    return f"{name}={err.get('input')!r} is not valid; accepted: {accepted(info)} ({err['msg'].lower()}){more}"
