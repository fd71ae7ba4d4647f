"""The layout's rules, checked on the source: imports run one way, and the wheel claims only ``jaxkv``.

Levels, lowest first (a module may import its own level or lower, never higher):

    sizing, protocol            shared helpers and the layer contract
    quantization, eviction      QuantSpec and the (de)quantizers; EvictionSpec and the policies' scores
    layers/*                    storage strategies (no layer module imports a sibling)
    cache                       the container and its registry of layer types
    attention, encoder_decoder  what reads a cache, the encoder-decoder container
    memory, persist             sizing formulas and cache files
    models/*  |  decoding/*     model files and decoding strategies (neither imports the other)
    serving/*                   the engine: paged pools, scheduler, compiled step (uses decoding, not models)
    app/*                       CLI and YAML configs: nothing in the library imports it

``jaxkv/__init__.py`` re-exports the core (levels up to ``memory``/``persist``) and is
treated as that level.
"""

import ast
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

LEVELS = {
    "jaxkv.sizing": 0,
    "jaxkv.protocol": 0,
    "jaxkv.quantization": 0,
    "jaxkv.sharding": 0,
    "jaxkv.hugepages": 0,
    "jaxkv.eviction": 0,
    "jaxkv.layers": 1,
    "jaxkv.cache": 2,
    "jaxkv.attention": 3,
    "jaxkv.encoder_decoder": 3,
    "jaxkv.memory": 4,
    "jaxkv.persist": 4,
    "jaxkv": 4,  # the package's __init__: the core's public names
    "jaxkv.models": 5,
    "jaxkv.decoding": 5,
    "jaxkv.serving": 6,
    "jaxkv.app": 7,
}
# Independent: the first may not import the second (the engine takes any model that keeps the contract).
SIBLINGS = {"jaxkv.models": "jaxkv.decoding", "jaxkv.decoding": "jaxkv.models", "jaxkv.serving": "jaxkv.models"}


def module_name(path: Path) -> str:
    """Import name of a source file; models/ ships as jaxkv.models."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "models":
        parts = ["jaxkv", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def is_module(name: str) -> bool:
    parts = name.split(".")
    if parts[:2] == ["jaxkv", "models"]:
        parts = parts[1:]
    path = ROOT.joinpath(*parts)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit(name: str) -> str:
    """The LEVELS key a module belongs to: the longest matching prefix."""
    return max((key for key in LEVELS if name == key or name.startswith(key + ".")), key=len)


def library_files() -> list[Path]:
    return sorted([*(ROOT / "jaxkv").rglob("*.py"), *(ROOT / "models").rglob("*.py")])


def imported_modules(path: Path, name: str) -> list[str]:
    """Every jaxkv module ``path`` imports (function-level imports included), absolute."""
    found = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            found.append(base)
            # `from jaxkv.models import llama` imports a module; `from jaxkv.cache import Cache` does not.
            found += [f"{base}.{alias.name}" for alias in node.names if is_module(f"{base}.{alias.name}")]
    return [m for m in found if m == "jaxkv" or m.startswith("jaxkv.") or m == "models" or m.startswith("models.")]


def violations() -> list[str]:
    problems = []
    for path in library_files():
        name = module_name(path)
        here = unit(name)
        for target in imported_modules(path, name):
            if target == "models" or target.startswith("models."):
                problems.append(f"{name} imports top-level {target!r}: import jaxkv.models instead")
                continue
            there = unit(target)
            if LEVELS[there] > LEVELS[here]:
                problems.append(f"{name} (level {LEVELS[here]}) imports {target} (level {LEVELS[there]})")
            if SIBLINGS.get(here) == there:
                problems.append(f"{name} imports {target}: {here} and {there} must not depend on each other")
            if here == there == "jaxkv.layers" and target != name and not target.startswith(name + "."):
                if name != "jaxkv.layers":  # the package __init__ re-exports its modules
                    problems.append(f"{name} imports its sibling layer module {target}: share through jaxkv.protocol")
    return problems


def test_imports_run_one_way():
    assert violations() == []


def test_the_checker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The rule is live: a layer module importing the container is reported."""
    bad = ROOT / "jaxkv" / "layers" / "static.py"
    source = bad.read_text() + "\nfrom jaxkv.cache import Cache  # noqa\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == bad else real_read(self, *a, **k))
    assert any("jaxkv.layers.static" in p and "jaxkv.cache" in p for p in violations())


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return next(out.glob("jaxkv-*.whl"))


def test_wheel_claims_only_the_jaxkv_import_name(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top_level == {"jaxkv"}
    assert "jaxkv/models/llama.py" in names and "jaxkv/app/cli.py" in names and "jaxkv/layers/static.py" in names


def test_installed_wheel_imports_jaxkv_models_not_models(wheel, tmp_path):
    """Installed (not from the checkout), ``import jaxkv.models`` works and ``import models`` fails."""
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    probe = (
        "import importlib.util, sys\n"
        f"sys.path = [p for p in sys.path if p not in ('', {str(ROOT)!r})]\n"
        f"sys.path.insert(0, {str(target)!r})\n"
        "sys.meta_path = [f for f in sys.meta_path if 'editable' not in type(f).__name__.lower()"
        " and 'editable' not in getattr(f, '__name__', '').lower()]\n"
        "import jaxkv.models.llama, jaxkv.app.cli\n"
        f"assert jaxkv.models.llama.__file__.startswith({str(target)!r}), jaxkv.models.llama.__file__\n"
        "print('models' if importlib.util.find_spec('models') else 'no models')\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "no models"
