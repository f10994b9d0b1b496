"""One typed schema per stage: a dataclass whose fields are at once the CLI options and the YAML keys.

A stage declares its options once, with types, defaults and help:

    @dataclass(kw_only=True)
    class ExportOptions:
        draft: Path = option(help="Draft checkpoint folder.")          # required: no default
        out: Path = option(help="Output folder.", short="-o")
        dtype: Literal["bfloat16", "float16", "float32"] = option("bfloat16", help="Weights' dtype.")

and gets from it both a typer command (`cli_command`: one `--flag` per field, `--help` showing each
default the same way) and a validated instance from a YAML mapping (`from_mapping`: a wrong type is
one clear error naming the key, the value and the type expected). A stage's `__post_init__` checks
ranges and combinations, so the CLI, `eyas run` and Python callers share one set of rules, and
`eyas run` validates every section before any stage starts.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

from eyas.utils.io import EyasError

T = TypeVar("T")
_MISSING = dataclasses.MISSING


def option(default: Any = _MISSING, help: str = "", *, short: str | None = None, flag: str | None = None,
           default_factory: Callable[[], Any] | None = None, show_default: bool | str = True,
           positional: bool = False, cli: bool = True, comma: bool = False, old_name: str | None = None) -> Any:
    """A schema field. No `default` (and no `default_factory`) makes it required.

    `flag` overrides the CLI spelling (default: `--field-name`), `short` adds an alias such as `-o`;
    `show_default` is what `--help` shows as the default (False: nothing, a string: that text);
    `positional` makes it the command's argument; `cli=False` keeps it out of the CLI (YAML and
    Python only); `comma` (a list field) also takes "2,15,29" as one value, on the CLI and in YAML;
    `old_name`: the field's former name, still read as a CLI flag and a YAML key, with a deprecation note."""
    if old_name:
        help += f" (`--{old_name.replace('_', '-')}` / `{old_name}:` is its old spelling: deprecated, still read.)"
    meta = {"help": help, "short": short, "flag": flag, "show_default": show_default, "positional": positional,
            "cli": cli, "comma": comma, "old_name": old_name}
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def fields(cls: type) -> list[dataclasses.Field]:
    return list(dataclasses.fields(cls))


def _declared(cls: type) -> list[tuple[dataclasses.Field, str | None]]:
    """(field, help panel) in the order a reader wants them: the stage's own fields first, then those
    of each schema it builds on (a class attribute `help_panel` names the group in `--help`)."""
    by_name = {f.name: f for f in fields(cls)}
    out, seen = [], set()
    for klass in cls.__mro__:
        panel = klass.__dict__.get("help_panel")
        for name in klass.__dict__.get("__annotations__", {}):
            if name in by_name and name not in seen:
                seen.add(name)
                out.append((by_name[name], panel))
    return out


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not _MISSING:
        return f.default
    if f.default_factory is not _MISSING:
        return f.default_factory()
    return _MISSING


def type_hints(cls: type) -> dict[str, Any]:
    """Field types resolved from their string annotations (modules use `from __future__ import annotations`)."""
    return typing.get_type_hints(cls)


def type_name(tp: Any) -> str:
    """How a type reads in an error message: 'a number', 'a list of text', "one of 'a', 'b'" ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        names = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple, set):
        return f"a list of {type_name(args[0])}" if args else "a list"
    if origin in (dict, Mapping):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "text", bool: "true or false", Path: "a path"}.get(
        tp, getattr(tp, "__name__", str(tp)))


# ---------------------------------------------------------------------------------------------
# YAML / Python mappings
# ---------------------------------------------------------------------------------------------


def from_mapping(cls: type[T], values: Mapping[str, Any], where: str) -> T:
    """Build `cls` from a mapping (a YAML section), refusing unknown keys and wrong types with one
    error naming the key, the value and what it should be. `where` prefixes every message
    (e.g. "configs/x.yaml: train")."""
    import pydantic

    if not isinstance(values, Mapping):
        raise EyasError(f"{where}: expected a mapping of options, got {type(values).__name__} {values!r}")
    hints = type_hints(cls)
    known = {f.name for f in fields(cls)}
    values = _renamed(cls, values, where)
    unknown = sorted(set(values) - known)
    if unknown:
        raise EyasError(f"{where}: unknown option(s) {unknown}; valid: {sorted(known)}")
    comma = {f.name for f in fields(cls) if f.metadata.get("comma")}
    values = {k: split_commas(v) if k in comma else v for k, v in values.items()}
    for key, value in values.items():  # pydantic reads true as 1 for a number; a config never means that
        if isinstance(value, bool) and _number_type(hints[key]):
            raise EyasError(f"{where}.{key} = {value!r}: expected {type_name(hints[key])}")
    try:
        return pydantic.TypeAdapter(cls).validate_python(dict(values))
    except pydantic.ValidationError as e:
        err = e.errors()[0]
        key = ".".join(str(p) for p in err["loc"][:1]) or "?"
        if err["type"] == "missing":
            raise EyasError(f"{where}: option '{key}' is required") from None
        expected = type_name(hints.get(key, Any))
        raise EyasError(f"{where}.{key} = {err.get('input')!r}: expected {expected} ({err['msg']})") from None
    except EyasError as e:  # a check in the stage's __post_init__
        raise EyasError(f"{where}: {e}", e.exit_code) from None


def split_commas(value: Any) -> Any:
    """"2,15, 29" -> ["2", "15", "29"]; a single number -> [it]; lists and None as they are."""
    if isinstance(value, str):
        return [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [value]
    return value


def _number_type(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(a in (int, float) for a in args) and bool not in args


def subset(obj: Any, cls: type[T]) -> T:
    """The `cls` part of a schema that builds on it (e.g. the trainer's config out of `eyas train`'s)."""
    return cls(**{f.name: getattr(obj, f.name) for f in fields(cls)})


def to_mapping(obj: Any) -> dict[str, Any]:
    """The options as plain JSON-able values (paths as text), e.g. for a fingerprint."""
    out = {}
    for f in fields(type(obj)):
        v = getattr(obj, f.name)
        out[f.name] = str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
    return out


# ---------------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------------


def _renamed(cls: type, values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """`values` with each field's old name (option(old_name=)) read as its new one, noting the rename."""
    out = dict(values)
    for f in fields(cls):
        old = f.metadata.get("old_name")
        if old and old in out and f.name not in out:
            print(f"eyas: note: {where}.{old} is now `{f.name}`; the old key is deprecated", file=sys.stderr)
            out[f.name] = out.pop(old)
    return out


def cli_command(cls: type[T], run: Callable[[T], Any]) -> Callable[..., None]:
    """A typer command function whose options are `cls`'s fields; it builds `cls(**options)` (which
    runs its checks) and calls `run` with it."""
    hints = type_hints(cls)
    params = []
    for f, panel in _declared(cls):
        if not f.metadata.get("cli", True):
            continue
        tp = _cli_type(hints[f.name])
        tp = str if f.metadata.get("comma") or typing.get_origin(tp) is Literal else tp
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=tp,
                                        default=_typer_param(f, hints[f.name], panel)))

    json_fields = {name for name, tp in hints.items() if _is_mapping(tp)}
    comma_fields = {f.name: f.metadata.get("flag") or "--" + f.name.replace("_", "-")
                    for f in fields(cls) if f.metadata.get("comma")}

    old_flags = {"--" + f.metadata["old_name"].replace("_", "-"): f.name for f in fields(cls)
                 if f.metadata.get("old_name")}

    def command(**kwargs: Any) -> None:
        for old in old_flags.keys() & {a.split("=")[0] for a in sys.argv[1:]}:
            print(f"eyas: note: {old} is now --{old_flags[old].replace('_', '-')}; the old flag is deprecated",
                  file=sys.stderr)
        for name in (json_fields | set(comma_fields)) & set(kwargs):
            if kwargs[name] is None:  # not given: the field's own default
                del kwargs[name]
            elif name in json_fields:
                kwargs[name] = _json_option(name, kwargs[name])
            else:
                kwargs[name] = _comma_option(comma_fields[name], kwargs[name], hints[name])
        run(cls(**kwargs))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = cls.__doc__
    command.options_class = cls  # type: ignore[attr-defined]  # what a command's hints are checked against
    return command


def _cli_type(tp: Any) -> Any:
    """What typer parses: Optional[X] as X (None stays the default), a mapping as JSON text."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return _cli_type(rest[0])
    if origin is dict:
        return str
    return tp


def _comma_option(flag: str, text: str, tp: Any) -> list[Any]:
    """A list option given on the command line as "2,15,29", each item converted to the list's type."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    item = next((typing.get_args(a)[0] for a in args if typing.get_origin(a) is list and typing.get_args(a)), str)
    parts = split_commas(text)
    try:
        return [item(p) for p in parts]
    except ValueError:
        raise EyasError(f"{flag} {text!r}: expected comma-separated values, each "
                        f"{type_name(item)} (e.g. 2,15,29)") from None


def _choice_parser(flag: str, choices: list[str]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        if value not in choices:
            import typer

            raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=flag)
        return value

    return parse


def _is_mapping(tp: Any) -> bool:
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    return any(typing.get_origin(a) is dict or a is dict for a in args)


def _json_option(name: str, text: Any) -> Any:
    """A mapping option given on the command line as a JSON object."""
    if not isinstance(text, str):
        return text
    flag = "--" + name.replace("_", "-")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise EyasError(f"{flag} is not valid JSON ({e.msg}): {text}") from e
    if not isinstance(value, dict):
        raise EyasError(f"{flag} must be a JSON object like '{{\"key\": 1}}', not {text}")
    return value


def _typer_param(f: dataclasses.Field, tp: Any, panel: str | None = None) -> Any:
    import typer  # only the command line needs it: components import their schemas without it

    meta = f.metadata
    default = default_of(f)
    required = default is _MISSING
    show = meta.get("show_default", True)
    if not required and (_is_mapping(tp) or meta.get("comma")):  # parsed from text by `cli_command`
        if show is True:
            show = ",".join(map(str, default)) if meta.get("comma") and default else False
        default = None  # left out: the field's own default applies
    if meta.get("positional"):
        return typer.Argument(... if required else default, help=meta.get("help", ""), show_default=show)
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    if _cli_type(tp) is bool and not required:
        if default is not False:  # on by default, or None (decided at run time): both spellings
            flag = f"{flag}/--no-{flag.removeprefix('--')}"
        show = ("on" if default else "off") if show is True else show
    elif default is None and show is True:
        show = False  # "[default: None]" says nothing; the help says what leaving it out does
    names = [flag] + ([meta["short"]] if meta.get("short") else [])
    if meta.get("old_name"):
        names.append("--" + meta["old_name"].replace("_", "-"))
    extra = {}
    if typing.get_origin(_cli_type(tp)) is Literal:  # choices parsed here: the same on every typer version
        choices = [str(c) for c in typing.get_args(_cli_type(tp))]
        extra = {"parser": _choice_parser(flag.split("/")[0], choices), "metavar": "|".join(choices)}
    return typer.Option(... if required else default, *names, help=meta.get("help", ""), show_default=show,
                        rich_help_panel=panel, **extra)


def to_cli_args(obj: Any) -> list[str]:
    """The command-line arguments that build `obj` again through `cli_command`: each field that differs
    from its default (how `eyas run` hands a stage's options to torchrun, and prints the command)."""
    cls, hints = type(obj), type_hints(type(obj))
    positional, flags = [], []
    for f, _ in _declared(cls):
        value, default = getattr(obj, f.name), default_of(f)
        if default is not _MISSING and value == default:
            continue
        if not f.metadata.get("cli", True) or value is None:
            raise EyasError(f"{f.name} = {value!r} has no command-line spelling; `eyas run` cannot hand it to "
                            "another process: leave it at its default")
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if f.metadata.get("positional"):
            positional += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        elif isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag.removeprefix('--')}")
        elif f.metadata.get("comma"):
            flags += [flag, ",".join(map(str, value))]
        elif _is_mapping(hints[f.name]):
            flags += [flag, json.dumps(value)]
        elif isinstance(value, tuple):
            flags += [flag, *map(str, value)]
        elif isinstance(value, list):
            for v in value:
                flags += [flag, str(v)]
        else:
            flags += [flag, str(value)]
    return positional + flags
