"""What a program's graph may hold before torch's deserializer sees it.

torch's deserializer trusts the file: a call target such as ``torch.os.system`` is looked
up and later called, symbolic expressions go through ``sympy.sympify`` (which evaluates
Python), guards are ``exec``'d by ``ExportedProgram.module()``, and stack traces become
comments in generated code. :func:`checked_graph` refuses what could run code, naming the
node, and strips what bnrecal does not need, so the deserializer only ever sees:

- call targets that are ``aten``/``prims`` operators, Python arithmetic on sizes
  (``_operator``, ``math``, torch's ``sym_*`` helpers);
- symbolic expressions made of sympy constructors, symbol names and literals;
- node metadata reduced to the module path (``nn_module_stack``), which names layers;
- no custom objects, no subgraphs (higher-order ops), no guard code.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import torch

from bnrecal.errors import ProgramError

OPERATOR_NAMESPACES = ("aten", "prims")

PYTHON_TARGETS = frozenset(
    {f"_operator.{name}" for name in (
        "getitem", "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "pos", "abs", "eq", "ne",
        "lt", "le", "gt", "ge", "and_", "or_", "xor", "not_", "invert", "lshift", "rshift",
    )}
    | {f"math.{name}" for name in ("ceil", "floor", "trunc", "sqrt")}
    | {f"torch.{name}" for name in (
        "sym_int", "sym_float", "sym_max", "sym_min", "sym_not", "sym_ite", "sym_sqrt", "_sym_sqrt", "sym_sum",
        "sym_fresh_size",
    )}
)
"""Call targets other than operators that a program may name: arithmetic on sizes."""

_SYMPY_NAMES = frozenset({
    "Symbol", "Integer", "Rational", "Float", "Add", "Mul", "Max", "Min", "Abs", "floor", "ceiling", "Mod",
    "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "Equality", "Unequality", "StrictLessThan", "LessThan",
    "StrictGreaterThan", "GreaterThan", "And", "Or", "Not", "true", "false", "True", "False", "oo", "zoo",
    "nan", "Infinity", "NegativeInfinity", "Half", "One", "Zero", "NegativeOne", "BooleanTrue", "BooleanFalse",
    # torch.utils._sympy.functions, as the deserializer names them (no powers: they can explode)
    "FloorDiv", "ModularIndexing", "Where", "PythonMod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv",
    "LShift", "RShift", "FloatTrueDiv", "IntTrueDiv", "IsNonOverlappingAndDenseIndicator", "TruncToFloat",
    "TruncToInt", "RoundToInt", "RoundDecimal", "ToFloat", "Identity",
})
_SYMPY_KEYWORDS = frozenset({
    "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "infinite", "zero",
    "nonzero", "even", "odd", "precision", "evaluate",
})
_TOKEN = re.compile(
    r"\s+|(?P<number>\d{1,40}(?:\.\d{1,40})?(?:[eE][-+]?\d{1,3})?)|(?P<string>'[A-Za-z_][A-Za-z0-9_]{0,63}')"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})(?P<keyword>\s*=(?!=))?|(?P<op>==|!=|<=|>=|//|[-+*/%()<>,])"
)
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
MAX_EXPRESSION = 4096
_MODULE_STACK = re.compile(r"[\x20-\x7e]{0,20000}")


def checked_graph(document: Any, label: str) -> dict[str, Any]:
    """A copy of a program's graph document (``models/<name>.json``) that is safe to
    deserialize, or ``ProgramError`` naming the first thing that is not."""
    if not isinstance(document, dict) or not isinstance(document.get("graph_module"), dict):
        raise ProgramError(f"program {label}: its graph document is malformed")
    document = copy.deepcopy(document)
    document["guards_code"] = []  # exec'd by ExportedProgram.module(); bnrecal checks inputs itself
    module = document["graph_module"]
    module["metadata"] = {}
    graph = module.get("graph")
    if not isinstance(graph, dict) or not isinstance(graph.get("nodes"), list):
        raise ProgramError(f"program {label}: its graph is malformed")
    if graph.get("custom_obj_values"):
        raise ProgramError(f"program {label} holds custom objects (torchbind), which only load by running code")
    for node in graph["nodes"]:
        _check_node(node, label)
    _check_signature(module.get("signature"), label)
    for key in (document.get("range_constraints") or {}):
        if not isinstance(key, str) or not _SYMBOL.fullmatch(key):
            raise ProgramError(f"program {label}: range constraint {str(key)[:80]!r} is not a symbol name")
    for expression in _expressions(document):
        check_expression(expression, label)
    return document


def _check_node(node: Any, label: str) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("target"), str):
        raise ProgramError(f"program {label}: a node of its graph is malformed")
    name = str(node.get("name", "?"))[:80]
    check_target(node["target"], name, label)
    metadata = node.get("metadata") or {}
    stack = metadata.get("nn_module_stack") if isinstance(metadata, dict) else None
    node["metadata"] = {"nn_module_stack": stack} if isinstance(stack, str) and _MODULE_STACK.fullmatch(stack) else {}
    for argument in _arguments(node.get("inputs")):
        kind = next(iter(argument), None) if isinstance(argument, dict) else None
        if kind in ("as_graph", "as_custom_obj"):
            raise ProgramError(
                f"program {label}: node {name!r} takes a {kind[3:].replace('_', ' ')} argument (a higher-order op or "
                "custom object), which bnrecal does not run"
            )
        if kind == "as_operator":
            check_target(str(argument[kind]), name, label)


def check_target(target: str, node: str, label: str) -> None:
    """Refuse a call target that is not a known operator or size arithmetic, naming the node."""
    if target in PYTHON_TARGETS:
        return
    parts = target.split(".")
    if len(parts) == 5 and parts[:2] == ["torch", "ops"] and parts[2] in OPERATOR_NAMESPACES:
        packet = getattr(getattr(torch.ops, parts[2]), parts[3], None) if _SYMBOL.fullmatch(parts[3]) else None
        if packet is not None and parts[4] in packet.overloads():
            return
        raise ProgramError(f"program {label}: node {node!r} calls {target[:200]!r}, an operator this torch does not have")
    if len(parts) >= 3 and parts[:2] == ["torch", "ops"]:
        raise ProgramError(
            f"program {label}: node {node!r} calls {target[:200]!r} from the operator namespace {parts[2]!r}; "
            f"bnrecal runs only torch's own operators ({', '.join(OPERATOR_NAMESPACES)}), never a library's custom ops"
        )
    raise ProgramError(
        f"program {label}: node {node!r} calls {target[:200]!r}, an arbitrary Python callable; bnrecal runs only "
        "torch operators, never code named by an uploaded file"
    )


def check_expression(expression: Any, label: str) -> None:
    """Refuse a symbolic-shape expression that is anything but sympy constructors applied
    to symbol names and literals (the deserializer hands it to ``sympy.sympify``)."""
    if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION:
        raise ProgramError(f"program {label}: a symbolic shape expression is malformed or too long")
    position = 0
    while position < len(expression):
        match = _TOKEN.match(expression, position)
        if match is None or match.end() == position:
            raise ProgramError(f"program {label}: symbolic shape expression {expression[:120]!r} is not a plain formula")
        name = match.group("name")
        if name is not None:
            allowed = _SYMPY_KEYWORDS if match.group("keyword") else _SYMPY_NAMES
            if name not in allowed and not (not match.group("keyword") and re.fullmatch(r"[a-z]{1,8}\d{1,9}", name)):
                raise ProgramError(
                    f"program {label}: symbolic shape expression {expression[:120]!r} names {name!r}, "
                    "which is not part of a shape formula"
                )
        position = match.end()


def _check_signature(signature: Any, label: str) -> None:
    if not isinstance(signature, dict):
        raise ProgramError(f"program {label}: its signature is malformed")
    for spec in signature.get("input_specs") or []:
        kind = next(iter(spec), None) if isinstance(spec, dict) else None
        if kind in ("custom_obj", "token"):
            raise ProgramError(
                f"program {label} takes a {kind.replace('_', ' ')} input (custom objects or side effects), "
                "which bnrecal does not run"
            )


def _arguments(inputs: Any) -> Iterator[Any]:
    """Every argument value of a node's inputs, nested lists included."""
    for entry in inputs or []:
        argument = entry.get("arg") if isinstance(entry, dict) else None
        if isinstance(argument, dict):
            yield argument
            for value in argument.values():
                if isinstance(value, list):
                    yield from (item for item in value if isinstance(item, dict))


def _expressions(value: Any) -> Iterator[Any]:
    """Every ``expr_str`` anywhere in the document."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                if key == "expr_str":
                    yield child
                elif isinstance(child, (dict, list)):
                    stack.append(child)
        elif isinstance(item, list):
            stack.extend(child for child in item if isinstance(child, (dict, list)))
