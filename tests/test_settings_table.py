"""docs/settings.md answers for every TransformerConfig field of the installed megatron-core.

The tables' first column names fields (backticked); one column per tested stack says what
SiameseNorm does with them there, or ``absent``. A field the installed release has and no row
names fails, and so does a row that says a field is present on this stack when it is not (or
absent when it is). The tests read dataclass fields only: they build no Megatron model, but
they import megatron, so they run on every stack.
"""

import dataclasses
import re
from pathlib import Path

import pytest

from megatron_siamese.versions import installed_megatron_core, release

TABLE = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
STACKS = ("0.16.1", "0.19.2")  # the stack columns, as their headers name them
CLASSES = ("honoured", "refused", "no effect", "absent", "not honoured, not refused (open: see issue 29)")
FIELD = re.compile(r"`([A-Za-z_][A-Za-z0-9_]*)`")


def cells(line: str) -> list:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def table_rows(text: str) -> list:
    """(line number, fields, {stack: its cell}) for each row of the tables that have the stack columns."""
    rows, columns = [], None
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.startswith("|"):
            columns = None
            continue
        if re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", line.strip()):
            continue
        following = lines[number] if number < len(lines) else ""
        if re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+", following.strip()):  # a header row
            header = cells(line)
            columns = {stack: header.index(stack) for stack in STACKS if stack in header}
            columns = columns if len(columns) == len(STACKS) else None
            continue
        if columns is None:
            continue
        row = cells(line)
        rows.append((number, FIELD.findall(row[0]), {stack: row[index] for stack, index in columns.items()}))
    return rows


def installed_fields() -> set:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {field.name for field in dataclasses.fields(TransformerConfig)}


def this_stack() -> str:
    """The stack column of the installed megatron-core: the same release, else the same minor."""
    installed = release(installed_megatron_core())
    for stack in STACKS:
        if release(stack) == installed:
            return stack
    for stack in STACKS:
        if release(stack)[:2] == installed[:2]:
            return stack
    pytest.skip(f"docs/settings.md has no column for megatron-core {installed_megatron_core()} (columns: {STACKS})")


@pytest.fixture(scope="module")
def rows():
    found = table_rows(TABLE.read_text())
    assert found, f"no settings table (with columns {STACKS}) in {TABLE}"
    return found


def test_every_field_of_the_installed_config_has_a_row(rows):
    listed = {field for _, fields, _ in rows for field in fields}
    missing = sorted(installed_fields() - listed)
    assert not missing, (f"megatron-core {installed_megatron_core()}'s TransformerConfig fields with no row in "
                         f"docs/settings.md: {', '.join(missing)}")


def test_rows_name_each_field_once_and_say_a_class_per_stack(rows):
    seen, problems = {}, []
    for number, fields, by_stack in rows:
        if not fields:
            problems.append(f"line {number}: no backticked field in the first column")
        for field in fields:
            if field in seen:
                problems.append(f"line {number}: `{field}` already has a row (line {seen[field]})")
            seen.setdefault(field, number)
        for stack, cell in by_stack.items():
            if not cell.startswith(CLASSES):
                problems.append(f"line {number}: the {stack} cell {cell!r} starts with none of {CLASSES}")
        if all(cell.startswith("absent") for cell in by_stack.values()):
            problems.append(f"line {number}: absent on every stack: {', '.join(fields)}")
    assert not problems, "docs/settings.md:\n" + "\n".join(problems)


def test_what_the_table_says_is_present_on_this_stack_exists(rows):
    stack, fields_here = this_stack(), installed_fields()
    stale = []
    for number, fields, by_stack in rows:
        absent = by_stack[stack].startswith("absent")
        for field in fields:
            if absent and field in fields_here:
                stale.append(f"line {number}: `{field}` is marked absent on {stack} but exists there")
            if not absent and field not in fields_here:
                stale.append(f"line {number}: `{field}` is not a TransformerConfig field of megatron-core "
                             f"{installed_megatron_core()} (mark it absent in the {stack} column, or drop it)")
    assert not stale, "docs/settings.md is stale:\n" + "\n".join(stale)


def test_the_packages_reviewed_fields_are_the_tables(rows):
    """support.py refuses a field outside reviewed_settings.REVIEWED when it is set (a newer
    release's): that set is the table's fields, no more, no fewer."""
    from megatron_siamese.reviewed_settings import REVIEWED

    listed = {field for _, fields, _ in rows for field in fields}
    assert not listed - REVIEWED, f"in docs/settings.md, not in REVIEWED: {sorted(listed - REVIEWED)}"
    assert not REVIEWED - listed, f"in REVIEWED, not in docs/settings.md: {sorted(REVIEWED - listed)}"
