"""The structure the code map promises, checked on the source: no import cycles, config a leaf, generic code that
names no model's modules, a training loop of small functions, and model families found through the registry."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.core.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hpctrain", "data_prep", "hydra_plugins")


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = path
    return mods


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at any depth of the file: an import inside a function is an
    import all the same (it is how the old cycle through config.register() was hidden)."""
    mods = _modules(root)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in mods.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names)  # `from pkg import module`
        graph[mod] = {o for n in names if (o := owner(n)) and o != mod}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The check itself: a two-module cycle through a function-level import is reported."""
    pkg = tmp_path / "hpctrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from hpctrain import b\n")
    (pkg / "b.py").write_text("def f():\n    from hpctrain.a import x\n")
    assert cycles(import_graph(tmp_path)) == [["hpctrain.a", "hpctrain.b"]]


# The layers, lowest first: a module imports only from its own layer or below. Folders are the layers (the
# package root holds only the version; cli.py and __main__.py are the top). docs/architecture.md draws the same.
LAYERS = (
    ("core", ("hpctrain", "hpctrain.core")),  # schema, errors, files, the shard format, argument parsing
    ("models, data_prep", ("hpctrain.models", "data_prep")),  # model families; corpus -> shards (offline)
    ("parallel, data", ("hpctrain.parallel", "hpctrain.data")),  # layouts and their application; the loader
    ("storage, runtime, monitoring", ("hpctrain.storage", "hpctrain.runtime", "hpctrain.monitoring")),
    ("runs", ("hpctrain.runs",)),  # composing, resolving and checking a run's config; its directory
    ("weights", ("hpctrain.weights",)),  # weights out to other formats
    ("evaluation", ("hpctrain.evaluation",)),  # lm-evaluation-harness's tasks over a score function
    ("training", ("hpctrain.training",)),  # the trainer's components, the loop, the memory planner
    ("launch", ("hpctrain.launch",)),  # Slurm submission, sweeps, preflight
    ("tools", ("hpctrain.tools",)),  # generate, summary, benchmarks, gpu-check
    ("cli", ("hpctrain.cli", "hpctrain.__main__", "hydra_plugins")),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix that owns `module`."""
    owners = [(len(prefix), i) for i, (_, prefixes) in enumerate(LAYERS) for prefix in prefixes
              if module == prefix or module.startswith(prefix + ".")]
    assert owners, f"{module} is in no layer: add its folder to LAYERS (tests/test_architecture.py)"
    return max(owners)[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} ({LAYERS[layer_of(a)][0]}) imports {b} ({LAYERS[layer_of(b)][0]})"
                  for a, imported in graph.items() for b in imported if layer_of(b) > layer_of(a))


def test_layers_import_only_downward():
    assert upward_imports(import_graph()) == []


def test_the_layer_check_finds_an_upward_import(tmp_path):
    """The check itself: the model layer importing the trainer, inside a function, is reported."""
    for pkg in ("hpctrain", "hpctrain/models", "hpctrain/training"):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "__init__.py").write_text("")
    (tmp_path / "hpctrain/training/trainer.py").write_text("from hpctrain.models import llama\n")
    (tmp_path / "hpctrain/models/llama.py").write_text("def f():\n    from hpctrain.training.trainer import x\n")
    assert upward_imports(import_graph(tmp_path)) == [
        "hpctrain.models.llama (models, data_prep) imports hpctrain.training.trainer (training)"]


def test_the_package_root_holds_only_the_version_and_the_entry_points():
    """Folders are the layers: a new module belongs in one of them, not beside them."""
    loose = sorted(p.name for p in (ROOT / "hpctrain").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "cli.py"]


def test_config_is_a_leaf():
    """Every module may read the schema: config.py imports nothing of the project."""
    assert import_graph()["hpctrain.core.config"] == set()


@pytest.mark.parametrize("module", ["hpctrain.parallel.parallelize", "hpctrain.parallel.layout",
                                    "hpctrain.training.trainer", "hpctrain.training.step",
                                    "hpctrain.training.model_init", "hpctrain.training.planner",
                                    "hpctrain.tools.generate"])
def test_generic_code_names_no_model_modules(module):
    """Module names of one family (Llama's) belong to its spec: generic code takes them from there."""
    source = _modules()[module].read_text()
    for name in ("tok_embeddings", "wq", "feed_forward", "Llama(", "hpctrain.models.llama"):
        assert name not in source, f"{module} names {name}"


def test_functions_fit_on_a_screen():
    """No function in hpctrain/ or data_prep/ over 60 lines."""
    too_long = []
    for path in sorted([*(ROOT / "hpctrain").rglob("*.py"), *(ROOT / "data_prep").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                too_long.append(f"{path.relative_to(ROOT)}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert too_long == []


def test_generate_does_not_load_the_cluster_code():
    """Sampling text needs the model and a checkpoint, not the Slurm launcher or the trainer."""
    code = ("import sys, hpctrain.tools.generate; "
            "print(sorted(m for m in sys.modules if m.startswith(('hpctrain.launch', 'hpctrain.runtime', "
            "'hpctrain.training', 'hydra_plugins', 'submitit'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_command_s_front_does_not_load_torch():
    """`python -m hpctrain --help` and a usage error load the CLI and the launcher plugins Hydra scans, not torch
    (1.6 s of the 2.9 s --help took while the launcher plugin pulled in runtime.job)."""
    code = ("import sys, hpctrain.cli, hydra_plugins.hpctrain_launcher.hpctrain_launcher; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_the_supervisor_does_not_load_torch():
    """The in-allocation supervisor (cluster.spare_nodes) is no rank: it starts and watches srun steps, and loading
    torch cost each job 1.7 core-s and 210 MB of memory on its batch node."""
    code = ("import sys, hpctrain.launch.supervise; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"


def test_families_come_from_the_registry():
    from hpctrain.models import get_spec
    from hpctrain.models.llama.model import Llama

    spec = get_spec("llama")
    assert spec.model_type is Llama and spec.first_stage == ("tok_embeddings",)
    with pytest.raises(ConfigError, match="model.family='gpt9' is not a known model family: use one of llama"):
        get_spec("gpt9")


def test_every_package_is_listed():
    """pyproject.toml lists packages by name (the configs are mapped in, hydra_plugins is a namespace package): a
    new subpackage left off the list would be missing from every wheel."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for top in ("hpctrain", "data_prep", "hydra_plugins")
             for init in (ROOT / top).rglob("__init__.py")}
    assert listed - {"hpctrain.conf", "hydra_plugins"} == found - {"hydra_plugins"}


def test_the_schema_holds_every_model_argument():
    """config.ModelConfig (the keys users set) and each family's own arguments are declared apart, so that the
    model knows nothing of configs and config imports nothing: every argument must be a key, with its default, or a
    trait some family fixes (Qwen2's q/k/v biases)."""
    import dataclasses

    from hpctrain.core.config import ModelConfig
    from hpctrain.models import FAMILIES, get_spec

    keys = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    traits = {name for family in FAMILIES for name, _ in get_spec(family).traits}
    for family in FAMILIES:
        for f in dataclasses.fields(get_spec(family).args_type):
            assert (f.name in keys and keys[f.name] == f.default) or f.name in traits, (family, f.name)


def test_the_code_map_names_every_module():
    """docs/architecture.md's code map is how a newcomer finds things: every folder of hpctrain/ and every module
    of hpctrain/ and data_prep/ must be named there (a module by its file name, a folder as `name/`)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    code_map = text[text.index("## Code map"):]
    missing = [f"{d.name}/" for d in sorted((ROOT / "hpctrain").rglob("*")) if d.is_dir()
               and (d / "__init__.py").exists() and f"{d.name}/" not in code_map]
    missing += [str(p.relative_to(ROOT)) for top in ("hpctrain", "data_prep") for p in sorted((ROOT / top).rglob("*.py"))
                if p.name not in ("__init__.py", "__main__.py") and p.name not in code_map]
    assert missing == [], f"add to the code map in docs/architecture.md: {missing}"


# Where the whole config may go (a plan, a check or a record of a whole run); everything else gets its group.
WHOLE_CONFIG = ("hpctrain.cli", "hpctrain.core.config", "hpctrain.runs", "hpctrain.launch", "hpctrain.training.run",
                "hpctrain.training.checkpoint_eval", "hpctrain.tools.evaluate.configured",
                "hpctrain.training.planner", "hpctrain.training.layout_search",
                "hpctrain.training.trainer.Trainer.__init__",
                "hpctrain.monitoring.trackers.resolved_config")


def whole_config_takers(root: Path = ROOT) -> list[str]:
    """Functions that take the whole config (a parameter named `cfg`, or annotated `Config`) outside WHOLE_CONFIG."""
    found = []
    for module, path in _modules(root).items():
        tree = ast.parse(path.read_text())
        for parent in ast.walk(tree):
            for node in ast.iter_child_nodes(parent):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                if any(a.arg == "cfg" or (a.annotation is not None and ast.unparse(a.annotation) == "Config")
                       for a in args):
                    owner = f".{parent.name}" if isinstance(parent, ast.ClassDef) else ""
                    found.append(f"{module}{owner}.{node.name}")
    return sorted(f for f in found if not any(f == w or f.startswith(w + ".") for w in WHOLE_CONFIG))


def test_components_take_their_group_not_the_whole_config():
    assert whole_config_takers() == []


def test_the_whole_config_check_finds_a_component_taking_it(tmp_path):
    (tmp_path / "hpctrain" / "training").mkdir(parents=True)
    (tmp_path / "hpctrain" / "training" / "feed.py").write_text(
        "class Feed:\n    def __init__(self, cfg):\n        pass\n\n\ndef val(data, whole: Config):\n    pass\n")
    assert whole_config_takers(tmp_path) == ["hpctrain.training.feed.Feed.__init__", "hpctrain.training.feed.val"]
