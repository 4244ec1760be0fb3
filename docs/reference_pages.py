"""The reference pages' generated parts, as Markdown, read from the code itself: every setting from `Settings`, every
command from the typer app, every route from the server's OpenAPI document. docs/hooks.py puts them into the site at
build time, so none can be missing or stale; tests/test_docs.py checks each reaches the site. The Python API page is
mkdocstrings' (reference/python-api.md); `public_names` is what it must hold."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

HOME = str(Path.home())


# -- settings ---------------------------------------------------------------------------------------------------
def setting_names(name: str, field: Any) -> list[str]:
    """The environment variables a setting is read from (art_sky.settings.variables)."""
    from art_sky.settings import variables

    return variables(name, field)


def _type(field: Any) -> str:
    from art_sky.settings import choices

    if allowed := choices(field):
        return "one of " + ", ".join(f"`{value}`" for value in allowed)
    annotation = field.annotation
    text = getattr(annotation, "__name__", None) if not getattr(annotation, "__args__", None) else None
    text = text or str(annotation).replace("typing.", "").replace("pathlib.", "").replace("pydantic.types.", "")
    text = text.replace("NoneType", "None").replace("SecretStr", "secret").replace(" | ", " or ")
    bounds = [
        f"{symbol} {getattr(m, attr)}"
        for m in field.metadata
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        if hasattr(m, attr)
    ]
    return ", ".join([text, *bounds])


def _default(field: Any) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if value == "":
        return '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{str(value).replace(HOME, '~')}`"


def settings_markdown() -> str:
    """A table of every setting: its variable, type, default and description, from art_sky/settings.py."""
    from art_sky.settings import STORE_VARIABLES, Settings

    rows = ["| setting | type | default | what it does |", "| --- | --- | --- | --- |"]
    for name, field in Settings.model_fields.items():
        variables = ", ".join(f"`{v}`" for v in setting_names(name, field))
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| {variables} | {_type(field)} | {_default(field)} | {description} |")
    store = ", ".join(f"`{v}`" for v in STORE_VARIABLES)
    return (
        "\n".join(rows) + f"\n\nThe object store's credentials keep their usual names ({store}): read from the "
        "environment, then `.env`, and forwarded to the cluster's server by every backend "
        "([Checkpoints](../guides/checkpoints.md#pointing-it-at-a-store)).\n"
    )


# -- CLI --------------------------------------------------------------------------------------------------------
def cli_commands() -> list[str]:
    """Every command's full name (`art-sky checkpoints ls`), groups included."""
    import typer

    from art_sky.cli import app

    names = []

    def walk(command: Any, prefix: str) -> None:
        names.append(prefix)
        for sub in getattr(command, "commands", {}).values():
            walk(sub, f"{prefix} {sub.name}")

    walk(typer.main.get_command(app), "art-sky")
    return names


def cli_markdown() -> str:
    """Every command's usage, arguments and options, as typer's own `typer ... utils docs` writes them."""
    import typer
    from typer.cli import get_docs_for_click

    from art_sky.cli import app

    command = typer.main.get_command(app)
    return (
        get_docs_for_click(
            obj=command, ctx=typer.Context(command), indent=1, name="art-sky", title="Every command"
        ).strip()
        + "\n"
    )


# -- HTTP API ---------------------------------------------------------------------------------------------------
def openapi_document() -> dict:
    """The cluster server's own OpenAPI document (what `/openapi.json` serves), from its app on the portable engine."""
    from art_sky.cluster.server import create_app
    from art_sky.settings import Settings

    with tempfile.TemporaryDirectory() as art_path:
        app = create_app(Path(art_path), "docs", Settings(engine="portable", trainer="peft"))
        return app.openapi()


def _ref(schema: dict) -> str:
    return schema["$ref"].rsplit("/", 1)[-1]


def _schema_type(schema: dict) -> str:
    """A JSON schema as a short type: models link to their section below."""
    if "$ref" in schema:
        return f"[{_ref(schema)}](#{_ref(schema).lower()})"
    if "anyOf" in schema or "oneOf" in schema:
        return " or ".join(_schema_type(s) for s in schema.get("anyOf", schema.get("oneOf")))
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    kind = schema.get("type", "any")
    if kind == "array":
        return f"list of {_schema_type(schema.get('items', {}))}"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map of {_schema_type(schema['additionalProperties'])}"
    return "null" if kind == "null" else str(kind)


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _bodies(content: dict) -> str:
    return ", ".join(f"{_schema_type(body.get('schema', {}))} (`{kind}`)" for kind, body in content.items())


def _operation(method: str, path: str, operation: dict) -> list[str]:
    lines = [f"### `{method.upper()} {path}`", "", _cell(operation.get("summary")), ""]
    if operation.get("description"):
        lines += [operation["description"].strip(), ""]
    lines.append("Needs the API key." if operation.get("security") else "Open: no API key needed.")
    parameters = operation.get("parameters", [])
    if parameters:
        lines += ["", "| parameter | in | type | required |", "| --- | --- | --- | --- |"]
        lines += [
            f"| `{p['name']}` | {p['in']} | {_schema_type(p.get('schema', {}))} | "
            f"{'yes' if p.get('required') else 'no'} |"
            for p in parameters
        ]
    body = operation.get("requestBody")
    if body:
        lines += ["", f"Request body: {_bodies(body['content'])}."]
    lines += ["", "| status | response |", "| --- | --- |"]
    for status, response in operation.get("responses", {}).items():
        content = f": {_bodies(response['content'])}" if response.get("content") else ""
        lines.append(f"| {status} | {_cell(response.get('description'))}{content} |")
    return [*lines, ""]


def _model(name: str, schema: dict) -> list[str]:
    lines = [f"### {name}", ""]
    if schema.get("description"):
        lines += [_cell(schema["description"]), ""]
    properties = schema.get("properties", {})
    if not properties:
        return [*lines, f"Type: {_schema_type(schema)}.", ""]
    required = set(schema.get("required", []))
    lines += ["| field | type | required | default | description |", "| --- | --- | --- | --- | --- |"]
    for field, sub in properties.items():
        default = f"`{json.dumps(sub['default'])}`" if "default" in sub else ""
        lines.append(
            f"| `{field}` | {_schema_type(sub)} | {'yes' if field in required else 'no'} | {default} | "
            f"{_cell(sub.get('description'))} |"
        )
    return [*lines, ""]


def http_markdown(document: dict | None = None) -> str:
    """Every route with its parameters, request body and responses, then every message model's fields."""
    document = document or openapi_document()
    lines = ["## Routes", "", "| route | what it does |", "| --- | --- |"]
    operations = [(m, p, o) for p, item in document["paths"].items() for m, o in item.items()]
    lines += [f"| [`{m.upper()} {p}`](#{_anchor(m, p)}) | {_cell(o.get('summary'))} |" for m, p, o in operations]
    lines.append("")
    for method, path, operation in operations:
        lines += _operation(method, path, operation)
    lines += ["## Messages", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        lines += _model(name, schema)
    return "\n".join(lines)


def _anchor(method: str, path: str) -> str:
    """The anchor Python-Markdown's toc gives the route's heading."""
    import re

    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", f"{method} {path}".lower())).strip("-")


# -- Python API -------------------------------------------------------------------------------------------------
def public_names() -> list[str]:
    """art_sky's public names, which reference/python-api.md renders with mkdocstrings (tests/test_docs.py checks
    each is there)."""
    import art_sky

    return sorted(n for n in art_sky.__all__ if not n.startswith("_"))
