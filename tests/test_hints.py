"""Every hint eyas can print names an option that exists: each `--flag` (and each `--flag value` whose option
takes one of a few values) in a message string under eyas/ is checked against the options of every command
that can print it, or of the command the message names (`eyas extract --verify`)."""

from __future__ import annotations

import ast
import re
import types
import typing
from pathlib import Path

import networkx as nx
import typer
from test_structure import PACKAGE, import_graph, module_names

from eyas.cli import app
from eyas.utils.schema import fields, type_hints

FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w{-])(?:[ =]([a-z][a-z0-9_-]*(?:\.[a-z0-9_-]+)*))?")
QUOTED = re.compile(r"`([^`]*)`")  # `eyas extract --verify`: that command's; `pip install --no-deps`: not eyas'
# modules whose messages fewer commands print than import them (the import graph cannot tell): which do
ONLY = {"eyas.engines.head": {"extract", "train"}}  # read_target_head: the vllm capture engine, online training
PRINTERS = {"EyasError", "warn", "echo", "secho", "print", "log", "say", "BadParameter"}
# words that follow a flag in a sentence ("--overlong must be ..."), not a value given to it
PROSE = {"must", "is", "are", "was", "be", "needs", "takes", "gives", "and", "or", "to", "with", "of", "for", "from",
         "in", "on", "only", "as", "the", "a", "an", "can", "not", "also", "at", "then", "so", "if", "but", "here"}


def choices_of(tp: object) -> set[str] | None:
    """The values an option of type `tp` takes when they are a fixed few (a Literal, optional or not)."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    lit = next((a for a in args if typing.get_origin(a) is typing.Literal), None)
    return {str(v) for v in typing.get_args(lit)} if lit is not None else None


def command_options() -> dict[str, dict[str, set[str] | None]]:
    """Each command's flags (from the CLI itself), with the values a flag takes when they are a fixed few."""
    group = typer.main.get_command(app)
    out = {}
    for info in app.registered_commands:
        cls = info.callback.options_class
        hints = type_hints(cls)
        choices = {f.metadata.get("flag") or "--" + f.name.replace("_", "-"): choices_of(hints[f.name])
                   for f in fields(cls)}
        out[info.name] = {o: choices.get(p.opts[0]) for p in group.commands[info.name].params
                          for o in [*p.opts, *p.secondary_opts] if o.startswith("--")}
    return out


def message_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string a module passes to what prints a message (EyasError, warnings, log and echo
    lines); an f-string reads with `{}` for each value."""
    tree = ast.parse(path.read_text())
    out, seen = [], set()
    for call in ast.walk(tree):
        func = getattr(call, "func", None)
        if not isinstance(call, ast.Call) or getattr(func, "id", getattr(func, "attr", None)) not in PRINTERS:
            continue
        for node in ast.walk(call):
            if id(node) in seen:
                continue
            if isinstance(node, ast.JoinedStr):
                seen.update(id(v) for v in node.values)
                out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                                 for v in node.values)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                out.append((node.lineno, node.value))
            seen.add(id(node))
    return out


def printing_commands() -> dict[str, set[str]]:
    """Each eyas module -> the commands that can run its code: those whose recipe imports it, directly or
    through modules that are not another command's recipe."""
    graph = import_graph()
    recipes = {info.callback.options_class.__module__: info.name for info in app.registered_commands}
    reach: dict[str, set[str]] = {}
    for module, name in recipes.items():
        own = graph.subgraph(n for n in graph if n == module or (n not in recipes and n != "eyas.cli"))
        for m in {module} | nx.descendants(own, module):
            reach.setdefault(m, set()).add(name)
    return reach


def hints(text: str, commands: set[str]) -> list[tuple[set[str], str, str | None]]:
    """(commands, flag, value) of each `--flag [value]` in `text`: a flag quoted after `eyas CMD` is CMD's, one
    quoted after another program's name is not eyas', and any other belongs to `commands`."""
    found = []
    for m in QUOTED.finditer(text):
        words = m.group(1).split()
        if words and words[0] == "eyas" and len(words) > 1:
            found += [({words[1]}, f.group(1), f.group(2)) for f in FLAG.finditer(m.group(1))]
        elif words and words[0].startswith("-"):
            found += [(commands, f.group(1), f.group(2)) for f in FLAG.finditer(m.group(1))]
    found += [(commands, f.group(1), f.group(2)) for f in FLAG.finditer(QUOTED.sub(" ", text))]
    return found


def wrong_in(where: str, text: str, commands: set[str], options: dict[str, dict[str, set[str] | None]]) -> list[str]:
    """What is wrong with the hints of one message that `commands` can print: a flag none of them has, or a
    value the flag of one of them does not take."""
    wrong = []
    for cmds, flag, value in hints(text, commands):
        having = {c: options[c][flag] for c in sorted(cmds) if flag in options.get(c, {})}
        if cmds and not having:
            wrong.append(f"{where}: {flag}: no option of `eyas {'`, `eyas '.join(sorted(cmds))}`")
        for cmd, choices in having.items():
            if value and value not in PROSE and choices is not None and value not in choices:
                wrong.append(f"{where}: `eyas {cmd} {flag}` takes {', '.join(sorted(choices))}, not {value}")
    return wrong


def wrong_hints() -> list[str]:
    options, reach, wrong = command_options(), printing_commands(), []
    for module, path in sorted(module_names(PACKAGE).items()):
        commands = ONLY.get(module, reach.get(module, set()))
        for line, text in message_strings(path):
            wrong += wrong_in(f"{path.relative_to(PACKAGE.parent)}:{line}", text, commands, options)
    return wrong


def test_every_hint_names_an_option_its_command_has():
    assert wrong_hints() == []


def test_a_bogus_hint_is_caught():
    """The check itself: what it must refuse and what it must let pass."""
    options = command_options()
    assert printing_commands()["eyas.generate.graph_decode"] >= {"eval", "regenerate"}  # eval's fallback runs it
    bad = {"use --engine generate": {"eval", "regenerate"}, "pass --frobnicate 3": {"train"},
           "rerun `eyas extract --out X --verfy`": {"train"}, "--target <folder>": {"export"}}
    good = {"use --engine generate": {"regenerate"}, "give --format all or --draft DIR": {"export"},
            "rerun `eyas extract --out X --verify`": {"train"}, "`pip install --no-deps x`": {"eval"},
            "--overlong must be one of drop, truncate": {"prepare"}}
    for text, commands in bad.items():
        assert wrong_in("planted", text, commands, options), text
    for text, commands in good.items():
        assert wrong_in("planted", text, commands, options) == [], text
