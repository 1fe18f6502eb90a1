"""The collectives one step runs, read from its lowered StableHLO text.

`collectives_of(text)` walks the module from `main`: every `all_reduce`, `all_gather`,
`reduce_scatter`, `all_to_all` and `collective_permute`, times the trip counts of the `while` loops
around it (a layer scan runs its body once per repeated layer) and the calls that reach it. A
collective's bytes are its payload on one device: the all-reduced, reduce-scattered or all-to-all
buffer (the operand), or the gathered result of an all-gather. Text parsing only: no device work.
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "collective_permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "i32": 4, "i64": 8, "i8": 1, "ui8": 1, "i1": 1,
                "ui32": 4, "f8E4M3FN": 1, "f8E5M2": 1}
_FUNC = re.compile(r"^\s*func\.func (?:public |private )?@([\w$.-]+)\(")
_OP = re.compile(r'"?stablehlo\.(' + "|".join(KINDS) + r')"?')
_CALL = re.compile(r"(?:func\.)?call @([\w$.-]+)\(")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_SIGNATURE = re.compile(r":\s*\((.*)\)\s*->\s*(.*)$")


@dataclass(frozen=True)
class CollectiveStats:
    """Per step: how many times each kind runs and the bytes it moves per device."""

    counts: dict[str, int]
    bytes: dict[str, int]

    @property
    def total_bytes(self) -> int:
        return sum(self.bytes.values())


def tensor_bytes(spec: str) -> int:
    """Bytes of `AxBxf32` (the inside of `tensor<...>`)."""
    *dims, dtype = spec.split("x")
    size = _DTYPE_BYTES.get(dtype)
    if size is None:
        raise ValueError(f"unknown element type {dtype!r} in tensor<{spec}>")
    count = 1
    for dim in dims:
        count *= int(dim)
    return count * size


def _split_functions(text: str) -> dict[str, list[str]]:
    functions, name = {}, None
    for line in text.splitlines():
        match = _FUNC.match(line)
        if match:
            name = match.group(1)
            functions[name] = []
        elif name is not None:
            functions[name].append(line)
    return functions


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _payload(kind: str, signature: str) -> int:
    match = _SIGNATURE.search(signature)
    if match is None:
        raise ValueError(f"no type signature for {kind}: {signature[:120]}")
    operands, result = match.groups()
    if kind == "all_gather":
        return sum(tensor_bytes(t) for t in _TENSOR.findall(result))
    return sum(tensor_bytes(t) for t in _TENSOR.findall(operands))


def _function_collectives(name: str, functions: dict, memo: dict) -> tuple[Counter, Counter]:
    if name in memo:
        return memo[name]
    counts, sizes = Counter(), Counter()
    lines = functions.get(name, [])
    stack: list[tuple[int, int | None]] = []  # (indent of the while, trip count; None: not a constant)
    multiplier = 1
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if "stablehlo.while(" in line:
            indent, trips = _indent(line), _trip_count(lines, i)
            stack.append((indent, trips))
            multiplier *= trips or 1
        elif stack and stripped.startswith("}") and "do {" not in stripped and _indent(line) == stack[-1][0]:
            multiplier //= stack.pop()[1] or 1
        dynamic = any(trips is None for _, trips in stack)
        op = _OP.search(line)
        if op and "=" in line.split(op.group(0))[0]:
            kind = op.group(1)
            if dynamic:
                raise ValueError(f"{kind} inside a while loop whose trip count is not a constant ({name})")
            j = i
            while _SIGNATURE.search(lines[j]) is None or (j == i and "({" in line):
                j += 1
            counts[kind] += multiplier
            sizes[kind] += multiplier * _payload(kind, lines[j])
        for callee in _CALL.findall(line):
            sub_counts, sub_sizes = _function_collectives(callee, functions, memo)
            if dynamic and sub_counts:
                raise ValueError(f"collectives of {callee} inside a while loop whose trip count is not a constant")
            for kind in sub_counts:
                counts[kind] += multiplier * sub_counts[kind]
                sizes[kind] += multiplier * sub_sizes[kind]
        i += 1
    memo[name] = (counts, sizes)
    return counts, sizes


def _trip_count(lines: list[str], start: int) -> int | None:
    """The constant bound of a `while`'s `cond` region (`i < N` from 0, as scan and fori_loop lower);
    None when the bound is not a constant."""
    constants = {}
    for line in lines[start + 1:start + 12]:
        match = re.search(r"(%[\w#]+) = stablehlo\.constant dense<(-?\d+)> : tensor<i32>", line)
        if match:
            constants[match.group(1)] = int(match.group(2))
        compare = re.search(r"stablehlo\.compare\s+LT, (%[\w#]+), (%[\w#]+)", line)
        if compare and compare.group(2) in constants:
            return constants[compare.group(2)]
        if "} do {" in line:
            break
    return None


def collectives_of(text: str, entry: str = "main") -> CollectiveStats:
    """Collectives per execution of the lowered module's `entry` function."""
    functions = _split_functions(text)
    counts, sizes = _function_collectives(entry, functions, {})
    return CollectiveStats({k: counts[k] for k in KINDS if counts[k]}, {k: sizes[k] for k in KINDS if counts[k]})
