"""vllm-gaudi's real source (``../shared/vllm_gaudi/``, the plugin at commit 091bbadd) read as
data: the names kvlog's Gaudi switch patches or calls, checked against it.

The plugin's modules import habana_frameworks and cannot be imported here, so they are parsed
(``ast``). :func:`check_source` returns every way the source no longer fits kvlog (empty:
it fits); :func:`extract_methods` takes methods out of a class of it to run them.
What kvlog patches is read from kvlog itself (``kvlog.integrations.gaudi`` and
``gaudi_connector``), so the check follows kvlog's patch points, not a copy of them.
"""

from __future__ import annotations

import ast
import inspect
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvlog.integrations import gaudi, gaudi_decode
from kvlog.integrations.gaudi_connector import FINISHED_HOOK, OUTPUT_NAME, RUNNER_GLOBALS

REPO = Path(__file__).resolve().parents[2]
ENV_SOURCE = "KVLOG_VLLM_GAUDI_SOURCE"  # where the plugin's files are, if not ../shared
PACKAGE = "vllm_gaudi"
DEFRAG_CLASS = "OnlineDefragmenter"
RUNNER_CLASS = "HPUModelRunner"
FILES = (
    "extension/defragmentation.py",
    "v1/worker/hpu_model_runner.py",
    "v1/worker/hpu_worker.py",
    "v1/spec_decode/hpu_eagle.py",
    "v1/kv_offload/worker/cpu_hpu.py",
)
OFFLOAD_FILE = FILES[4]
# the plugin patches these vLLM classes in cpu_hpu.py; kvlog's counterparts must keep the API
OFFLOAD_COUNTERPARTS = {
    "OffloadingConnectorWorker": "KvlogConnectorWorker",
    "CPUOffloadingWorker": "OffloadingWorker",
}


def source_root() -> Path | None:
    """The plugin's files: ``$KVLOG_VLLM_GAUDI_SOURCE`` or ``<repo>/../shared/vllm_gaudi``."""
    root = Path(os.environ.get(ENV_SOURCE) or REPO.parent / "shared" / PACKAGE)
    return root if all((root / f).is_file() for f in FILES) else None


def module_file(dotted: str) -> str:
    """``vllm_gaudi.v1.worker.hpu_worker`` -> ``v1/worker/hpu_worker.py``."""
    head, _, rest = dotted.partition(".")
    assert head == PACKAGE, dotted
    return rest.replace(".", "/") + ".py"


def parse(root: Path, rel: str) -> ast.Module:
    return ast.parse((root / rel).read_text(), filename=str(root / rel))


def classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}


def imported(tree: ast.Module, module: str) -> set[str]:
    """Names the module imports ``from module import ...`` (at any level of its body)."""
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == module
        for alias in node.names
    }


def _is_static_decorator(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "staticmethod"


def _is_static(fn: ast.FunctionDef) -> bool:
    return any(_is_static_decorator(d) for d in fn.decorator_list)


def _params(fn: ast.FunctionDef) -> list[tuple[str, bool]]:
    """(name, has a default) of each positional parameter, ``self`` left out for methods
    that are not static."""
    args = fn.args.posonlyargs + fn.args.args
    first_default = len(args) - len(fn.args.defaults)
    out = [(a.arg, i >= first_default) for i, a in enumerate(args)]
    return out if _is_static(fn) or not out or out[0][0] != "self" else out[1:]


def _binds(target: Callable[..., Any], n_args: int, keywords: list[str], bound: bool) -> bool:
    """Whether a call with ``n_args`` positional and these keyword arguments binds to
    ``target`` (``bound``: a method called on an instance, ``self`` supplied)."""
    sig = inspect.signature(target)
    args = [object()] * n_args
    try:
        if bound and _takes_self(target):
            sig.bind(object(), *args, **{k: object() for k in keywords})
        else:
            sig.bind(*args, **{k: object() for k in keywords})
    except TypeError:
        return False
    return True


def _takes_self(target: Callable[..., Any]) -> bool:
    params = list(inspect.signature(target).parameters)
    return bool(params) and params[0] == "self"


def _calls(tree: ast.AST) -> Iterator[ast.Call]:
    return (n for n in ast.walk(tree) if isinstance(n, ast.Call))


def _call_shape(call: ast.Call) -> tuple[int, list[str]]:
    return len(call.args), [k.arg for k in call.keywords if k.arg is not None]


# -- the checks ---------------------------------------------------------------------------


def check_modules(root: Path) -> list[str]:
    """The modules kvlog patches by name are the plugin's files."""
    names = [gaudi.DEFRAG_MODULE, *gaudi.RUNNER_MODULES]
    return [f"{n}: no {module_file(n)}" for n in names if not (root / module_file(n)).is_file()]


def check_defragmenter_class(root: Path) -> list[str]:
    """The plugin's class is where kvlog swaps it: defined in the defrag module, imported by
    name into each runner module (so the swap of the module globals reaches every call),
    and each ``OnlineDefragmenter(...)`` there builds kvlog's."""
    problems = []
    tree = parse(root, module_file(gaudi.DEFRAG_MODULE))
    cls = classes(tree).get(DEFRAG_CLASS)
    if cls is None:
        return [f"{gaudi.DEFRAG_MODULE} defines no {DEFRAG_CLASS}"]
    init = methods(cls).get("__init__")
    n_init = len(_params(init)) if init else 0
    if not _binds(gaudi.GaudiDefragmenter, n_init, [], bound=False):
        problems.append(f"kvlog's defragmenter takes no {n_init} positional arguments")
    for name in gaudi.RUNNER_MODULES:
        tree = parse(root, module_file(name))
        if DEFRAG_CLASS not in imported(tree, gaudi.DEFRAG_MODULE):
            problems.append(f"{name} does not import {DEFRAG_CLASS} from {gaudi.DEFRAG_MODULE}")
        for call in _calls(tree):
            if isinstance(call.func, ast.Name) and call.func.id == DEFRAG_CLASS:
                n, kw = _call_shape(call)
                if not _binds(gaudi.GaudiDefragmenter, n, kw, bound=False):
                    problems.append(f"{name}:{call.lineno}: {DEFRAG_CLASS}({n} args, {kw})")
    return problems


def _defragmenter_uses(tree: ast.Module) -> Iterator[tuple[str, ast.Attribute, ast.Call | None]]:
    """Each ``<x>.defragmenter.<attr>`` in the tree, with its call if it is called."""
    called = {id(c.func): c for c in _calls(tree)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute)
            and node.value.attr == "defragmenter"
        ):
            yield node.attr, node, called.get(id(node))


def check_defragmenter_uses(root: Path) -> list[str]:
    """Every attribute the runner, worker and spec decode use on the defragmenter exists on
    kvlog's, and every call of one binds to kvlog's signature."""
    problems = []
    cls = gaudi.GaudiDefragmenter
    for rel in FILES[1:4]:
        for attr, node, call in _defragmenter_uses(parse(root, rel)):
            target = inspect.getattr_static(cls, attr, None)
            where = f"{rel}:{node.lineno}: defragmenter.{attr}"
            if target is None:
                problems.append(f"{where}: kvlog's defragmenter has no {attr}")
            elif call is not None:
                n, kw = _call_shape(call)
                if not callable(target) or not _binds(target, n, kw, bound=True):
                    problems.append(f"{where}({n} args, {kw}) does not bind to kvlog's")
    return problems


def check_run_defragmenter(root: Path) -> list[str]:
    """Each runner class's ``run_defragmenter`` has kvlog's parameters (names, defaults),
    and every ``self.run_defragmenter(...)`` binds to kvlog's."""
    problems = []
    ours = inspect.signature(gaudi.run_defragmenter).parameters
    want = [(p.name, p.default is not p.empty) for p in list(ours.values())[1:]]
    found = False
    for name in gaudi.RUNNER_MODULES:
        tree = parse(root, module_file(name))
        for cls in classes(tree).values():
            fn = methods(cls).get("run_defragmenter")
            if fn is not None:
                found = True
                if _params(fn) != want:
                    problems.append(f"{name}.{cls.name}.run_defragmenter{_params(fn)} != {want}")
        for call in _calls(tree):
            if isinstance(call.func, ast.Attribute) and call.func.attr == "run_defragmenter":
                n, kw = _call_shape(call)
                if not _binds(gaudi.run_defragmenter, n, kw, bound=True):
                    problems.append(f"{name}:{call.lineno}: run_defragmenter({n}, {kw})")
    if not found:
        problems.append("no runner class defines run_defragmenter")
    return problems


def _top_level_imports(tree: ast.Module) -> set[str]:
    return {
        alias.asname or alias.name
        for node in tree.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


def _annotation_nodes(tree: ast.Module) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        notes = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            all_args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            notes = [a.annotation for a in all_args] + [node.returns]
        elif isinstance(node, ast.AnnAssign):
            notes = [node.annotation]
        out |= {id(n) for note in notes if note is not None for n in ast.walk(note)}
    return out


def _bases(classes_: dict[str, ast.ClassDef], name: str) -> set[str]:
    """The class's bases by name, transitively within the module."""
    seen: set[str] = set()
    todo = [name]
    while todo:
        cls = classes_.get(todo.pop())
        for base in cls.bases if cls else ():
            if isinstance(base, ast.Name) and base.id not in seen:
                seen.add(base.id)
                todo.append(base.id)
    return seen


def _method_calls(fn: ast.FunctionDef, attr: str) -> list[ast.Call]:
    return [c for c in _calls(fn) if isinstance(c.func, ast.Attribute) and c.func.attr == attr]


def check_connector_output(root: Path) -> list[str]:
    """Where ``gaudi_connector`` completes the runner's connector output: the module's own
    ``KVConnectorOutput``, ``has_kv_transfer_group`` and ``get_kv_transfer_group`` globals;
    the output only ever called, keywords only; built after the step's
    ``get_finished_kv_transfers`` (a method of a base class of the builder, defined in the
    module) and before any ``clear_connector_metadata``."""
    name = gaudi.RUNNER_MODULES[0]
    tree = parse(root, module_file(name))
    problems = [
        f"{name} has no module-level {g}"
        for g in (OUTPUT_NAME, *RUNNER_GLOBALS)
        if g not in _top_level_imports(tree)
    ]
    notes = _annotation_nodes(tree)
    callees = {id(c.func) for c in _calls(tree)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Name)
            and node.id == OUTPUT_NAME
            and id(node) not in notes | callees
            and not isinstance(node.ctx, ast.Store)
        ):
            problems.append(f"{name}:{node.lineno}: {OUTPUT_NAME} used, not called")
    all_classes = classes(tree)
    owners = {c for c, cls in all_classes.items() if FINISHED_HOOK in methods(cls)}
    if not owners:
        problems.append(f"{name}: no class defines {FINISHED_HOOK}")
    builders = 0
    for cls in all_classes.values():
        for fn in methods(cls).values():
            outputs = [
                c for c in _calls(fn) if isinstance(c.func, ast.Name) and c.func.id == OUTPUT_NAME
            ]
            if not outputs:
                continue
            builders += 1
            problems += _check_builder(name, cls.name, fn, outputs, owners, all_classes)
    if not builders:
        problems.append(f"{name}: no method builds {OUTPUT_NAME}")
    return problems


def _check_builder(
    name: str,
    cls_name: str,
    fn: ast.FunctionDef,
    outputs: list[ast.Call],
    owners: set[str],
    all_classes: dict[str, ast.ClassDef],
) -> list[str]:
    where = f"{name}.{cls_name}.{fn.name}"
    problems = []
    if not owners & (_bases(all_classes, cls_name) | {cls_name}):
        problems.append(f"{where}: {FINISHED_HOOK} is not its class's ({sorted(owners)})")
    hooks = [c.lineno for c in _method_calls(fn, FINISHED_HOOK)]
    clears = [c.lineno for c in _method_calls(fn, "clear_connector_metadata")]
    for out in outputs:
        if out.args:
            problems.append(f"{where}:{out.lineno}: {OUTPUT_NAME} given positional arguments")
        before = [h for h in hooks if h < out.lineno]
        if not before:
            problems.append(f"{where}:{out.lineno}: {OUTPUT_NAME} with no {FINISHED_HOOK} before")
        elif any(max(before) < c < out.lineno for c in clears):
            problems.append(f"{where}:{out.lineno}: clear_connector_metadata before the output")
    return problems


def _kvlog_class(name: str) -> ast.ClassDef | None:
    """kvlog's class of that name, from its source (vLLM need not be importable)."""
    for path in sorted((REPO / "kvlog").rglob("*.py")):
        text = path.read_text()
        if f"class {name}" in text:
            found = classes(ast.parse(text)).get(name)
            if found is not None:
                return found
    return None


def check_offload_patches(root: Path) -> list[str]:
    """The methods ``cpu_hpu.py`` sets on vLLM's offloading classes: kvlog's counterpart
    defines each in its own class body (so the plugin's patch of vLLM's base class never
    replaces kvlog's) and takes the same positional arguments."""
    tree = parse(root, OFFLOAD_FILE)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    problems = []
    seen = 0
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Name)):
            continue
        for target in node.targets:
            if not (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)):
                continue
            ours = OFFLOAD_COUNTERPARTS.get(target.value.id)
            plugin_fn = funcs.get(node.value.id)
            if ours is None or plugin_fn is None or target.attr.startswith("__"):
                continue
            seen += 1
            cls = _kvlog_class(ours)
            mine = methods(cls).get(target.attr) if cls else None
            where = f"{OFFLOAD_FILE}:{node.lineno}: {target.value.id}.{target.attr}"
            if mine is None:
                problems.append(f"{where}: kvlog's {ours} does not define {target.attr}")
                continue
            n = len(_params(plugin_fn))
            have = _params(mine)
            if not sum(not d for _, d in have) <= n <= len(have):
                problems.append(f"{where}: {n} arguments, kvlog's {ours} takes {have}")
    if not seen:
        problems.append(f"{OFFLOAD_FILE} patches none of {sorted(OFFLOAD_COUNTERPARTS)}")
    return problems


def _self_attrs(fn: ast.FunctionDef) -> set[str]:
    """The ``self.<name>`` attributes a method reads or calls."""
    return {
        n.attr
        for n in ast.walk(fn)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
    }


def check_decode_inputs(root: Path) -> list[str]:
    """Where ``gaudi_decode`` resolves the decodes' table: each runner class's
    ``_create_decode_input_data`` takes ``gaudi_decode.PARAMETERS`` first; it reads the
    decode block size from ``self.attn_block_size``; it resolves through
    ``self._resolve_block`` / ``self._resolve_all_blocks`` only (never the defragmenter
    itself) and reads no block table but its parameter; every call of it passes the table
    positionally (the wrapper reads its first four arguments)."""
    hook, problems, found = gaudi_decode.DECODE_HOOK, [], False
    for name in gaudi.RUNNER_MODULES:
        tree = parse(root, module_file(name))
        for cls in classes(tree).values():
            fn = methods(cls).get(hook)
            if fn is None:
                continue
            found, where = True, f"{name}.{cls.name}.{hook}"
            names = tuple(n for n, _ in _params(fn))
            if ("self", *names)[: len(gaudi_decode.PARAMETERS)] != gaudi_decode.PARAMETERS:
                problems.append(f"{where}{names} does not start {gaudi_decode.PARAMETERS[1:]}")
            attrs = _self_attrs(fn)
            for need in ("attn_block_size", *gaudi_decode.RESOLVERS):
                if need not in attrs:
                    problems.append(f"{where} does not use self.{need}")
            if "defragmenter" in attrs:
                problems.append(f"{where} calls self.defragmenter itself")
            if any(isinstance(n, ast.Attribute) and n.attr == "block_table" for n in ast.walk(fn)):
                problems.append(f"{where} reads a block_table besides its parameter")
        for call in (c for c in _calls(tree) if isinstance(c.func, ast.Attribute)):
            if call.func.attr != hook:  # type: ignore[attr-defined]
                continue
            n, _ = _call_shape(call)
            if n < 4:
                problems.append(f"{name}:{call.lineno}: {hook} with {n} positional arguments")
    if not found:
        problems.append(f"no runner class defines {hook}")
    return problems


def check_source(root: Path) -> list[str]:
    """Every way the plugin's source no longer fits kvlog's patches (empty: it fits)."""
    problems = check_modules(root)
    if problems:
        return problems
    for check in (
        check_defragmenter_class,
        check_defragmenter_uses,
        check_run_defragmenter,
        check_connector_output,
        check_offload_patches,
        check_decode_inputs,
    ):
        problems += check(root)
    return problems


# -- running pieces of the plugin ---------------------------------------------------------


MIXIN = "HpuKVConnectorModelRunnerMixin"
MIXIN_METHODS = ("maybe_setup_kv_connector", "maybe_wait_for_kv_save", "get_finished_kv_transfers")
MIXIN_SOURCE = """
class HpuKVConnectorModelRunnerMixin:
    @staticmethod
    def maybe_setup_kv_connector(scheduler_output):
        if has_kv_transfer_group():
            kv_connector = get_kv_transfer_group()
            assert scheduler_output.kv_connector_metadata is not None
            kv_connector.bind_connector_metadata(scheduler_output.kv_connector_metadata)
            kv_connector.start_load_kv(get_forward_context())

    @staticmethod
    def maybe_wait_for_kv_save():
        if has_kv_transfer_group():
            get_kv_transfer_group().wait_for_save()

    @staticmethod
    def get_finished_kv_transfers(scheduler_output):
        if has_kv_transfer_group():
            return get_kv_transfer_group().get_finished(scheduler_output.finished_req_ids)
        return None, None
"""
"""The plugin's connector mixin (``HPUModelRunner``'s base in ``FILES[1]``) as a stand-in
where its file cannot be imported: the same calls in the same order, with the module's
``has_kv_transfer_group`` / ``get_kv_transfer_group`` / ``get_forward_context`` (its
``isinstance`` check on ``KVConnectorBase`` left out). Tests put a runner class after it;
where the plugin's source is at hand, ``extract_methods(root, FILES[1], MIXIN,
MIXIN_METHODS, ...)`` gives the real methods to put on it."""


def extract_methods(
    root: Path, rel: str, class_name: str, names: tuple[str, ...], namespace: dict[str, Any]
) -> dict[str, Callable[..., Any]]:
    """The class's methods ``names`` as plain functions, compiled from the file's own text
    (decorators dropped but ``staticmethod``: ``torch.inference_mode`` and the like) into
    ``namespace``, their globals, with the file's module-level functions they call by name."""
    tree = parse(root, rel)
    cls = classes(tree).get(class_name)
    assert cls is not None, f"{rel} defines no {class_name}"
    found = methods(cls)
    missing = [n for n in names if n not in found]
    assert not missing, f"{rel}:{class_name} has no {missing}"
    picked = [found[n] for n in names]
    called = {c.func.id for fn in picked for c in _calls(fn) if isinstance(c.func, ast.Name)}
    helpers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in called]
    for fn in picked:  # staticmethod stays what it is
        fn.decorator_list = [d for d in fn.decorator_list if _is_static_decorator(d)]
    module = ast.Module(body=[*helpers, *picked], type_ignores=[])
    namespace.setdefault("__name__", f"{PACKAGE}-extract")
    exec(compile(module, str(root / rel), "exec"), namespace)
    return {n: namespace.pop(n) for n in names}


__all__ = [
    "MIXIN",
    "MIXIN_METHODS",
    "MIXIN_SOURCE",
    "ENV_SOURCE",
    "FILES",
    "check_connector_output",
    "check_decode_inputs",
    "check_defragmenter_class",
    "check_defragmenter_uses",
    "check_modules",
    "check_offload_patches",
    "check_run_defragmenter",
    "check_source",
    "extract_methods",
    "source_root",
]
