"""Command-line options made from their one declaration: a field of the training ``Recipe`` (or of the
``AugmentConfig`` it nests) gives an option its flag, type, accepted values, help and default."""
from __future__ import annotations

import argparse
import typing
from collections.abc import Callable
from typing import Annotated, Any

import yaml
from pydantic import TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from ..settings import UNSET, accepted
from ..train.recipe import AUGMENT_FIELDS, FIELDS, NULL, default_words


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field(name: str) -> FieldInfo:
    """The declaration of option ``name``: a recipe field or an augmentation field."""
    return FIELDS[name] if name in FIELDS else AUGMENT_FIELDS[name]


def is_bool(annotation: Any) -> bool:
    """bool or bool | None."""
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


def help_text(info: FieldInfo, help_: str | None = None, default: Any = UNSET, said: str | None = None) -> str:
    """``help [accepted; default X]`` (``said``: the default in words instead), with '%' escaped for argparse."""
    default = info.get_default(call_default_factory=True) if default is UNSET else default
    said = said or f"default {default!r}"
    return f"{help_ or info.description or ''} [{accepted(info)}; {said}]".replace("%", "%%")


def add_recipe_option(parser: argparse.ArgumentParser | argparse._ActionsContainer, name: str,
                      hidden: bool = False) -> None:
    """``--name`` for ``vitlab train``: the value stays text (None = not given) and the recipe coerces and checks
    it, so a bad value on the command line gets the same one-line message as in a YAML recipe. ``null`` (YAML's
    word for none) sets a field to None, as in a recipe: ``--time-budget null`` takes a recipe's budget away.
    ``hidden``: parsed, but not listed by ``--help``."""
    info = field(name)
    annotation = info.annotation
    text = argparse.SUPPRESS if hidden else help_text(info, said=default_words(name))
    if is_bool(annotation):
        parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=None, help=text)
    elif typing.get_origin(annotation) is tuple:
        parser.add_argument(flag(name), default=None, metavar="A,B", type=lambda v: v.split(","), help=text)
    else:
        kinds = {annotation, typing.get_origin(annotation), *typing.get_args(annotation)}
        numeric = not {str, typing.Literal} & kinds
        parser.add_argument(flag(name), default=None, metavar=name.upper(), type=_scalar if numeric else _text,
                            help=text)


def _scalar(value: str) -> Any:
    """Numbers as numbers (so an error shows 0, not '0'), ``null`` as ``NULL``; 1e-3 stays text for the recipe to
    coerce."""
    parsed = yaml.safe_load(value) if value.strip() else value
    if parsed is None:
        return NULL
    return parsed if isinstance(parsed, (int, float)) and not isinstance(parsed, bool) else value


def _text(value: str) -> Any:
    """Text as it is, ``null`` (or ``~``, YAML's other word for none) as ``NULL``."""
    return NULL if value.strip() in ("null", "Null", "NULL", "~") else value


def add_option(parser: argparse.ArgumentParser | argparse._ActionsContainer, name: str, *, default: Any = UNSET,
               help: str | None = None, **kwargs: Any) -> None:
    """``--name`` for a command other than ``train``, declared by the recipe field ``name``: parsed and checked
    as the recipe checks it. ``default`` and ``help`` replace the field's where the command means something
    else by it (e.g. a batch of evaluation, not of training)."""
    info = field(name)
    default = info.get_default(call_default_factory=True) if default is UNSET else default
    text = help_text(info, help, default) if not kwargs.get("required") else (help or info.description)
    if is_bool(info.annotation):
        parser.add_argument(flag(name), action=argparse.BooleanOptionalAction, default=default, help=text, **kwargs)
        return
    adapter = TypeAdapter(Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation)
    words = accepted(info)

    def parse(value: str) -> Any:
        try:
            return adapter.validate_python(value)
        except ValidationError:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid; accepted: {words}") from None

    choices = typing.get_args(info.annotation) if typing.get_origin(info.annotation) is typing.Literal else ()
    kwargs.setdefault("metavar", "{" + ",".join(choices) + "}" if choices else name.upper())
    parser.add_argument(flag(name), default=default, type=parse, help=text, **kwargs)


def integer(low: int) -> Callable[[str], int]:
    """An argparse type for an integer option that is not a recipe field: ``low`` or more, else one line
    that names the accepted range."""
    def parse(value: str) -> int:
        try:
            number = int(value)
        except ValueError:
            number = None
        if number is None or number < low:
            raise argparse.ArgumentTypeError(f"{value!r} is not valid; accepted: an integer >= {low}")
        return number
    return parse
