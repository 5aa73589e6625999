"""Writes the code task's bundled sample (src/echo2/data/tasks/samples/code_sample.jsonl): short one-line
Python functions described in words, each with three assert tests and a reference solution, small enough
for the embedded character-level model (prompt + completion within its 128 positions). Deterministic.

    python scripts/make-code-sample.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src/echo2/data/tasks/samples/code_sample.jsonl"
NAMES = ("f", "g", "h")


def problems() -> list[dict[str, str | list[str]]]:
    rng = random.Random(0)
    out: list[dict[str, str | list[str]]] = []

    def add(name: str, words: str, body: str, args: str, calls: list[tuple[str, object]]) -> None:
        out.append({
            "prompt": f"Write {name}({args}) returning {words}.",
            "tests": [f"assert {name}({call}) == {want!r}" for call, want in calls],
            "entry_point": name,
            "solution": f"def {name}({args}): return {body}",
        })  # fmt: skip

    for k in range(1, 31):
        for op, word, fn in (("+", "plus", lambda x, k: x + k), ("-", "minus", lambda x, k: x - k),
                             ("*", "times", lambda x, k: x * k)):  # fmt: skip
            name = rng.choice(NAMES)
            xs = rng.sample(range(-20, 50), 3)
            add(name, f"x {word} {k}", f"x{op}{k}", "x", [(str(x), fn(x, k)) for x in xs])
    for a in range(2, 10):
        for b in range(1, 10):
            name = rng.choice(NAMES)
            xs = rng.sample(range(-9, 20), 3)
            add(name, f"x times {a} plus {b}", f"x*{a}+{b}", "x", [(str(x), x * a + b) for x in xs])
    for k in range(1, 10):
        name = rng.choice(NAMES)
        words = ["ab", "xyz", "q", "hello"]
        add(name, f"s repeated {k} times", f"s*{k}", "s", [(repr(w), w * k) for w in rng.sample(words, 3)])
    pairs_of = (("the larger of a and b", "max(a,b)", max), ("the smaller of a and b", "min(a,b)", min),
                ("a plus b", "a+b", lambda a, b: a + b), ("a minus b", "a-b", lambda a, b: a - b),
                ("a times b", "a*b", lambda a, b: a * b))  # fmt: skip
    for word, body, fn in pairs_of:
        for name in NAMES:
            pairs = [(rng.randint(-20, 40), rng.randint(-20, 40)) for _ in range(3)]
            add(name, word, body, "a, b", [(f"{a}, {b}", fn(a, b)) for a, b in pairs])
    return out


def main() -> None:
    rows = problems()
    OUT.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{OUT}: {len(rows)} problems")


if __name__ == "__main__":
    main()
