"""The code's shape, checked: the trainer reads as its loop (trainer.py short, no long function in train/)."""
import ast
from pathlib import Path

import vitlab

SRC = Path(vitlab.__file__).parent
TRAIN_FUNCTION_LINES = 60   # no function in train/ longer than this, docstring and decorators included
TRAINER_LINES = 300         # train/trainer.py: the loop, on a screen or two


def long_functions(source: str, limit: int) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if node.end_lineno - first + 1 > limit:
                found.append((node.name, node.end_lineno - first + 1))
    return found


def test_long_functions_finds_a_function_one_line_over_the_limit():
    body = "".join(f"    x{i} = {i}\n" for i in range(4))
    assert long_functions(f"def f():\n{body}", 5) == []  # 5 lines: at the limit
    assert long_functions(f"def f():\n{body}    return x0\n", 5) == [("f", 6)]
    assert long_functions(f"class A:\n    @staticmethod\n    def g():\n{body.replace('    ', '        ')}", 5) \
        == [("g", 6)]  # a method, its decorator counted


def test_no_function_in_train_is_longer_than_the_limit():
    over = {f"{path.relative_to(SRC)}:{name}": n for path in sorted((SRC / "train").rglob("*.py"))
            for name, n in long_functions(path.read_text(), TRAIN_FUNCTION_LINES)}
    assert over == {}, f"functions over {TRAIN_FUNCTION_LINES} lines in train/ (split them): {over}"


def test_the_trainer_fits_a_screen_or_two():
    lines = len((SRC / "train" / "trainer.py").read_text().splitlines())
    assert lines <= TRAINER_LINES, f"train/trainer.py has {lines} lines (at most {TRAINER_LINES}): the loop only"
