"""The package map holds: imports point one way, and no two modules import each other.

Every ``import`` of our own code is read from the source with ``ast`` (imports inside
functions too, so a lazy import cannot hide an upward edge or a cycle). Each module belongs
to one component, and each component to one layer; a module may import its own component
or a component of a lower layer, never a higher layer nor a sibling on its layer.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("alpha", "processors", "dual_sampling")

LAYERS: tuple[tuple[str, ...], ...] = (
    # Value checks of single settings, the modes as data and the roster's record schema: they import nothing of
    # ours; anything may use them.
    ("dual_sampling.checks", "dual_sampling.modes", "dual_sampling.roster"),
    # Leaves: pure math, text, vocabularies, model folders, records, prompts, run outputs on disk.
    (
        "alpha",
        "dual_sampling.text",
        "dual_sampling.vocab",
        "dual_sampling.models",
        "dual_sampling.records",
        "dual_sampling.prompts",
        "dual_sampling.run_output",
    ),
    ("dual_sampling.lockstep", "dual_sampling.decision", "dual_sampling.beams"),
    ("processors",),  # the vLLM plugins
    ("dual_sampling.options",),
    ("dual_sampling.driver",),
    ("dual_sampling.api", "dual_sampling.run_settings"),
    ("dual_sampling.server", "dual_sampling.datagen", "dual_sampling.distill", "dual_sampling.testing"),
    ("dual_sampling.integrations",),  # other projects' trainers: uses the distillation loop's sampler–trainer check
    ("dual_sampling.cli",),
)
"""Components from the bottom up. The package ``dual_sampling`` itself (its ``__init__``) names
its public classes by string and loads them on first use; it imports nothing."""


def component(module: str) -> str:
    """The longest component of :data:`LAYERS` that ``module`` is, or lies inside."""
    names = [c for layer in LAYERS for c in layer if module == c or module.startswith(c + ".")]
    if not names:
        return module
    return max(names, key=len)


def layer(name: str) -> int:
    return next(i for i, names in enumerate(LAYERS) if name in names)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """module → our modules it imports (anywhere in its code)."""
    sources = {module_name(p, root): p for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in sources.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from a import b` imports module a.b when there is one, else a name of a
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in sources else node.module
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in sources:  # `import a.b.c` of a name: the module that holds it
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def layering_errors(graph: dict[str, set[str]]) -> list[str]:
    errors = []
    for source, targets in sorted(graph.items()):
        if source == "dual_sampling":
            if targets:
                errors.append(f"dual_sampling/__init__ imports {sorted(targets)}: it must name its exports lazily")
            continue
        mine = component(source)
        if mine not in {c for names in LAYERS for c in names}:
            errors.append(f"{source} belongs to no component of LAYERS")
            continue
        for target in sorted(targets):
            theirs = component(target)
            if theirs == mine or target == "dual_sampling":
                continue
            if theirs not in {c for names in LAYERS for c in names}:
                errors.append(f"{target} (imported by {source}) belongs to no component of LAYERS")
            elif layer(theirs) >= layer(mine):
                errors.append(f"{source} imports {target}: {theirs} is not below {mine}")
    return errors


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(sorted(scc))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_down_the_layers_and_form_no_cycle():
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 30  # the walk found the packages
    assert layering_errors(graph) == []
    assert cycles(graph) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.mark.parametrize(
    ("files", "expected"),
    [
        # a plugin reaching up into the driver, from inside a function
        (
            {"processors/leader.py": "def f():\n    from dual_sampling.driver.pair import EnginePair\n"},
            "processors.leader imports dual_sampling.driver.pair",
        ),
        # two siblings on one layer
        (
            {"dual_sampling/server/app.py": "from dual_sampling.datagen.run import x\n"},
            "dual_sampling.server.app imports dual_sampling.datagen.run",
        ),
        # `from package import module` names the module
        ({"alpha/base.py": "from dual_sampling import api\n"}, "alpha.base imports dual_sampling.api"),
        (
            {"dual_sampling/__init__.py": "from dual_sampling.api import OptimalSamplingDual\n"},
            "dual_sampling/__init__",
        ),
        ({"dual_sampling/stray.py": "import alpha\n"}, "dual_sampling.stray belongs to no component"),
    ],
)
def test_the_layering_check_sees_an_upward_import(tmp_path, files, expected):
    base = {
        "alpha/__init__.py": "",
        "alpha/base.py": "",
        "processors/__init__.py": "",
        "processors/leader.py": "",
        "dual_sampling/__init__.py": "",
        "dual_sampling/api.py": "",
        "dual_sampling/driver/__init__.py": "",
        "dual_sampling/driver/pair.py": "import processors.leader\n",
        "dual_sampling/datagen/__init__.py": "",
        "dual_sampling/datagen/run.py": "x = 1\n",
        "dual_sampling/server/__init__.py": "",
        "dual_sampling/server/app.py": "",
    }
    _write(tmp_path, base)
    assert layering_errors(import_graph(tmp_path, PACKAGES)) == []
    _write(tmp_path, files)
    errors = layering_errors(import_graph(tmp_path, PACKAGES))
    assert any(expected in e for e in errors), errors


def test_the_cycle_check_sees_a_cycle_through_a_lazy_import(tmp_path):
    _write(
        tmp_path,
        {
            "dual_sampling/__init__.py": "",
            "dual_sampling/datagen/__init__.py": "",
            "dual_sampling/datagen/run.py": "def f():\n    from dual_sampling.datagen.ray_stage import g\n",
            "dual_sampling/datagen/ray_stage.py": "from dual_sampling.datagen.run import f\n",
        },
    )
    assert cycles(import_graph(tmp_path, ("dual_sampling",))) == [
        ["dual_sampling.datagen.ray_stage", "dual_sampling.datagen.run"]
    ]


FRONT_ENDS = ("dual_sampling.server", "dual_sampling.datagen", "dual_sampling.distill", "dual_sampling.cli")
"""Components that reach the engines only through ``dual_sampling.api`` (its one door), never the driver."""
LONG_MODULE_LINES = 500
"""A module longer than this must say why in its docstring (the words "over 500 lines")."""


def front_door_errors(graph: dict[str, set[str]]) -> list[str]:
    return [
        f"{source} imports {target}: front ends go through dual_sampling.api"
        for source, targets in sorted(graph.items())
        if component(source) in FRONT_ENDS
        for target in sorted(targets)
        if component(target) == "dual_sampling.driver"
    ]


def test_front_ends_reach_the_engines_through_the_api_only():
    assert front_door_errors(import_graph(ROOT, PACKAGES)) == []


def test_the_front_door_check_sees_a_server_module_importing_the_driver(tmp_path):
    files = {
        "dual_sampling/__init__.py": "",
        "dual_sampling/driver/__init__.py": "",
        "dual_sampling/driver/requests.py": "",
        "dual_sampling/server/__init__.py": "",
        "dual_sampling/server/serving.py": "def f():\n    from dual_sampling.driver.requests import x\n",
    }
    _write(tmp_path, files)
    assert front_door_errors(import_graph(tmp_path, ("dual_sampling",))) == [
        "dual_sampling.server.serving imports dual_sampling.driver.requests: front ends go through dual_sampling.api"
    ]


def test_modules_over_500_lines_say_why():
    long = []
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            if text.count("\n") > LONG_MODULE_LINES and "over 500 lines" not in (
                ast.get_docstring(ast.parse(text)) or ""
            ):
                long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert long == []


RUNNER_MODULES = {"processors.model_runner", "dual_sampling.testing.sim_engines"}
"""The modules that may speak vLLM's Model Runner V1 interface: the plugins' one seam, and the simulated engines,
which play V1's runner in tests (a port to V2 changes these two)."""
CPU_WORKER_PRELOAD = "dual_sampling.driver.engine_start"
"""May name V1's CPU worker modules as strings: the fork server preloads them, on the CPU only, where V2 (which needs
Triton) never runs."""
RUNNER_IMPORTS = ("vllm.v1.sample", "vllm.v1.worker", "vllm.v1.outputs")
ENGINE_CORE_NAMES = {"ModelRunnerOutput"}
"""Names from those modules that belong to the EngineCore's contract with any runner (the schedulers read them)."""
RUNNER_ATTRIBUTES = {
    "model_runner",
    "input_batch",
    "logitsprocs",
    "drafter",
    "req_ids",
    "num_spec_tokens",
    "num_draft_tokens",
    "draft_token_ids",
    "use_v2_model_runner",
    "dual_sampling_speculative",
    "_draft_probs",
    "_draft_prob_req_ids",
    "_sample",
    "_sample_from_logits",
}
"""Attributes of V1's worker, runner, drafter and speculation metadata; flagged on any receiver but ``self``/``cls``
(a class of ours may have an attribute of the same name), and as ``getattr``/``setattr``/``hasattr`` strings."""
_ATTRIBUTE_CALLS = ("getattr", "setattr", "hasattr")
RUNNER_NAMES = {"BatchUpdate", "MoveDirectionality", "SamplerOutput", "LogitsProcessor", "VLLM_USE_V2_MODEL_RUNNER"}


def _runner_use(node: ast.AST, module: str) -> str | None:
    """What V1 runner interface ``node`` uses, if any."""
    if isinstance(node, ast.ImportFrom):
        source = node.module or ""
        if source == "vllm.v1":
            return next(
                (f"vllm.v1.{a.name}" for a in node.names if f"vllm.v1.{a.name}".startswith(RUNNER_IMPORTS)), None
            )
        if source.startswith(RUNNER_IMPORTS):
            return next((f"{source}.{a.name}" for a in node.names if a.name not in ENGINE_CORE_NAMES), None)
    elif isinstance(node, ast.Import):
        return next((a.name for a in node.names if a.name.startswith(RUNNER_IMPORTS)), None)
    elif isinstance(node, ast.Attribute) and node.attr in RUNNER_ATTRIBUTES:
        receiver = node.value
        if not (isinstance(receiver, ast.Name) and receiver.id in ("self", "cls")):
            return node.attr
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _ATTRIBUTE_CALLS:
        name = node.args[1] if len(node.args) > 1 else None
        if isinstance(name, ast.Constant) and name.value in RUNNER_ATTRIBUTES:
            return name.value
    elif isinstance(node, ast.Name) and node.id in RUNNER_NAMES:
        return node.id
    elif isinstance(node, ast.Constant) and isinstance(node.value, str):
        if node.value in RUNNER_NAMES:
            return node.value
        if node.value.startswith(RUNNER_IMPORTS) and module != CPU_WORKER_PRELOAD:
            return node.value
    return None


def parsed_modules(root: Path, packages: tuple[str, ...]) -> Iterator[tuple[str, ast.Module]]:
    """(module name, its syntax tree) of every module of ``packages`` under ``root``, in path order."""
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            yield module_name(path, root), ast.parse(path.read_text(), str(path))


def runner_seam_errors(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Uses of V1's model-runner interface (its modules, its runner's attributes, its names) outside
    :data:`RUNNER_MODULES`, read from the code with ``ast`` (docstrings and comments may name them)."""
    found = set()
    for name, tree in parsed_modules(root, packages):
        if name in RUNNER_MODULES:
            continue
        docstrings = {
            id(n.body[0].value)
            for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body
            and isinstance(n.body[0], ast.Expr)
            and isinstance(n.body[0].value, ast.Constant)
        }
        for node in ast.walk(tree):
            use = None if id(node) in docstrings else _runner_use(node, name)
            if use is not None:
                found.add((name, node.lineno, use))
    return [f"{name}:{line} uses {use}" for name, line, use in sorted(found)]


def test_only_the_runner_seam_speaks_vllms_model_runner_interface():
    assert runner_seam_errors(ROOT, PACKAGES) == []


def test_the_runner_seam_check_sees_each_kind_of_use(tmp_path):
    files = {
        "processors/__init__.py": "",
        "processors/model_runner.py": "from vllm.v1.sample.logits_processor import BatchUpdate\n",
        "processors/sampler.py": (
            "import os\n"
            "from vllm.v1.outputs import SamplerOutput as Out, ModelRunnerOutput\n"
            "def f(worker, runner, sample):\n"
            "    os.environ['VLLM_USE_V2_MODEL_RUNNER'] = '0'\n"
            "    runner._sample = sample\n"
            "    return getattr(worker, 'model_runner'), hasattr(runner, 'drafter')\n"
        ),
        "processors/tracker.py": (
            '"""Follows BatchUpdate and the drafter."""\n'
            "import vllm.v1.worker.gpu_worker as gw\n"
            "from vllm.v1 import outputs\n"
            "from vllm.v1.sample.logits_processor import MoveDirectionality as Move\n"
            "class Tracker:\n"
            "    def __init__(self):\n"
            "        self.drafter = None\n"
            "        self.modules = __import__('importlib').import_module('vllm.v1.worker.cpu_worker')\n"
        ),
        "processors/scheduler.py": "from vllm.v1.outputs import ModelRunnerOutput\n",
    }
    _write(tmp_path, files)
    assert runner_seam_errors(tmp_path, ("processors",)) == [
        "processors.sampler:2 uses vllm.v1.outputs.SamplerOutput",
        "processors.sampler:4 uses VLLM_USE_V2_MODEL_RUNNER",
        "processors.sampler:5 uses _sample",
        "processors.sampler:6 uses drafter",
        "processors.sampler:6 uses model_runner",
        "processors.tracker:2 uses vllm.v1.worker.gpu_worker",
        "processors.tracker:3 uses vllm.v1.outputs",
        "processors.tracker:4 uses vllm.v1.sample.logits_processor.MoveDirectionality",
        "processors.tracker:8 uses vllm.v1.worker.cpu_worker",
    ]


def private_import_errors(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Imports of another module's private name (``from ours.x import _name``): what one module keeps to itself,
    another mode's driver included, is never reached from outside it."""
    errors = []
    for name, tree in parsed_modules(root, packages):
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in packages:
                errors += [
                    f"{name}:{node.lineno} imports {node.module}.{a.name}"
                    for a in node.names
                    if a.name.startswith("_") and not a.name.startswith("__")
                ]
    return errors


def test_no_module_imports_another_modules_private_names():
    assert private_import_errors(ROOT, PACKAGES) == []


def test_the_private_import_check_sees_one_mode_reaching_into_another(tmp_path):
    files = {
        "dual_sampling/__init__.py": "",
        "dual_sampling/driver/__init__.py": "",
        "dual_sampling/driver/pair.py": "def _qualname(cls):\n    return cls.__name__\n",
        "dual_sampling/driver/speculative_engine.py": (
            "from dual_sampling.driver.pair import EnginePair, _qualname\nfrom os import _exit\n"
        ),
    }
    _write(tmp_path, files)
    assert private_import_errors(tmp_path, ("dual_sampling",)) == [
        "dual_sampling.driver.speculative_engine:1 imports dual_sampling.driver.pair._qualname"
    ]


ROSTER_BLIND = (
    "dual_sampling.lockstep",
    "processors.scheduler",
    "processors.follower",
    "processors.base",
    "processors.leader",
)
"""Modules that know models by roster position only: the session's words, the schedulers and the lockstep
processors serve any roster. (The decision's K = 1 kernels keep their pair's names for the one teacher's and θ's
rows: that is their algorithm's math, not a roster's structure.)"""


def role_name_errors(root: Path, packages: tuple[str, ...]) -> list[str]:
    """Identifiers (names, attributes, arguments, definitions) in :data:`ROSTER_BLIND` modules that name a model by
    its role ("teacher", "theta"): a structure built for one roster."""
    found = set()
    for name, tree in parsed_modules(root, packages):
        if not any(name == m or name.startswith(m + ".") for m in ROSTER_BLIND):
            continue
        for node in ast.walk(tree):
            for ident in (
                getattr(node, "name", None) if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None,
                node.arg if isinstance(node, ast.arg) else None,
                node.attr if isinstance(node, ast.Attribute) else None,
                node.id if isinstance(node, ast.Name) else None,
            ):
                if ident and re.search("teacher|theta", ident, re.IGNORECASE):
                    found.add((name, node.lineno, ident))
    return [f"{module}:{line} names {ident}" for module, line, ident in sorted(found)]


def test_the_lockstep_core_knows_models_by_roster_position_only():
    assert role_name_errors(ROOT, PACKAGES) == []


def test_the_role_name_check_sees_a_per_role_word(tmp_path):
    files = {
        "dual_sampling/__init__.py": "",
        "dual_sampling/lockstep/__init__.py": "",
        "dual_sampling/lockstep/layout.py": '"""The teacher and theta, in prose: allowed."""\nTHETA_STEP = 11\n',
        "processors/__init__.py": "",
        "processors/scheduler.py": "def admit(c, teacher_budget):\n    return c.theta_arrived\n",
        "processors/leader.py": "logp_teacher = 0\n",
        "processors/speculative.py": "teacher_rows = 0\n",  # not roster-blind: the speculative mode is a pair's
    }
    _write(tmp_path, files)
    assert role_name_errors(tmp_path, ("dual_sampling", "processors")) == [
        "dual_sampling.lockstep.layout:2 names THETA_STEP",
        "processors.leader:1 names logp_teacher",
        "processors.scheduler:1 names teacher_budget",
        "processors.scheduler:2 names theta_arrived",
    ]
