"""Command-line flags generated from a settings dataclass, as vLLM's `EngineArgs` and llm-d's
`options.go` do: a setting's default, its flag's type and its help live once, on the field.

A field declared with `setting(...)` carries a `Flag` in its metadata; `add_flags` turns every
such field into an argparse option (spelled `--field-name` unless the flag names itself), and
`values_from_args` reads them back into the dataclass's keyword arguments. Fields without a
`Flag` (tuning knobs, values a program computes) have no flag.

Two ways to default a flag:
- `overlay=False` (the engine, the gateway, the endpoint picker): the flag's default IS the
  field's default, so `--help` shows it and a parsed namespace holds the setting.
- `overlay=True` (the sidecar, whose flags override a config file): every flag defaults to
  None, meaning "not given", and the help shows the field's default, which applies when neither
  the file nor a flag sets it.
No heavy imports: every server's command line is built from here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

FLAG = "pdpool.flag"  # the metadata key of a field's Flag


@dataclass(frozen=True)
class Flag:
    help: Optional[str] = None
    name: Optional[str] = None  # the option's spelling; default: --field-name
    type: Optional[Callable[[str], Any]] = None  # default: the field default's int/float/str
    choices: Optional[Sequence[str]] = None
    metavar: Optional[str] = None
    positional: bool = False
    switch: bool = False  # --X / --no-X (pdpool.cli.add_switch)
    repeat: Optional[str] = None  # "append" or "extend": the flag may be given many times
    # Reads the parsed value into the field's type (a size '32MiB' into bytes, a list of
    # TARGET=SPEC into a mapping); given the default too, so it must accept the field's type.
    parse: Optional[Callable[[Any], Any]] = None
    group: Optional[str] = None  # the help section
    # A dataclass whose own flags this field is built from (e.g. StructuredLimits).
    nested: Optional[type] = None
    prefix: str = ""  # put before each nested flag's name: "structured-"


def setting(
    default: Any = MISSING,
    *,
    default_factory: Any = MISSING,
    **flag: Any,
) -> Any:
    """A dataclass field with its flag: `setting(16, help="...")`."""
    metadata = {FLAG: Flag(**flag)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flagged_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Flag]]:
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(FLAG)
        if flag is not None:
            yield f, flag


def field_default(f: dataclasses.Field) -> Any:
    """The field's default (a fresh one for a factory); MISSING for a required field."""
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def default_of(cls: type, name: str) -> Any:
    """The default of `cls`'s field `name`, for code that fills the same setting from
    elsewhere (a pool spec) and must not write the value again."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            value = field_default(f)
            if value is MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no default")
            return value
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def option_name(f: dataclasses.Field, flag: Flag, prefix: str = "") -> str:
    return flag.name or "--" + prefix + f.name.replace("_", "-")


def add_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    *,
    overlay: bool = False,
    prefix: str = "",
) -> None:
    """Adds an option per flagged field of `cls`, in the fields' order."""
    groups: dict[str, argparse._ActionsContainer] = {}
    for f, flag in flagged_fields(cls):
        if flag.nested is not None:
            add_flags(parser, flag.nested, overlay=overlay, prefix=flag.prefix)
            continue
        target = parser
        if flag.group is not None and isinstance(parser, argparse.ArgumentParser):
            if flag.group not in groups:
                groups[flag.group] = parser.add_argument_group(flag.group)
            target = groups[flag.group]
        _add_one(target, f, flag, overlay, prefix)


def _add_one(
    parser: argparse._ActionsContainer, f: dataclasses.Field, flag: Flag, overlay: bool, prefix: str
) -> None:
    default = field_default(f)
    kwargs: dict[str, Any] = {"help": flag.help}
    if overlay and flag.help is not None and default not in (MISSING, None, [], {}):
        kwargs["help"] = f"{flag.help} (default {_shown(default)})"
    if flag.metavar is not None:
        kwargs["metavar"] = flag.metavar
    if flag.positional:
        parser.add_argument(f.name, **kwargs)
        return
    kwargs["dest"] = prefix.replace("-", "_") + f.name
    if flag.switch:
        kwargs["default"] = None if overlay else default
        parser.add_argument(
            option_name(f, flag, prefix), action=argparse.BooleanOptionalAction, **kwargs
        )
        return
    if flag.repeat is not None:
        kwargs["action"] = flag.repeat
        if flag.repeat == "extend":
            kwargs["nargs"] = "+"
        # an appending flag starts from a list (argparse copies it), or None: not given
        kwargs["default"] = None if overlay else list(default)
    elif type(default) is bool:  # off unless given (vLLM's --enable-lora)
        kwargs.update(action="store_true", default=None if overlay else default)
    else:
        kwargs["default"] = None if overlay else default
        kind = flag.type or (None if flag.parse else _type_of(default))  # parse reads text
        if kind is not None:
            kwargs["type"] = kind
    if flag.choices is not None:
        kwargs["choices"] = list(flag.choices)
    parser.add_argument(option_name(f, flag, prefix), **kwargs)


def _type_of(default: Any) -> Optional[Callable[[str], Any]]:
    if type(default) in (int, float):  # not a bool (an int too): those are switches
        return type(default)
    return None  # str, None: argparse's text


def _shown(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def values_from_args(
    cls: type, args: argparse.Namespace, *, overlay: bool = False, prefix: str = ""
) -> dict[str, Any]:
    """`cls`'s keyword arguments from the parsed flags: each flagged field's value through its
    `parse` (ValueError for a bad one). With `overlay`, flags not given are left out."""
    values: dict[str, Any] = {}
    for f, flag in flagged_fields(cls):
        if flag.nested is not None:
            values[f.name] = flag.nested(
                **values_from_args(flag.nested, args, overlay=overlay, prefix=flag.prefix)
            )
            continue
        dest = f.name if flag.positional else prefix.replace("-", "_") + f.name
        value = getattr(args, dest)
        if overlay and value is None:
            continue
        if flag.parse is not None and value is not None:
            value = flag.parse(value)
        values[f.name] = value
    return values


def size(value: Any) -> Any:
    """A size flag ('512MiB', '2G', '1048576') as bytes; a number (the default) as it is."""
    from pdpool.units import parse_size

    return parse_size(value) if isinstance(value, str) else value


def optional_size(value: Any) -> Any:
    """As `size`, with an empty value meaning none (--kv-cache-memory '')."""
    return size(value) if value != "" else None


def comma_list(value: Any) -> list[str]:
    """'a, b,,c' -> ['a', 'b', 'c']; a list (the default) as it is."""
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    return list(value)
