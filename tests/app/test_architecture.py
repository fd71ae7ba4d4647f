"""The layout's rules, checked on the source: imports run one way, and the wheel claims only ``jaxkv``.

Levels, lowest first (a module may import its own level or lower, never higher):

    sizing, softmax, protocol   shared helpers, the attention math over slots, the layer contract
    mla                         MLA's spec, attention forms and latent storage (both latent layers build on it)
    batch                       a serving step's packed batch and the capabilities that read it
    quantization, eviction      QuantSpec and the (de)quantizers; EvictionSpec and the policies' scores
    retrieval                   RetrievalSpec, page summaries and the pages a query reads (both retrieving layers)
    kernels                     attention backends: Pallas kernels over a layer's page pool
    layers/*                    storage strategies (no layer module imports a sibling)
    cache                       the container and its registry of layer types
    attention, encoder_decoder  what reads a cache, the encoder-decoder container
    memory, persist             sizing formulas and cache files
    models/*  |  decoding/*     model files and decoding strategies (neither imports the other)
    serving/*                   the engine: paged pools, scheduler, compiled step (uses decoding, not models)
    config, engine_args         the YAML configs the applications share; engine flags and loading
    server/*  |  research/*     the HTTP server; tasks, experiment grid, MQAR trainer (neither imports the other)
    bench/*                     the benchmarks (the quantized run times the research tasks' perplexity)
    cli/*                       the command line: its subcommands run the server, the benchmarks, the research

Everything from ``config`` up is application code: nothing in the library imports it. ``server``,
``research`` and ``bench`` import their own optional dependencies, declared as pyproject.toml extras
of those names; the core install imports none of them.

``jaxkv/__init__.py`` re-exports the core (levels up to ``memory``/``persist``) and is
treated as that level.
"""

import ast
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

LEVELS = {
    "jaxkv.sizing": 0,
    "jaxkv.softmax": 0,
    "jaxkv.protocol": 0,
    "jaxkv.batch": 0,
    "jaxkv.quantization": 0,
    "jaxkv.sharding": 0,
    "jaxkv.hugepages": 0,
    "jaxkv.eviction": 0,
    "jaxkv.retrieval": 0,
    "jaxkv.mla": 0,
    "jaxkv.page_table": 0,
    "jaxkv.kernels": 0,
    "jaxkv.layers": 1,
    "jaxkv.offload": 1,
    "jaxkv.cache": 2,
    "jaxkv.attention": 3,
    "jaxkv.encoder_decoder": 3,
    "jaxkv.memory": 4,
    "jaxkv.persist": 4,
    "jaxkv": 4,  # the package's __init__: the core's public names
    "jaxkv.models": 5,
    "jaxkv.decoding": 5,
    "jaxkv.serving": 6,
    "jaxkv.config": 7,
    "jaxkv.engine_args": 7,
    "jaxkv.server": 8,
    "jaxkv.research": 8,
    "jaxkv.bench": 9,
    "jaxkv.cli": 10,
}
# Independent: a unit may not import those listed (the engine takes any model that keeps the contract).
SIBLINGS = {
    "jaxkv.models": {"jaxkv.decoding"},
    "jaxkv.decoding": {"jaxkv.models"},
    "jaxkv.serving": {"jaxkv.models"},
    "jaxkv.server": {"jaxkv.research"},
    "jaxkv.research": {"jaxkv.server"},
}
# The pyproject.toml extra holding each application package's own third-party imports.
PACKAGE_EXTRAS = {"jaxkv.server": "serve", "jaxkv.research": "research", "jaxkv.bench": "bench"}
# Import name -> distribution name, where they differ by more than `-`/`_`/case.
DISTRIBUTIONS = {"yaml": "pyyaml"}
# Modules run by another environment's python, with the imports that environment provides (not jaxkv's
# dependencies): the serving benchmark's vLLM worker runs in vLLM's own venv (jaxkv.bench.vllm_env),
# the decode benchmark's llama.cpp worker in llama.cpp's (jaxkv.bench.llama_cpp_env).
OTHER_ENVIRONMENTS = {"jaxkv.bench.vllm_worker": {"vllm"}, "jaxkv.bench.llama_cpp_worker": {"llama_cpp"}}


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
            if there in SIBLINGS.get(here, ()):
                problems.append(f"{name} imports {target}: {here} and {there} must not depend on each other")
            if here == there == "jaxkv.layers" and target != name and not target.startswith(name + "."):
                if name != "jaxkv.layers":  # the package __init__ re-exports its modules
                    problems.append(f"{name} imports its sibling layer module {target}: share through jaxkv.protocol")
    return problems


def test_imports_run_one_way():
    assert violations() == []


def test_the_scheduler_never_touches_pages():
    """The engine's stages: the scheduler decides, the KV manager owns the pages (its one
    allocation answer is all the scheduler sees), and only the KV manager imports the ledger."""
    serving = ROOT / "jaxkv" / "serving"
    importers = sorted(
        path.stem for path in serving.glob("*.py") if "jaxkv.serving.pages" in imported_modules(path, module_name(path))
    )
    assert importers == ["kv_manager"]


def test_only_the_applications_import_research():
    """Research code (the observer cache and its refill, the tasks, the trainer) stays out of the core:
    besides the research package itself, only the benchmarks and the command line import it."""
    importers = {
        unit(module_name(path))
        for path in library_files()
        if any(m.split(".")[:2] == ["jaxkv", "research"] for m in imported_modules(path, module_name(path)))
    }
    assert importers <= {"jaxkv.research", "jaxkv.bench", "jaxkv.cli"}, importers


def test_the_checker_sees_a_wrong_way_import(tmp_path, monkeypatch):
    """The rule is live: a layer module importing the container is reported."""
    bad = ROOT / "jaxkv" / "layers" / "static.py"
    source = bad.read_text() + "\nfrom jaxkv.cache import Cache  # noqa\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == bad else real_read(self, *a, **k))
    assert any("jaxkv.layers.static" in p and "jaxkv.cache" in p for p in violations())


def distribution(name: str) -> str:
    """The normalized (PEP 503) distribution name of a requirement (``uvicorn[standard]>=0.29``) or an import."""
    name = DISTRIBUTIONS.get(name, name)
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9._-]+", name).group()).lower()


def declared() -> tuple[set[str], dict[str, set[str]]]:
    """The core dependencies and each extra's, as distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"].items()
    return {distribution(spec) for spec in project["dependencies"]}, {
        extra: {distribution(spec) for spec in specs} for extra, specs in extras
    }


def third_party_imports(path: Path) -> set[str]:
    """The top-level names of the non-standard-library modules ``path`` imports (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names) - {"__future__", "jaxkv", "models"}


def undeclared_imports() -> list[str]:
    """Imports of jaxkv/ and models/ declared neither in the core dependencies nor in the extra of their package."""
    core, extras = declared()
    problems = []
    for path in library_files():
        name = module_name(path)
        extra = PACKAGE_EXTRAS.get(unit(name))
        for module in sorted(third_party_imports(path) - OTHER_ENVIRONMENTS.get(name, set())):
            if distribution(module) not in core | extras.get(extra, set()):
                where = "the core dependencies" + (f" or the {extra!r} extra" if extra else "")
                problems.append(f"{name} imports {module}: declare {distribution(module)} in {where} (pyproject.toml)")
    return problems


def test_every_import_is_declared():
    assert undeclared_imports() == []


def test_the_dependency_checker_sees_an_undeclared_import(monkeypatch):
    """The rule is live: the container importing an extra's module (optax, the research extra's) is reported."""
    bad = ROOT / "jaxkv" / "cache.py"
    source = bad.read_text() + "\nimport optax  # noqa\n"
    real_read = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: source if self == bad else real_read(self, *a, **k))
    assert any(p.startswith("jaxkv.cache imports optax") for p in undeclared_imports())


def test_every_core_dependency_is_imported_by_the_core():
    """A core dependency that only an application package (or only the tests) imports belongs in an extra."""
    core, _ = declared()
    core_files = [path for path in library_files() if unit(module_name(path)) not in PACKAGE_EXTRAS]
    imported = {distribution(module) for path in core_files for module in third_party_imports(path)}
    assert core - imported == set()


def test_the_cli_checks_each_extra_as_pyproject_declares_it():
    from jaxkv.cli.main import COMMAND_EXTRAS, EXTRAS

    _, extras = declared()
    assert set(COMMAND_EXTRAS.values()) == set(EXTRAS)
    assert {extra: {distribution(module) for module in modules} for extra, modules in EXTRAS.items()} == {
        extra: extras[extra] for extra in EXTRAS
    }


def test_setup_for_the_tests_installs_every_extra():
    """``bash scripts/setup.sh test`` (what CI runs before the suite) installs all the optional dependencies."""
    _, extras = declared()
    installed = re.search(r'extras="\[([a-z,]+)\]"', (ROOT / "scripts" / "setup.sh").read_text()).group(1)
    assert set(installed.split(",")) == set(extras)


def test_the_core_imports_without_any_extra():
    """Every module outside server/, research/ and bench/ imports with no extra's module installed, and a
    command needing an extra stops with the pip command that installs it."""
    _, extras = declared()
    blocked = {"fastapi", "uvicorn", "prometheus_client", "optax", "matplotlib", "gensim", "torch", "transformers",
               "psutil"}  # fmt: skip
    assert {distribution(module) for module in blocked} == set().union(*(extras[e] for e in PACKAGE_EXTRAS.values()))
    blocked = sorted(blocked - {"optax"})  # flax.nnx imports optax (flax requires it): every install has it
    names = [module_name(path) for path in library_files()]
    core = sorted(name for name in names if unit(name) not in PACKAGE_EXTRAS and not name.endswith("__main__"))
    probe = (
        "import importlib, sys\n"
        f"sys.modules.update(dict.fromkeys({blocked!r}))  # each import raises ImportError\n"
        f"for name in {core!r}:\n"
        "    importlib.import_module(name)\n"
        "from jaxkv.cli.main import main\n"
        "sys.exit(main(['train-mqar', 'configs/mqar.yaml']))\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "jaxkv train-mqar needs the research extra" in run.stderr
    assert "pip install 'jaxkv[research]'" in run.stderr


@pytest.mark.parametrize(
    "argv, missing, extra",
    [
        (["train-mqar", "configs/mqar.yaml"], "optax", "research"),
        (["experiment", "configs/experiments/smoke.yaml", "--dry-run"], "gensim", "research"),
        (["serve"], "fastapi", "serve"),
    ],
)
def test_a_command_without_its_extra_says_which_to_install(monkeypatch, capsys, argv, missing, extra):
    """The check runs before the command: nothing is loaded or trained, and the message names the missing
    module and the extra that installs it."""
    import jaxkv.cli.main as cli

    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    monkeypatch.setattr(cli.SUBCOMMANDS[argv[0]], "run", lambda args: pytest.fail("the command ran without its extra"))
    assert cli.main(argv) == 2
    assert capsys.readouterr().err.strip() == (
        f"jaxkv: error: jaxkv {argv[0]} needs the {extra} extra ({missing} not installed): pip install 'jaxkv[{extra}]'"
    )


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
    assert "jaxkv/models/llama.py" in names and "jaxkv/cli/main.py" in names and "jaxkv/layers/static.py" in names
    packages = {path.parent.relative_to(ROOT).as_posix() for path in (ROOT / "jaxkv").rglob("__init__.py")}
    assert {f"{package}/__init__.py" for package in packages} <= set(names), "a package missing from pyproject"


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
        "import jaxkv.models.llama, jaxkv.cli.main\n"
        f"assert jaxkv.models.llama.__file__.startswith({str(target)!r}), jaxkv.models.llama.__file__\n"
        "print('models' if importlib.util.find_spec('models') else 'no models')\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "no models"
