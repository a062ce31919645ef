"""Files a reader can hold in mind, functions that fit on a screen.

Every non-test source file stays under 600 lines and every function under 80 (issue 30): past
that a file usually has two reasons to change and a function two steps that want names. The
shipped sources count: the Rust crates' `src/` (without their `#[cfg(test)]` modules) and the
Python packages under `python/`. Tests, benches and examples are free to be long.

Nothing is imported or compiled: Python is read with `ast`, Rust with a scan that matches the
braces of each `fn` body, skipping comments, strings and character literals.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80

# Functions allowed past the limit for now, as "path::name". Keep it empty; an entry says who
# owes the split and why it waits.
ALLOWED_LONG_FUNCTIONS: set[str] = set()


def _rust_sources() -> list[Path]:
    """The crates' `src/` files, less those that are whole test modules (`#[cfg(test)] mod x;`)."""
    files = sorted((ROOT / "rust").glob("*/src/**/*.rs"))
    test_files = {test for path in files for test in _test_module_files(path)}
    return [path for path in files if path not in test_files]


def _test_module_files(path: Path) -> Iterator[Path]:
    pattern = r'#\[cfg\(test\)\]\s*(?:#\[path\s*=\s*"([^"]+)"\]\s*)?mod\s+(\w+)\s*;'
    # A module's files sit beside mod.rs / lib.rs, or in a folder named after any other file.
    home = path.parent if path.stem in ("mod", "lib", "main") else path.parent / path.stem
    for m in re.finditer(pattern, path.read_text()):
        if m.group(1):
            yield path.parent / m.group(1)
        else:
            yield from (home / f"{m.group(2)}.rs", home / m.group(2) / "mod.rs")


def _python_sources() -> list[Path]:
    return sorted((ROOT / "python").rglob("*.py"))


def _mask_rust(text: str) -> str:
    """The text with comments, strings and char literals blanked (newlines kept), so that every
    brace left is code."""
    out = list(text)
    i, n = 0, len(text)

    def blank(start: int, end: int) -> None:
        for k in range(start, min(end, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            blank(i, j)
            i = j
        elif (raw := re.match(r'b?r(#*)"', text[i:i + 260])) and (i == 0 or not _ident(text[i - 1])):
            closing = '"' + raw.group(1)
            end = text.find(closing, i + raw.end())
            end = n if end < 0 else end + len(closing)
            blank(i, end)
            i = end
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{..}', '{') or a lifetime ('a): only the former closes.
            lit = re.match(r"'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'", text[i:i + 12])
            if lit:
                blank(i, i + lit.end())
                i += lit.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


def _ident(c: str) -> bool:
    return c.isalnum() or c == "_"


def _test_module_spans(code: str) -> list[tuple[int, int]]:
    """Offsets of the bodies of `#[cfg(test)] mod name { ... }`."""
    spans = []
    for m in re.finditer(r"#\[cfg\(test\)\]\s*(pub(\([^)]*\))?\s+)?mod\s+\w+\s*\{", code):
        spans.append((m.end() - 1, _matching_brace(code, m.end() - 1)))
    return spans


def _matching_brace(code: str, open_at: int) -> int:
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "{":
            depth += 1
        elif code[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    raise ValueError(f"unbalanced brace at offset {open_at}")


def _rust_functions(text: str) -> Iterator[tuple[str, int, int]]:
    """(name, first line, line count) of every `fn` with a body outside the test modules."""
    code = _mask_rust(text)
    tests = _test_module_spans(code)
    for m in re.finditer(r"\bfn\s+(\w+)", code):
        if any(start < m.start() < end for start, end in tests):
            continue
        # The body opens at the first `{` outside the signature's brackets; a `;` first means a
        # declaration (a trait method without a default body).
        depth, k = 0, m.end()
        while k < len(code):
            ch = code[k]
            if ch in "([":
                depth += 1
            elif ch in ")]":
                depth -= 1
            elif depth == 0 and ch in "{;":
                break
            k += 1
        if k >= len(code) or code[k] == ";":
            continue
        first = code.count("\n", 0, m.start()) + 1
        last = code.count("\n", 0, _matching_brace(code, k)) + 1
        yield m.group(1), first, last - first + 1


def _python_functions(text: str) -> Iterator[tuple[str, int, int]]:
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert node.end_lineno is not None
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def _non_test_lines(text: str, rust: bool) -> int:
    lines = text.count("\n") + (0 if text.endswith("\n") else 1)
    if rust:
        code = _mask_rust(text)
        for start, end in _test_module_spans(code):
            lines -= code.count("\n", start, end)
    return lines


def long_functions() -> list[str]:
    found = []
    for paths, scan in ((_rust_sources(), _rust_functions), (_python_sources(), _python_functions)):
        for path in paths:
            rel = path.relative_to(ROOT).as_posix()
            for name, line, count in scan(path.read_text()):
                if count > MAX_FUNCTION_LINES:
                    found.append(f"{rel}::{name} ({count} lines, line {line})")
    return found


def test_no_function_over_80_lines() -> None:
    found = [f for f in long_functions() if f.split(" ")[0] not in ALLOWED_LONG_FUNCTIONS]
    assert not found, "split these into named steps:\n" + "\n".join(found)


def test_allow_list_names_only_long_functions() -> None:
    """An entry whose function has been split (or renamed) goes, so the list only shrinks."""
    long = {f.split(" ")[0] for f in long_functions()}
    assert ALLOWED_LONG_FUNCTIONS <= long, ALLOWED_LONG_FUNCTIONS - long


def test_no_source_file_over_600_lines() -> None:
    found = []
    for path in _rust_sources() + _python_sources():
        if (count := _non_test_lines(path.read_text(), path.suffix == ".rs")) > MAX_FILE_LINES:
            found.append(f"{path.relative_to(ROOT).as_posix()} ({count} lines)")
    assert not found, "find the seam in these:\n" + "\n".join(found)


def test_the_rust_scan_measures_bodies() -> None:
    """The scan itself: braces in strings, chars, comments and lifetimes do not count."""
    sample = (
        "fn a<'x>(s: &'x str) -> usize {\n"
        '    let _ = "}}"; let _ = r#"{"#; let _ = \'{\'; // }\n'
        "    /* { */ s.len()\n"
        "}\n"
        "trait T { fn decl(&self); }\n"
        "#[cfg(test)]\nmod tests {\n    fn hidden() {}\n}\n"
    )
    assert list(_rust_functions(sample)) == [("a", 1, 4)]
    assert _non_test_lines(sample, rust=True) == 9 - 2
