import collections
import itertools
import json
import random
import subprocess
import sys

import pytest

from echo2.config import ArithmeticTaskConfig, MathTaskConfig
from echo2.data.tasks.arithmetic import ArithmeticTask, _evaluate, canonical_key, parse_problem, signed_terms
from echo2.data.tasks.math import MathTask, normalise_question
from echo2.errors import DataError
from echo2.tasks.registry import TASKS, build_task
from echo2.types import Prompt


def test_arithmetic_precedence_by_hand():
    assert _evaluate([2, 3, 4], ["+", "*"]) == 14  # 2 + 3*4
    assert _evaluate([10, 3, 2], ["-", "-"]) == 5
    assert _evaluate([2, 3, 4], ["*", "-"]) == 2


# --- canonical problems ------------------------------------------------------------------------------


def test_canonical_key_by_hand():
    # commuting a sum: one problem
    assert canonical_key("37+45") == canonical_key("45+37") == "37+45"
    # reordering signed terms: a+b-c and b-c+a are {+a, +b, -c}
    assert canonical_key("5+7-3") == canonical_key("7-3+5") == "5+7-3"
    # commuting a product and the sum around it: a*b+c and c+b*a are {+(a,b), +(c,)}
    assert canonical_key("4*9+2") == canonical_key("2+9*4") == "2+4*9"
    # + terms first, then - terms, each group by factor tuple; factors ascending
    assert canonical_key("9-3*2+1") == "1+9-2*3"
    assert canonical_key("3*2*1") == "1*2*3"
    # the sign belongs to the term: a-b and b-a are different problems
    assert canonical_key("8-3") == "8-3" != canonical_key("3-8") == "3-8"
    # equal values are not enough: different terms, different problems
    assert canonical_key("2*3") != canonical_key("1*6")
    assert _evaluate([2, 3], ["*"]) == _evaluate([1, 6], ["*"])
    assert canonical_key("1+2+3") != canonical_key("3+3")
    # a minus binds only the term after it: 7-2*3 = {+(7,), -(2,3)}
    assert signed_terms(*parse_problem("7-3*2")) == [("+", (7,)), ("-", (2, 3))]
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        canonical_key("-3+4")
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        canonical_key("3+")


def _text(operands, ops):
    return str(operands[0]) + "".join(op + str(v) for op, v in zip(ops, operands[1:], strict=True))


def _variants(text: str) -> set[str]:
    """Every way to write ``text``'s problem by commuting factors and terms, first term positive."""
    terms = signed_terms(*parse_problem(text))
    out = set()
    for order in itertools.permutations(terms):
        if order[0][0] != "+":
            continue
        for factor_orders in itertools.product(*(itertools.permutations(f) for _, f in order)):
            out.add(
                "".join(
                    ("" if i == 0 else sign) + "*".join(map(str, factors))
                    for i, ((sign, _), factors) in enumerate(zip(order, factor_orders, strict=True))
                )
            )
    return out


def test_canonical_key_property_over_random_problems():
    rng = random.Random(0)
    keys_by_value: dict[str, int] = {}
    for _ in range(400):
        k = rng.randint(2, 4)
        operands = [rng.randint(0, 30) for _ in range(k)]
        ops = [rng.choice("+-*") for _ in range(k - 1)]
        text = _text(operands, ops)
        key = canonical_key(text)
        value = _evaluate(operands, ops)
        variants = _variants(text)
        assert text in variants and key in variants  # the key is itself a way to write the problem
        for variant in variants:
            assert canonical_key(variant) == key
            assert _evaluate(*parse_problem(variant)) == value  # variants are the same problem
        assert canonical_key(key) == key  # idempotent
        # a key determines the value; problems of different values never share a key
        assert keys_by_value.setdefault(key, value) == value


# --- arithmetic splits ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cfg",
    [ArithmeticTaskConfig(), ArithmeticTaskConfig(max_value=20, num_operands=3, operators="+-*")],
    ids=["default", "three-operands"],
)
def test_arithmetic_three_splits_are_disjoint_by_canonical_problem(cfg):
    task = ArithmeticTask(cfg, seed=0)
    test = task.eval_prompts(300)
    val = task.validation_prompts(300)
    train = task.sample_train(random.Random(1), 5000)
    assert len(test) == len(val) == 300
    assert len({p.prompt_id for p in test}) == len({p.prompt_id for p in val}) == 300
    keys = {name: {canonical_key(p.prompt_id) for p in ps} for name, ps in [("train", train), ("val", val)]}
    keys["test"] = {canonical_key(p.prompt_id) for p in test}
    assert not keys["train"] & keys["val"]
    assert not keys["train"] & keys["test"]
    assert not keys["val"] & keys["test"]
    # the split is a function of the canonical problem: every variant of a held-out problem is held out
    for p in val[:50] + test[:50]:
        for variant in _variants(p.prompt_id):
            assert task.split(variant) == task.split(p.prompt_id) != "train"
    # prompts answer their own text
    for p in train[:50] + val[:50] + test[:50]:
        operands, ops = parse_problem(p.prompt_id)
        assert p.text == p.prompt_id + "=" and int(p.answer) == _evaluate(operands, ops)


def test_arithmetic_split_bands_follow_the_fractions():
    task = ArithmeticTask(ArithmeticTaskConfig(max_value=999, eval_fraction=0.2, validation_fraction=0.3))
    rng = random.Random(0)
    counts = {"train": 0, "validation": 0, "test": 0}
    for _ in range(20000):
        counts[task.split(f"{rng.randint(0, 999)}+{rng.randint(0, 999)}")] += 1
    assert counts["test"] / 20000 == pytest.approx(0.2, abs=0.02)
    assert counts["validation"] / 20000 == pytest.approx(0.3, abs=0.02)


def test_sample_train_never_yields_a_held_out_problem():
    task = ArithmeticTask(ArithmeticTaskConfig(max_value=9, operators="+-*", num_operands=3), seed=0)
    held = {canonical_key(p.prompt_id) for p in task.eval_prompts(500) + task.validation_prompts(500)}
    assert held  # a small space, so the sample below covers most of it
    for p in task.sample_train(random.Random(2), 5000):
        assert task.split(p.prompt_id) == "train"
        assert canonical_key(p.prompt_id) not in held


def test_arithmetic_held_out_lists_are_fixed_and_seeded():
    task = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    val = task.validation_prompts(200)
    assert task.validation_prompts(200) == val
    assert task.validation_prompts(50) == val[:50]
    # deterministic across instances, and a prefix of any longer request whatever the call history
    fresh = ArithmeticTask(ArithmeticTaskConfig(), seed=0)
    assert fresh.validation_prompts(20) == val[:20]
    assert fresh.validation_prompts(200) == val
    assert ArithmeticTask(ArithmeticTaskConfig(), seed=0).eval_prompts(200) == task.eval_prompts(200)
    # the seed picks the order of the lists, never which problems are held out
    other = ArithmeticTask(ArithmeticTaskConfig(), seed=1)
    assert other.validation_prompts(200) != val
    assert all(task.split(p.prompt_id) == "validation" for p in other.validation_prompts(200))
    assert task.sample_train(random.Random(1), 5) == task.sample_train(random.Random(1), 5)


def test_arithmetic_fractions_must_leave_a_train_split():
    with pytest.raises(ValueError, match=r"eval_fraction \+ validation_fraction = 1 must be < 1"):
        ArithmeticTaskConfig(eval_fraction=0.5, validation_fraction=0.5)


def test_arithmetic_grading():
    task = build_task(ArithmeticTaskConfig())
    p = Prompt("12+30", "12+30=", "42")
    assert task.grade(p, "42").reward == 1.0
    assert task.grade(p, " 42 ").parsed
    wrong = task.grade(p, "41")
    assert wrong.reward == 0.0 and wrong.parsed
    junk = task.grade(p, "4x2")
    assert junk.reward == 0.0 and not junk.parsed
    assert not task.grade(p, "").parsed


# --- math -------------------------------------------------------------------------------------------


def test_math_sample_file_and_math_verify_grading():
    task = MathTask(MathTaskConfig())
    assert task.eval_prompts(100) and task.validation_prompts(100) and task.sample_train(random.Random(0), 3)
    p = Prompt("q", "What is one half?\nAnswer: ", "\\frac{1}{2}")
    assert task.grade(p, "0.5").reward == 1.0
    assert task.grade(p, "1/2").reward == 1.0
    assert task.grade(p, "3").reward == 0.0
    unparsed = task.grade(p, "no idea")
    assert unparsed.reward == 0.0 and not unparsed.parsed


def test_normalise_question():
    assert normalise_question("  What is\t7  TIMES 8?\n") == "what is 7 times 8?"
    assert normalise_question("What is 7 times 8?") == normalise_question("what is 7\ntimes 8?")
    assert normalise_question("What is 7 times 8?") != normalise_question("What is 7 times 9?")


def _write(path, records):
    path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in records))


def _question_of(task: MathTask, p: Prompt) -> str:
    prefix, suffix = task.cfg.prompt_template.split("{question}")
    return normalise_question(p.text.removeprefix(prefix).removesuffix(suffix))


def test_math_splits_keep_formatting_duplicates_on_one_side(tmp_path):
    base = [f"What is {i} plus {i + 1}?" for i in range(200)]
    variants = [q.upper() for q in base] + ["  " + q.replace(" ", "\t ") + "\n" for q in base]
    f = tmp_path / "train.jsonl"
    _write(f, [(q, "1") for q in base + variants])
    task = MathTask(MathTaskConfig(train_path=str(f)))
    train = task.sample_train(random.Random(0), 3000)
    splits = {
        "train": {_question_of(task, p) for p in task.train_prompts()},
        "validation": {_question_of(task, p) for p in task.validation_prompts(10_000)},
        "test": {_question_of(task, p) for p in task.eval_prompts(10_000)},
    }
    assert all(splits.values())
    assert not splits["train"] & splits["validation"]
    assert not splits["train"] & splits["test"]
    assert not splits["validation"] & splits["test"]
    assert {_question_of(task, p) for p in train} <= splits["train"]
    # each question's three spellings all went to the side its normalised text hashes to
    for prompts in (task.validation_prompts(10_000), task.eval_prompts(10_000), task.train_prompts()):
        spellings = collections.Counter(_question_of(task, p) for p in prompts)
        assert set(spellings.values()) == {3}
    assert (
        len(task.validation_prompts(10_000)) + len(task.eval_prompts(10_000)) + len(task.train_prompts())
        == 600
    )
    # deterministic
    again = MathTask(MathTaskConfig(train_path=str(f)))
    assert again.validation_prompts(50) == task.validation_prompts(50)
    assert again.eval_prompts(50) == task.eval_prompts(50)


def test_math_explicit_eval_file_is_the_test_split_and_validation_comes_from_train(tmp_path, caplog):
    train = tmp_path / "train.jsonl"
    evalf = tmp_path / "eval.jsonl"
    _write(train, [(f"What is {i} + {i}?", i * 2) for i in range(60)] + [("what is  3 + 3?", "6")])
    _write(evalf, [("What is 3 + 3?", "6"), ("What is 100 + 100?", "200")])
    task = MathTask(MathTaskConfig(train_path=str(train), eval_path=str(evalf)))
    test = {_question_of(task, p) for p in task.eval_prompts(10)}
    val = {_question_of(task, p) for p in task.validation_prompts(100)}
    trained = {_question_of(task, p) for p in task.train_prompts()}
    assert test == {"what is 3 + 3?", "what is 100 + 100?"}
    assert val and trained and not val & trained
    assert not test & (val | trained)  # both spellings of the test question were left out of train
    assert "2 records ask a question of the test file" in caplog.text
    assert len(val) + len(trained) == 59


def test_math_jsonl_errors_name_file_and_line(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text(
        json.dumps({"question": "1+1?", "answer": "2"}) + "\n\n" + json.dumps({"question": "x"}) + "\n"
    )
    # the files are read on the first use of the prompts (the learner's start; a worker never reads them)
    with pytest.raises(DataError, match=r"data.jsonl:3: no field 'answer'"):
        MathTask(MathTaskConfig(train_path=str(f))).eval_prompts(1)
    f.write_text("{not json}\n")
    with pytest.raises(DataError, match=r"data.jsonl:1: not valid JSON"):
        MathTask(MathTaskConfig(train_path=str(f))).eval_prompts(1)
    with pytest.raises(DataError, match="no such file"):
        MathTask(MathTaskConfig(train_path=str(tmp_path / "missing.jsonl"))).eval_prompts(1)


def test_math_too_few_records_for_three_splits(tmp_path):
    train = tmp_path / "train.jsonl"
    evalf = tmp_path / "eval.jsonl"
    _write(train, [("2+2?", 4)])
    _write(evalf, [("3+3?", "6")])
    with pytest.raises(DataError, match=r"train.jsonl: 1 records leave an empty (train|validation) split"):
        MathTask(MathTaskConfig(train_path=str(train), eval_path=str(evalf))).train_prompts()


def test_math_numeric_answers_and_explicit_eval_file(tmp_path):
    train = tmp_path / "train.jsonl"
    evalf = tmp_path / "eval.jsonl"
    _write(train, [(f"{i}+{i}?", 2 * i) for i in range(40)])
    _write(evalf, [("3+3?", "6")])
    task = MathTask(MathTaskConfig(train_path=str(train), eval_path=str(evalf)))
    assert task.eval_prompts(5)[0].answer == "6"
    p = task.sample_train(random.Random(0), 1)[0]
    assert isinstance(p.answer, str) and p.answer == str(2 * int(p.text.split("+")[0]))


# --- the registry -----------------------------------------------------------------------------------


def test_registry_builds_every_task():
    from echo2.config import (
        TASK_PRESETS,
        CodeTaskConfig,
        GuessTaskConfig,
        PokerTaskConfig,
        VerifiersTaskConfig,
    )
    from echo2.data.tasks.code import CodeTask
    from echo2.data.tasks.environment import EnvironmentTask
    from echo2.data.tasks.verifiers_env import VerifiersTask
    from echo2.envs.verifiers_turns import VerifiersEnvTaskConfig
    from echo2.tasks.episodic import Episodic
    from echo2.tasks.registry import REGISTRY
    from echo2.tasks.single_turn import SingleTurn

    assert set(TASKS) == {
        ArithmeticTaskConfig,
        MathTaskConfig,
        CodeTaskConfig,
        VerifiersTaskConfig,
        PokerTaskConfig,
        GuessTaskConfig,
        VerifiersEnvTaskConfig,
    }
    # one registry keyed by the task name: its config model (whose name it is), preset and builder
    assert set(REGISTRY) == set(TASK_PRESETS)
    for name, entry in REGISTRY.items():
        assert entry.config().name == name and list(entry.preset) == TASK_PRESETS[name]
    arithmetic, math_task = build_task(ArithmeticTaskConfig(), 0), build_task(MathTaskConfig(), 0)
    assert isinstance(arithmetic, SingleTurn) and isinstance(arithmetic.data, ArithmeticTask)
    assert isinstance(math_task, SingleTurn) and isinstance(math_task.data, MathTask)
    code = build_task(CodeTaskConfig(), 0)
    assert isinstance(code, SingleTurn) and isinstance(code.data, CodeTask)
    vf_task = build_task(
        VerifiersTaskConfig(), 0
    )  # builds without verifiers: the taskset is read on first use
    assert isinstance(vf_task, SingleTurn) and isinstance(vf_task.data, VerifiersTask)
    assert arithmetic.score == math_task.score == code.score == "accuracy"
    for cfg in (PokerTaskConfig(), GuessTaskConfig(), VerifiersEnvTaskConfig()):
        task = build_task(cfg, 0)
        assert isinstance(task, Episodic) and isinstance(task.data, EnvironmentTask) and task.name == cfg.name
        assert task.score == ("chips" if cfg.name == "poker" else "return")


@pytest.mark.parametrize("module", ["echo2.data.tasks.base", "echo2.data.tasks"])
def test_task_protocol_imports_no_adapter(module):
    """``base`` (and the package) sit below the adapters and the registry: importing them loads none."""
    code = (
        f"import sys, {module}\n"
        "mods = [m for m in sys.modules if m.startswith('echo2.data.tasks.')]\n"
        "print(','.join(sorted(m for m in mods if m != 'echo2.data.tasks.base')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ""
    # and the registry does load them (so the check above can fail)
    code = code.replace(f"import sys, {module}", "import sys, echo2.tasks.registry")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "echo2.data.tasks.arithmetic" in out and "echo2.data.tasks.math" in out
