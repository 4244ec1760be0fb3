"""The architecture's layering, enforced: the cluster server imports no laptop code, the client no backend, the
shared modules nothing above them, the remote-machine layer no backend or CLI. Every import is read from the
source (function-level and TYPE_CHECKING ones too) and resolved to the module it names, with pyproject's
package-dir mapping (client/ is art_sky.client, cluster/ is art_sky.cluster). import-linter's graph builder cannot
follow that mapping, hence this small checker; a test below shows it catches a violation.
"""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import art_sky

ROOT = Path(__file__).resolve().parent.parent
LAPTOP = (
    "art_sky.backends",
    "art_sky.remote",
    "art_sky.cli",
    "art_sky.ci",
    "art_sky.clusters",
    "art_sky.provisioners",
    "art_sky.demo",
    "art_sky.dashboard",
    "paramiko",
    "sky",
)
SHARED = (
    "art_sky.wire",
    "art_sky.errors",
    "art_sky.settings",
    "art_sky.layout",
    "art_sky.files",
    "art_sky.disk_full",
    "art_sky.checkpoints",
    "art_sky.store",
    "art_sky.capacity",
    "art_sky.ownership",
    "art_sky.redact",
)
# (importer prefix, what it must not import): the data path's layers, one way
RULES = [
    ("art_sky.cluster", LAPTOP + ("art_sky.client",)),
    ("art_sky.client", LAPTOP + ("art_sky.cluster", "art_sky.art_compat")),
    # ART compatibility sits between the backends (which mix in its protocol) and the client (whose trajectories it
    # builds): it knows neither a backend nor the server
    ("art_sky.art_compat", LAPTOP + ("art_sky.cluster",)),
    # the one HTTP client of the server: the wire and the errors, nothing of who calls it
    ("art_sky.server_client", LAPTOP + ("art_sky.client", "art_sky.cluster", "art_sky.art_compat")),
    *((shared, LAPTOP + ("art_sky.client", "art_sky.cluster")) for shared in SHARED),
    (
        "art_sky.remote",
        ("art_sky.backends", "art_sky.cli", "art_sky.ci", "art_sky.client", "art_sky.cluster", "art_sky.clusters"),
    ),
    ("art_sky.backends", ("art_sky.cli", "art_sky.ci", "art_sky.cluster")),
    # the dashboard reads a run's files: it never asks a server or a backend (it cannot slow training)
    ("art_sky.dashboard", ("art_sky.backends", "art_sky.cluster", "art_sky.client", "art_sky.remote", "art_sky.cli")),
    # ART's extra names: the judge and the internal config know nothing of backends or the server
    *((extra, LAPTOP + ("art_sky.cluster",)) for extra in ("art_sky.rewards", "art_sky.dev")),
    # the engines' helpers: grammars and tool-call parsing, each its own job, used by the engines, never the reverse
    *(
        (
            helper,
            (
                "art_sky.cluster.inference.portable_engine",
                "art_sky.cluster.inference.vllm_engine",
                "art_sky.cluster.training",
                "art_sky.cluster.server",
            ),
        )
        for helper in ("art_sky.cluster.inference.constraints", "art_sky.cluster.inference.tool_parsers")
    ),
    # how the server stops the children it starts: for the engines and trainers, knowing none of them
    (
        "art_sky.cluster.processes",
        (
            "art_sky.cluster.inference",
            "art_sky.cluster.training",
            "art_sky.cluster.node",
            "art_sky.cluster.server",
            "art_sky.cluster.steps",
            "art_sky.cluster.replica",
        ),
    ),
    # Inside the server: engines and trainers do not know each other; what composes them (the server, a step's
    # transaction, node/ choosing what runs) sits above both; node/placement is data both read. Unsloth's trainer is
    # the one exception: its model runs vLLM inside (fast_inference), sized as the vLLM engine sizes its LoRA slots.
    (
        "art_sky.cluster.inference",
        ("art_sky.cluster.training", "art_sky.cluster.server", "art_sky.cluster.steps", "art_sky.cluster.replica"),
    ),
    # A replica's server and the head's are two servers: what both need (the API key's check, ...) sits below both.
    ("art_sky.cluster.replica", ("art_sky.cluster.server",)),
    # The fleet knows engines by their protocol only: each replica's is the head's or a replica server's.
    (
        "art_sky.cluster.inference.fleet",
        ("art_sky.cluster.inference.portable_engine", "art_sky.cluster.inference.vllm_engine", "art_sky.cluster.node"),
    ),
    *(
        (trainer, ("art_sky.cluster.inference", "art_sky.cluster.server", "art_sky.cluster.steps"))
        for trainer in (
            "art_sky.cluster.training.sequences",
            "art_sky.cluster.training.grpo",
            "art_sky.cluster.training.peft_trainer",
            "art_sky.cluster.training.weights",
            "art_sky.cluster.training.sharded",
            "art_sky.cluster.training.rank_group",
            "art_sky.cluster.training.rank_commands",
        )
    ),
]


def sources() -> dict[str, str]:
    """Module name -> source of every module in the distribution."""
    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {}
    for package, folder in package_dirs.items():
        for path in (ROOT / folder).rglob("*.py"):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path.read_text()
    return found


def imported(module: str, source: str, is_package: bool) -> set[str]:
    """The modules `source` imports, absolute; `from art_sky import Name` resolves a lazy public name."""
    names: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                names.add(art_sky._PUBLIC.get(alias.name, target) if base == "art_sky" else target)
    return names


def violations(modules: dict[str, str], packages: set[str]) -> list[str]:
    found = []
    for module, source in modules.items():
        for name in imported(module, source, module in packages):
            for importer, forbidden in RULES:
                if (module == importer or module.startswith(importer + ".")) and any(
                    name == f or name.startswith(f + ".") for f in forbidden
                ):
                    found.append(f"{module} imports {name}")
    return sorted(found)


def _packages(modules: dict[str, str]) -> set[str]:
    return {m for m in modules if any(other.startswith(m + ".") for other in modules)} | {
        "art_sky",
        "art_sky.client",
        "art_sky.cluster",
    }


def test_the_layers_import_one_way():
    modules = sources()
    assert {
        "art_sky.cluster.server",
        "art_sky.cluster.replica",
        "art_sky.cluster.inference.fleet",
        "art_sky.client.model",
        "art_sky.remote.lifecycle",
    } <= set(modules)
    assert violations(modules, _packages(modules)) == []


def test_the_checker_catches_a_violation():
    fake = {
        "art_sky.cluster.fake": "from art_sky import SSHBackend\nfrom ..remote import tunnel\n",
        "art_sky.client.fake": "if TYPE_CHECKING:\n    from art_sky.backends.base import Backend\n",
    }
    assert violations(fake, set()) == [
        "art_sky.client.fake imports art_sky.backends.base",
        "art_sky.client.fake imports art_sky.backends.base.Backend",
        "art_sky.cluster.fake imports art_sky.backends",
        "art_sky.cluster.fake imports art_sky.remote",
        "art_sky.cluster.fake imports art_sky.remote.tunnel",
    ]


def test_the_server_loads_no_ssh_stack():
    """What `python -m art_sky.cluster` imports (a head or a replica): no paramiko, no tunnel, no backend, no
    client."""
    probe = (
        "import sys, art_sky.cluster.server, art_sky.cluster.replica; "
        "print(sorted(m for m in sys.modules if m == 'paramiko' or "
        "m.startswith(('art_sky.backends', 'art_sky.remote', 'art_sky.client', 'art_sky.cli'))))"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
