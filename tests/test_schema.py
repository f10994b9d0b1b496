"""One schema per stage: the same dataclass gives the CLI options and validates YAML sections."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest
import typer
from typer.testing import CliRunner

from eyas.utils.io import EyasError
from eyas.utils.schema import cli_command, from_mapping, option


@dataclass(kw_only=True)
class Demo:
    """A demo stage."""

    inputs: list[str] = option(default_factory=list, positional=True, help="Inputs.")
    out: Path = option(short="-o", help="Output folder.")
    lr: float = option(1e-4, help="Learning rate.")
    mode: Literal["auto", "on", "off"] = option("auto", help="Mode.")
    online: bool = option(False, help="Online.")
    baseline: bool = option(True, help="Baseline.")
    layers: list[int] | None = option(None, comma=True, help="Layer ids.", show_default="2,N//2,N-3")
    kwargs: dict[str, Any] = option(default_factory=dict, help="Template variables.")
    limit: int | None = option(None, help="Stop after N.", show_default="all")
    sizes: list[int] = option(default_factory=lambda: [1], comma=True, flag="--size", help="Sizes.")

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise EyasError(f"--lr must be > 0, got {self.lr:g}")


def invoke(*args: str) -> tuple[Any, Any]:
    seen = []
    app = typer.Typer(add_completion=False)
    app.command("demo")(cli_command(Demo, seen.append))
    app.command("other")(lambda: None)  # two commands: typer keeps the command name
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "160"})
    return result, seen[0] if seen else None


def test_the_cli_builds_the_schema_with_its_types():
    result, opts = invoke("demo", "a.json", "b.json", "-o", "x", "--lr", "0.01", "--mode", "on", "--online",
                          "--no-baseline", "--layers", "2,15,29", "--kwargs", '{"enable_thinking": false}',
                          "--size", "1,4")
    assert result.exit_code == 0, result.output
    assert opts == Demo(inputs=["a.json", "b.json"], out=Path("x"), lr=0.01, mode="on", online=True, baseline=False,
                        layers=[2, 15, 29], kwargs={"enable_thinking": False}, sizes=[1, 4])
    result, opts = invoke("demo", "-o", "x")
    assert opts == Demo(out=Path("x"))  # every default is the schema's own


def test_the_cli_refuses_bad_values_clearly():
    result, _ = invoke("demo", "-o", "x", "--mode", "sometimes")
    assert result.exit_code == 2 and "sometimes" in result.output
    result, _ = invoke("demo", "--lr", "0.1")
    assert result.exit_code == 2 and "--out" in result.output  # required
    for args, message in ((["--layers", "2,x"], "--layers '2,x': expected comma-separated values, each an integer"),
                          (["--size", "1,x"], "--size '1,x': expected"),  # the flag as spelled, not the field
                          (["--kwargs", "[1]"], "JSON object"), (["--lr", "-1"], "--lr must be > 0")):
        result, _ = invoke("demo", "-o", "x", *args)
        assert isinstance(result.exception, EyasError) and message in str(result.exception)


def test_help_shows_every_default_one_way():
    text = invoke("demo", "--help")[0].output
    for shown in ("[default: 0.0001]", "[default: auto]", "[default: (off)]", "[default: (2,N//2,N-3)]",
                  "[default: (all)]"):
        assert shown in text, shown
    assert "None" not in text


def test_yaml_sections_are_validated_with_the_key_the_value_and_the_type():
    assert from_mapping(Demo, {"out": "x", "lr": "1e-4", "layers": "2, 15"}, "c.yaml: demo") == \
        Demo(out=Path("x"), lr=1e-4, layers=[2, 15])  # YAML reads 1e-4 as text; a number is what it means
    assert from_mapping(Demo, {"out": "x", "layers": [2, 15]}, "c.yaml: demo").layers == [2, 15]
    cases = [({"out": "x", "lr": "fast"}, "c.yaml: demo.lr = 'fast': expected a number"),
             ({"out": "x", "lr": True}, "c.yaml: demo.lr = True: expected a number"),
             ({"out": 5}, "c.yaml: demo.out = 5: expected a path"),
             ({"out": "x", "inputs": "a.json"}, "c.yaml: demo.inputs = 'a.json': expected a list of text"),
             ({"out": "x", "mode": "sometimes"}, "expected one of 'auto', 'on', 'off'"),
             ({"out": "x", "limit": 2.5}, "demo.limit = 2.5: expected an integer"),
             ({"out": "x", "lr": -1}, "c.yaml: demo: --lr must be > 0"),
             ({"lr": 1}, "option 'out' is required"),
             ({"out": "x", "epochs": 2}, "unknown option(s) ['epochs']"),
             (["out"], "expected a mapping")]
    for values, message in cases:
        with pytest.raises(EyasError) as err:
            from_mapping(Demo, values, "c.yaml: demo")
        assert message in str(err.value), (values, str(err.value))
