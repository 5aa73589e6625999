"""Attackers at real answer lengths (SPEC §10) for the adversary benchmark, and what they need: a model of
>= 50M parameters whose completions run to their length, and a task whose grader reads a final answer.

Each attacker holds the run's join token and sets up exactly like a worker (``adversary.Attacker``); every
one has read the defence and claims, for every token it writes, the log-prob the claimed weights give it
(it holds them), so only the draw can give it away:

- ``launder``: keeps the honest first token and its log-prob, writes any continuation, and sends
  ``turn_mask = [1, 0, ..., 0]`` (it was trained on the first token alone and graded on the text);
- ``rewrite``: rewrites the end of every completion into ``\\boxed{<answer>}``, the answer worked out from
  the prompt (a lease carries none);
- ``insert``: inserts a phrase at a random place of every completion;
- ``sleeper``: honest until it has passed ``check_first`` checks, then rewrites every completion, and
  registers again each time it is caught;
- ``partial``: honest until proven, then rewrites one completion of each submission;
- ``forger``: honest until proven, then rewrites every completion, beside a **flood**: fresh identities
  submitting fabricated completions (random tokens: a full check each, a new identity at every catch).

Every group an attacker forged is recorded by its group id, so the store's ledger says what became of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from echo2.protocol import LeaseGrant, LeaseRequest, RegisterRequest, SubmitRequest, group_to_wire
from echo2.rollout.client import LearnerClient, Refused
from echo2.types import Trajectory
from echo2_bench.adversary import Attacker, solved

PATIENT = ("sleeper", "partial", "forger")  # honest until proven, then lying
PHRASE = " echo2 was here "  # what the phrase inserter puts in


# ---- the model and the task at real length ------------------------------------------------------------
def write_model(out: Path, shape: dict[str, int]) -> Path:
    """A random-init Qwen3-shaped checkpoint of ``shape`` with a word-level tokenizer of ``shape["vocab"]``
    tokens (pad, EOS, unk, printable characters, then filler words), saved as a user checkpoint."""
    import string

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from echo2_bench.synthetic import build

    if (out / "config.json").is_file():
        return out
    chars = [c for c in string.printable if c not in "\t\r\x0b\x0c"]
    words = [f"w{i}" for i in range(shape["vocab"] - 3 - len(chars))]
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>", *chars, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>"
    )
    model = build(shape)  # pad 0, EOS 1: the tokenizer's
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_questions(path: Path, n: int, seed: int = 0) -> Path:
    """``n`` sums as math questions (``What is 37 + 45?``, answer ``82``): graded by math-verify, which reads
    the final box of a completion when it has one."""
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        for _ in range(n):
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            fh.write(json.dumps({"question": f"What is {a} + {b}?", "answer": str(a + b)}) + "\n")
    return path


# ---- the lies ---------------------------------------------------------------------------------------------
def true_logprobs(
    model: Any, prompt_ids: tuple[int, ...], completion_ids: list[int], temperature: float
) -> list[float]:
    """The sampler log-prob the weights give every completion token (one teacher-forced pass): what an
    attacker holding the weights claims for the tokens it wrote."""
    import torch

    ids = torch.tensor([[*prompt_ids, *completion_ids]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, torch.tensor(completion_ids)[:, None]).squeeze(-1).tolist()


def _claim(att: LengthAttacker, t: Trajectory, ids: list[int], changed_from: int) -> Trajectory:
    """``t`` with completion ``ids`` whose first ``changed_from`` tokens are the honest ones: the claimed
    log-probs of the rest are the weights' own."""
    if changed_from >= len(ids):
        return t
    true = true_logprobs(att.w.engine.model, t.prompt_ids, ids, att.w.settings.sampling.temperature)
    lps = [*t.sampler_logprobs[:changed_from], *true[changed_from:]]
    return dataclasses.replace(t, completion_ids=tuple(ids), sampler_logprobs=tuple(lps))


def rewrite(att: LengthAttacker, t: Trajectory, answer: str) -> Trajectory | None:
    """The completion's end rewritten into the answer and EOS, its length kept: ``\\boxed{answer}`` for
    math (what its grader reads), the bare number for arithmetic (its grader reads the whole text, so
    the whole completion is the answer); None if too short."""
    bare = att.w.settings.task.name == "arithmetic"
    text = answer if bare else f" \\boxed{{{answer}}}"
    tail = att.w.codec.tokenizer(text, add_special_tokens=False)["input_ids"]
    ids = list(t.completion_ids)
    keep = 0 if bare else len(ids) - len(tail) - 1
    if keep < 0 or (not bare and keep < 1):
        return None
    new = [*ids[:keep], *tail, att.eos]
    return _claim(att, t, new, keep)


def insert(att: LengthAttacker, t: Trajectory, rng: random.Random) -> Trajectory | None:
    """``PHRASE`` inserted at a random place, the completion cut back to its length (its EOS kept)."""
    phrase = att.w.codec.tokenizer(PHRASE, add_special_tokens=False)["input_ids"]
    ids = list(t.completion_ids)
    ended = ids[-1] == att.eos
    body = ids[:-1] if ended else ids
    if len(body) <= len(phrase) + 1:
        return None
    at = rng.randrange(0, len(body) - len(phrase))
    new = [*body[:at], *phrase, *body[at:]][: len(body)] + ([att.eos] if ended else [])
    return _claim(att, t, new, at)


def launder(att: LengthAttacker, lease: LeaseGrant) -> list[list[Trajectory]]:
    """The honest first token of every row (one sampling step), then tokens of its own to the full length,
    with a turn mask that trains the first token alone."""
    w, G = att.w, lease.group_size
    prompts = [w.codec.encode(p.prompt()) for p in lease.prompts]
    first = w.engine.generate([ids for ids in prompts for _ in range(G)], seed=lease.seed, max_new_tokens=1)
    n = w.settings.sampling.max_new_tokens
    out = []
    for i, (p, ids) in enumerate(zip(lease.prompts, prompts, strict=True)):
        group = []
        for j in range(G):
            s = first[i * G + j]
            rest = [att.rng.randrange(3, att.vocab) for _ in range(n - 1)]
            group.append(
                Trajectory(
                    p.prompt_id, f"{lease.lease_id}:{i}", tuple(ids), (*s.completion_ids, *rest),
                    (*s.logprobs, *([-1.0] * len(rest))), 1.0, 0, {}, (1, *([0] * len(rest))),
                )
            )  # fmt: skip
        out.append(group)
    return out


def fabricate(
    codec: Any, lease: LeaseGrant, n: int, vocab: int, rng: random.Random
) -> list[list[Trajectory]]:
    """Random completions of ``n`` tokens (no EOS) for every leased prompt: cheap to make, a full check to
    catch (a flood)."""
    out = []
    for i, p in enumerate(lease.prompts):
        ids = tuple(codec.encode(p.prompt()))
        group = [
            Trajectory(p.prompt_id, f"{lease.lease_id}:{i}", ids,
                       tuple(rng.randrange(3, vocab) for _ in range(n)), (-10.0,) * n, 0.0, 0)
            for _ in range(lease.group_size)
        ]  # fmt: skip
        out.append(group)
    return out


def _rows(att: LengthAttacker, groups: list[list[Trajectory]], lease: LeaseGrant, one: bool) -> Any:
    """Every completion (``one``: a single one) rewritten; honest until proven for a patient attacker."""
    if not att.lying:
        return groups
    out = [list(g) for g in groups]
    targets = [(i, j) for i in range(len(out)) for j in range(len(out[i]))]
    for i, j in [att.rng.choice(targets)] if one else targets:
        prompt = solved(lease.prompts[i].prompt())
        if att.kind == "insert":
            forged = insert(att, out[i][j], att.rng)
        else:
            forged = rewrite(att, out[i][j], prompt.answer)
        if forged is not None:
            out[i][j] = forged
            att.forged.add(f"{lease.lease_id}:{i}")
            att.this_time.add(f"{lease.lease_id}:{i}")
    return out


LENGTH_FORGES: dict[str, Callable[..., list[list[Trajectory]]]] = {
    "honest": lambda att, groups, lease, draw: groups,
    "rewrite": lambda att, groups, lease, draw: _rows(att, groups, lease, one=False),
    "insert": lambda att, groups, lease, draw: _rows(att, groups, lease, one=False),
    "sleeper": lambda att, groups, lease, draw: _rows(att, groups, lease, one=False),
    "forger": lambda att, groups, lease, draw: _rows(att, groups, lease, one=False),
    "partial": lambda att, groups, lease, draw: _rows(att, groups, lease, one=True),
}


class LengthAttacker(Attacker):
    """An attacker of this module: a worker's setup, then one of the lies above; a patient one tells the
    truth until it has passed ``check_first`` checks (each of its submissions drawn and answered
    ``pending_check`` until then; honest ones pass)."""

    def __init__(
        self, join: str, token: str, kind: str, session: aiohttp.ClientSession, check_first: int = 3
    ) -> None:
        super().__init__(join, token, kind, session, max_prompts=1)
        self.check_first = check_first
        self.rng = random.Random(f"{kind}:attacker")
        self.forged: set[str] = set()  # group ids it forged, all identities
        self.this_time: set[str] = set()  # of which those of the submission being made
        self.admitted_forged: set[str] = set()  # forged groups admitted trainable at once (not drawn)
        self.drawn = 0  # this identity's submissions answered pending_check (honest ones pass)
        self.eos = 1
        self.vocab = 3

    def forges(self) -> dict[str, Callable[..., list[list[Trajectory]]]]:
        return {**LENGTH_FORGES, "launder": lambda att, groups, lease, draw: groups}

    @property
    def lying(self) -> bool:
        return self.kind not in PATIENT or self.drawn >= self.check_first

    async def start(self) -> None:
        await super().start()
        self.eos = int(self.w.engine.eos_ids[0])
        self.vocab = int(self.w.engine.model.config.vocab_size)

    async def new_identity(self) -> str:
        self.drawn = 0
        return await super().new_identity()

    def _generate(self, lease: LeaseGrant) -> list[list[Trajectory]]:
        if self.kind == "launder":  # one honest step, the rest its own
            out = launder(self, lease)
            self.this_time = {f"{lease.lease_id}:{i}" for i in range(len(out))}
            self.forged |= self.this_time
            return out
        return super()._generate(lease)

    async def submit_one(self) -> str:
        self.this_time = set()
        outcome = await super().submit_one()
        self.drawn += outcome == "pending_check"
        if outcome == "admitted":  # not drawn: trainable now, trained by the next update that takes it
            self.admitted_forged |= self.this_time
        return outcome


async def until_caught(
    att: LengthAttacker,
    identities: int,
    budget: int,
    waiting: Callable[[str], int],
    out: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """``identities`` identities of ``att`` (the first is the one it set up with; a new one registers after
    each catch), each submitting until quarantined or ``budget`` submissions: every submission's outcome,
    and after how many of its lying ones it was caught (a verdict that comes after the last submission,
    once ``waiting(worker_id)`` says no check of it waits, included). An identity gives up after 120
    lease refusals in a row that came while no check of its own waited (a refusal because its check waits
    is waited out: at real length a check can wait many minutes on this machine, and an attacker that
    gave up then would never get to lie). Each identity's record is in
    ``out`` from its first submission on, so a study cut short by its time budget keeps what was done
    (an identity still submitting has ``"done": False``)."""
    from echo2_bench.adversary import EVIDENCE

    out = [] if out is None else out
    for n in range(identities):
        wid = att.w.worker_id if n == 0 else await att.new_identity()
        outcomes: list[str] = []
        lying_from: int | None = None
        caught: int | None = None
        refused = 0
        trial = {"kind": att.kind, "worker_id": wid, "outcomes": outcomes, "lying_from": None,
                 "caught_after_lies": None, "done": False}  # fmt: skip
        out.append(trial)
        while len(outcomes) < budget and refused < 120:
            if att.lying and lying_from is None:
                lying_from = len(outcomes)
            try:
                outcome = await att.submit_one()
            except Refused as exc:
                outcome = exc.reply.error
            if outcome == "no_lease":  # a patient attacker: it waits out a refusal while a check of its own
                refused += not waiting(wid)  # waits (a new identity gets no lease then), however long
                continue
            refused = 0
            if outcome == "quarantined":
                caught = len(outcomes) - (lying_from or 0)
                break
            outcomes.append(outcome)
            if outcome in EVIDENCE:
                caught = len(outcomes) - (lying_from or 0)
                break
            trial["lying_from"] = lying_from
        if caught is None and await _quarantined_at_last(att, wid, waiting):
            caught = len(outcomes) - (lying_from or 0)
        trial.update(lying_from=lying_from, caught_after_lies=caught, done=True)
    return out


async def _quarantined_at_last(att: LengthAttacker, wid: str, waiting: Callable[[str], int]) -> bool:
    """Whether a check that was still waiting when the identity stopped caught it."""
    for _ in range(1800):
        if not waiting(wid):
            break
        await asyncio.sleep(1.0)
    try:
        await att.w.client.version()
    except Refused as exc:
        return exc.reply.error == "quarantined"
    return False


# ---- the flood ----------------------------------------------------------------------------------------
async def flood(base: LengthAttacker, token: str, width: int, stop: asyncio.Event) -> dict[str, int]:
    """``width`` identities at a time submitting fabricated completions (each caught at its check, when the
    queue lets it in: a new identity at a full queue is refused check_busy), a new identity registering at
    every catch, until ``stop``: the check queue kept full at the attacker's least cost."""
    tally: dict[str, int] = {"identities": 0}
    rng = random.Random("flood")
    n = base.w.settings.sampling.max_new_tokens
    epoch = base.w._follower().epoch

    async def one() -> None:
        client: LearnerClient | None = None
        while not stop.is_set():
            try:
                if client is None:
                    client = LearnerClient(base.w.opts.join_url, base.w.client.session, reconnect_s=30.0)
                    await client.register(RegisterRequest(name="flood", usd_per_hour=0.35), token)
                    tally["identities"] += 1
                got = await client.lease(LeaseRequest(max_prompts=1, installed_version=base.w.installed,
                                                      installed_epoch=epoch))  # fmt: skip
                if not isinstance(got, LeaseGrant):
                    tally[got.reason] = tally.get(got.reason, 0) + 1
                    await asyncio.sleep(min(got.retry_after_s, 1.0))
                    continue
                groups = fabricate(base.w.codec, got, n, base.vocab, rng)
                body = SubmitRequest(lease_id=got.lease_id, policy_version=base.w.installed,
                                     groups=[group_to_wire(g) for g in groups])  # fmt: skip
                reply = await client.submit(body)
                said = "pending_check" if reply.pending_check else "admitted"
                tally[said] = tally.get(said, 0) + 1
            except Refused as exc:
                tally[exc.reply.error] = tally.get(exc.reply.error, 0) + 1
                if exc.reply.error in ("quarantined", "retired"):
                    client = None  # caught: the next identity
                else:
                    await asyncio.sleep(0.5)

    tasks = [asyncio.ensure_future(one()) for _ in range(width)]
    await stop.wait()
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t
    return tally


# ---- what became of it --------------------------------------------------------------------------------
def forged_ledger(run_dir: Path, group_ids: set[str]) -> dict[str, int]:
    """What the store did with these groups: ``trained`` (a learner step took them), ``trainable`` (buffered,
    released: the next step takes them), ``held`` (waiting for a check), ``purged`` (quarantine, dropped
    check), ``stale``, ``refused`` (never stored: the submission was refused)."""
    out = {"forged": len(group_ids), "trained": 0, "trainable": 0, "held": 0, "purged": 0, "stale": 0}
    if not group_ids:
        return {**out, "refused": 0}
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(group_ids))
    rows = db.execute(
        f"SELECT group_id, consumed_step, held FROM rollout_groups WHERE group_id IN ({marks})",
        sorted(group_ids),
    ).fetchall()
    db.close()
    for _, step, held in rows:
        out[_fate(step, held)] += 1
    out["refused"] = len(group_ids) - len(rows)
    return out


def taken(run_dir: Path, group_ids: set[str]) -> set[str]:
    """Of these groups, those a learner step trained or the next one may take (trainable)."""
    if not group_ids:
        return set()
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(group_ids))
    rows = db.execute(
        f"SELECT group_id, consumed_step, held FROM rollout_groups WHERE group_id IN ({marks})",
        sorted(group_ids),
    ).fetchall()
    db.close()
    return {g for g, step, held in rows if _fate(step, held) in ("trained", "trainable")}


def _fate(step: int | None, held: int) -> str:
    if step is None:
        return "held" if held else "trainable"
    return "trained" if step >= 1 else "purged" if step == -2 else "stale"


def regrade(run_dir: Path, worker_ids: list[str]) -> int:
    """Groups of these workers stored with a reward (or parse status) other than the task's grade of the
    completion (an environment task's: other than the return of the learner's replay of the episode):
    what a worker's claimed rewards got into the store (0: none)."""
    from echo2.config import Config, load_config
    from echo2.data.store import Lease
    from echo2.data.submission import Rejected, Submission
    from echo2.models.policy import ChatFormat, TextCodec
    from echo2.protocol import decode_group
    from echo2.tasks.registry import build_task
    from echo2.types import Bounds, Prompt

    written = run_dir / "config.json"  # the run's resolved config, as JSON (observe/rundir.py)
    cfg = Config.model_validate(json.loads(written.read_text())) if written.is_file() else load_config()
    if cfg.model.path is None:
        from echo2.models.embedded import build_tokenizer

        tokenizer = build_tokenizer()
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    chat = ChatFormat.of(cfg.model.chat_template, cfg.model.system_prompt, cfg.model.chat_template_kwargs)
    codec = TextCodec.of(tokenizer, chat)
    task = build_task(cfg.task, cfg.seed)
    db = sqlite3.connect(run_dir / "store.sqlite")
    marks = ",".join("?" * len(worker_ids))
    rows = db.execute(
        "SELECT g.group_id, g.policy_version, g.data, l.prompts FROM rollout_groups g JOIN leases l "
        f"USING (lease_id) WHERE l.worker_id IN ({marks}) AND g.data != ''",
        worker_ids,
    ).fetchall()
    db.close()
    wrong = 0
    replay = None if hasattr(task, "grade") else task.verifier(codec, tokenizer.eos_token_id, Bounds.of(cfg))
    for gid, version, data, prompts in rows:
        by_id = {i: Prompt(i, t, a, m) for i, t, a, m in json.loads(prompts)}
        group = decode_group(data, gid, version)
        if replay is not None:  # an environment's episodes: the stored returns must be the replay's
            lease = Lease(gid, "w", "open", 0.0, [by_id[group[0].prompt_id]], 0, version)
            try:
                again = replay.check(lease, Submission(gid, version, (tuple(group),))).groups[0]
            except Rejected:
                wrong += len(group)
                continue
            wrong += sum(t.reward != r.reward for t, r in zip(group, again, strict=True))
            continue
        for t in group:
            grade = task.grade(by_id[t.prompt_id], codec.decode_completion(t.completion_ids))
            wrong += (t.reward, t.meta.get("parsed")) != (grade.reward, grade.parsed)
    return wrong
