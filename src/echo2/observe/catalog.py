"""The metrics catalog: one entry per key a run writes to ``metrics.jsonl`` (SPEC §7 names), and every
family the Prometheus endpoint exports.

Each :class:`Metric` says what the key means (unit, one line of help), which loops write it
(``run``: ``echo2 run`` / ``echo2 learner``; ``train``: ``echo2 train``; ``sim``: ``echo2 sim``'s
``metrics.jsonl``), the Prometheus family that exports it (where exported) and where it is drawn: the
panels of the report and ``run.png`` (``report.py``), the charts of the live dashboard
(``static/dashboard.html``) and the columns of the terminal view (:data:`VIEW`). A key with ``<...>``
is a family (``learner/idle_s/<cause>``): :meth:`Metric.of` spells a member.

The consumers read this module instead of spelling keys again: the Prometheus exporter
(``dashboard.py``) takes its names and help from here, the report and the terminal view their keys and
labels, ``runtime/status.py`` its dashboard series; the writers (trainer, store, pool, bubble meter,
...) use these constants or are checked against this table (``tests/unit/test_catalog.py``), and
``docs/metrics.md`` is generated from it (``python -m echo2.observe.catalog --write docs/metrics.md``).
Keys never change spelling: results files and benchmarks read them.

The Prometheus endpoint is built from the live status (``runtime/status.py``), not from the last
record: a family linked to a key exports the same quantity, some read from the parts at scrape time.
:data:`LIVE` lists the families that have no ``metrics.jsonl`` key at all (per-worker gauges, N_min).
Pure data: imports nothing of echo2, so any layer may use it.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Writer = Literal["run", "train", "sim"]
PromKind = Literal["gauge", "counter", "histogram"]

RUN: tuple[Writer, ...] = ("run",)
TRAIN: tuple[Writer, ...] = ("train",)
BOTH: tuple[Writer, ...] = ("run", "train")
ALL: tuple[Writer, ...] = ("run", "train", "sim")
RUN_SIM: tuple[Writer, ...] = ("run", "sim")
SIM: tuple[Writer, ...] = ("sim",)

# where a metric is drawn (report.py panel functions / dashboard.html charts "c-<id>")
ReportPanel = Literal["learning", "bubble", "idle", "staleness", "pool", "usd_rate", "bcast"]
DashboardChart = Literal["reward", "bubble", "stale", "cost", "workers", "mu"]

NAMESPACES = (
    "learner",
    "reward",
    "data",
    "store",
    "rollout",
    "env",
    "pool",
    "cost",
    "broadcast",
    "leases",
    "security",
    "sinks",
)


@dataclass(frozen=True)
class Prom:
    """A Prometheus family (a counter's sample is ``<name>_total``, prometheus-client adds it)."""

    name: str  # family name, echo2_ prefixed
    kind: PromKind  # gauge, counter or histogram
    help: str  # the HELP line
    labels: tuple[str, ...] = ()  # label names


@dataclass(frozen=True)
class Metric:
    """One ``metrics.jsonl`` key."""

    key: str  # the exact key; "<...>" at the end marks a family (learner/idle_s/<cause>)
    unit: str  # s, bytes, count, fraction, version(s), $, $/h, rollouts/s, tokens, 0/1, nats, 1
    help: str  # one line: what it is
    writers: tuple[Writer, ...]  # the loops that write it
    prom: Prom | None = None  # the family /metrics exports it as (None: not exported)
    report: tuple[ReportPanel, ...] = ()  # report / run.png panels that draw it
    dashboard: DashboardChart | None = None  # the live dashboard's chart that draws it
    label: str | None = None  # its legend label where drawn

    @property
    def family(self) -> bool:
        return self.key.endswith(">")

    @property
    def prefix(self) -> str:
        """A family's members start with this (``learner/idle_s/``); a plain key is its own prefix."""
        return self.key[: self.key.index("<")] if self.family else self.key

    def of(self, member: str) -> str:
        """The key of one member of a family: ``IDLE_S.of("wait") == "learner/idle_s/wait"``."""
        if not self.family:
            raise ValueError(f"{self.key} is not a family of keys")
        return self.prefix + member

    def matches(self, key: str) -> bool:
        if self.family:
            return key.startswith(self.prefix) and len(key) > len(self.prefix)
        return key == self.key

    @property
    def exported(self) -> Prom:
        """Its Prometheus family (for the exporter; a metric without one is an error)."""
        if self.prom is None:
            raise KeyError(f"{self.key} is not exported to Prometheus")
        return self.prom


@dataclass(frozen=True)
class Live:
    """A Prometheus family with no ``metrics.jsonl`` key: read from the live status only."""

    source: str  # where NodeStatus.state() holds it: "<section>.<field>" ("pool.workers[]." per worker)
    unit: str
    prom: Prom

    @property
    def field(self) -> str:
        return self.source.rsplit(".", 1)[1]


@dataclass(frozen=True)
class Column:
    """A column of the terminal view (``view.py``): the plain header's name and the live area's label."""

    metric: Metric
    name: str  # plain-mode column header
    fmt: str  # str.format of the value
    width: int  # plain-mode column width
    label: str | None = None  # live-area label where it differs from ``name``


_ENTRIES: list[Metric] = []


def _m(
    key: str,
    unit: str,
    help: str,
    writers: tuple[Writer, ...],
    prom: Prom | None = None,
    report: tuple[ReportPanel, ...] = (),
    dashboard: DashboardChart | None = None,
    label: str | None = None,
) -> Metric:
    m = Metric(key, unit, help, writers, prom, report, dashboard, label)
    _ENTRIES.append(m)
    return m


def _gauge(name: str, help: str, labels: tuple[str, ...] = ()) -> Prom:
    return Prom(name, "gauge", help, labels)


def _counter(name: str, help: str, labels: tuple[str, ...] = ()) -> Prom:
    return Prom(name, "counter", help, labels)


# ---- every record --------------------------------------------------------------------------------
STEP = _m(
    "step",
    "version",
    "the learner version the record belongs to (0: the starting evaluation); trackers log at it",
    ALL,
)
TIME_S = _m(
    "time_s", "s", "seconds since the learner's loop started (a resumed process starts again at 0)", ALL
)

# ---- learner/: the update and the bubble ---------------------------------------------------------
LEARNER_VERSION = _m(
    "learner/version",
    "version",
    "policy version after the update (0 = the starting checkpoint, +1 per update)",
    ALL,
    _gauge("echo2_learner_version", "policy version v_t"),
)
LEARNER_LOSS = _m("learner/loss", "1", "total loss of the update (mean over minibatches)", BOTH)
LEARNER_KL = _m("learner/kl", "nats", "k3 KL to the reference (0 when grpo.kl_beta = 0)", BOTH)
LEARNER_CLIPFRAC = _m(
    "learner/clipfrac", "fraction", "share of valid tokens where the PPO clip was active", BOTH
)
LEARNER_CLIPFRAC_LOW = _m(
    "learner/clipfrac_low", "fraction", "of the clipped tokens, those clipped at 1 - eps_low", BOTH
)
LEARNER_CLIPFRAC_HIGH = _m(
    "learner/clipfrac_high", "fraction", "of the clipped tokens, those clipped at 1 + eps_high", BOTH
)
LEARNER_MASKED_SEQ_FRAC = _m(
    "learner/masked_seq_frac",
    "fraction",
    "share of sequences off-policy sequence masking left out (grpo.offpolicy_mask_delta)",
    BOTH,
)
LEARNER_MISMATCH_KL = _m(
    "learner/mismatch_kl",
    "nats",
    "k3 KL(sampler || learner) over tokens sampled at the learner's version: the engines' numerical "
    "mismatch, not staleness (nan when no fresh token)",
    BOTH,
)
LEARNER_ENTROPY = _m(
    "learner/entropy",
    "nats",
    "the policy's per-token entropy, estimated as the mean -log pi(y_t) of the tokens sampled at the "
    "learner's version (unbiased on the policy's own samples; nan when none)",
    BOTH,
)
LEARNER_ZERO_VARIANCE_SHARE = _m(
    "learner/zero_variance_share",
    "fraction",
    "groups of the batch whose rewards were all equal (zero advantage: no signal)",
    BOTH,
)
LEARNER_GRAD_NORM = _m("learner/grad_norm", "1", "gradient norm before clipping", BOTH)
LEARNER_IS_WEIGHT_MEAN = _m(
    "learner/is_weight_mean",
    "1",
    "mean importance weight sampler -> learner (truncated when decoupled; 1.0 on-policy)",
    BOTH,
)
LEARNER_EXCLUDED_GROUPS = _m(
    "learner/excluded_groups",
    "count",
    "groups the update left out: non-finite loss or gradient (purged, their worker quarantined)",
    BOTH,
)
LEARNER_T_TRAIN_S = _m(
    "learner/t_train_s",
    "s",
    "wall seconds of the update inside the trainer (T_train, SPEC §3)",
    ALL,
    _gauge("echo2_learner_train_seconds", "seconds of the last update (T_train)"),
)
LEARNER_BUBBLE_RATIO = _m(
    "learner/bubble_ratio",
    "fraction",
    "1 - update seconds / wall seconds of the step's window: every second not updating counts",
    ALL,
    _gauge("echo2_learner_bubble_ratio", "1 - update seconds / wall seconds of the loop"),
    report=("bubble",),
    dashboard="bubble",
    label="bubble ratio",
)
LEARNER_STEP_WALL_S = _m(
    "learner/step_wall_s",
    "s",
    "wall seconds of the step's window (the windows tile the loop)",
    BOTH,
    _gauge("echo2_learner_step_seconds", "wall seconds of the last learner step"),
)
LEARNER_UPDATE_S = _m(
    "learner/update_s",
    "s",
    "seconds of the step's window inside the update, as the learner saw it",
    BOTH,
    _counter("echo2_learner_update_seconds", "seconds inside updates"),
)
LEARNER_IDLE_S = _m(
    "learner/idle_s/<cause>",
    "s",
    "idle seconds of the step's window by cause: wait (in echo2 train: generation), publish, eval, "
    "checkpoint, log, other",
    BOTH,
    _counter("echo2_learner_idle_seconds", "seconds not updating, by cause", ("cause",)),
    report=("idle",),
)
LEARNER_GC_PAUSE_S = _m(
    "learner/gc_pause_s",
    "s",
    "seconds of the step's window the cyclic garbage collector held the learner process (every thread "
    "waits on it: the update and the event loop serving the fleet)",
    RUN,
)
LEARNER_GC_FULL = _m(
    "learner/gc_full_collections",
    "count",
    "full collections in the step's window (each traverses every object the process holds but those frozen "
    "after setup)",
    RUN,
)
LEARNER_T_IDLE_S = _m(
    "learner/t_idle_s", "s", "the simulator's wait before the step (its bubble numerator)", SIM
)

# ---- reward/ -------------------------------------------------------------------------------------
REWARD_MEAN = _m(
    "reward/mean",
    "reward",
    "mean training reward of the step's rollouts (an environment's: the mean return)",
    BOTH,
    report=("learning",),
    dashboard="reward",
    label="train reward",
)
REWARD_UNPARSED = _m(
    "reward/unparsed", "count", "completions of the step the reward function could not parse (reward 0)", BOTH
)
REWARD_GRADE_TIMEOUTS = _m(
    "reward/grade_timeouts",
    "count",
    "gradings of the learner process since the previous step that ran past the grade timeout or lost "
    "their grading process (each scored 0 and unparsed; math task)",
    BOTH,
)
REWARD_OUTCOMES = _m(
    "reward/outcomes/<outcome>",
    "count",
    "gradings of the learner process since the previous step, by outcome (code task: passed, failed, "
    "exited_early, no_code, and the sandbox limits timeout, cpu, memory, output, killed; verifiers "
    "tasksets: scored, error; a verifiers env's judged episodes: judged, judge_error)",
    BOTH,
)
REWARD_ACCURACY = _m(
    "reward/accuracy",
    "fraction",
    "held-out greedy accuracy, at evaluation steps (step 0: the starting checkpoint)",
    BOTH,
    report=("learning",),
    dashboard="reward",
    label="held-out accuracy",
)
REWARD_EVAL_UNPARSED = _m(
    "reward/eval_unparsed",
    "fraction",
    "share of held-out completions that could not be parsed, at evaluation steps",
    BOTH,
)

# ---- store/: admission and the trained batch ------------------------------------------------------
STORE_SIZE = _m(
    "store/size",
    "count",
    "admissible trajectories buffered, not yet trained on",
    ALL,
    _gauge("echo2_store_size", "buffered admissible trajectories"),
)
STORE_ADMITTED = _m(
    "store/admitted",
    "count",
    "trajectories stored for training (run and train: so far; sim: this step's)",
    ALL,
    _counter("echo2_store_admitted", "trajectories admitted"),
)
STORE_DROPPED_STALE = _m(
    "store/dropped_stale",
    "count",
    "trajectories discarded as too old (v < v_t - S), at submit or at take",
    ALL,
    _counter("echo2_store_dropped_stale", "trajectories dropped stale"),
)
STORE_ZERO_VARIANCE = _m(
    "store/zero_variance",
    "trajectories",
    "admitted trajectories of groups whose rewards were all equal, left out untrained "
    "(grpo.drop_zero_variance; counted in store/admitted)",
    BOTH,
)
STORE_REJECTED = _m("store/rejected", "count", "requests refused, all reasons (so far)", BOTH)
STORE_REJECTED_BY = _m(
    "store/rejected/<reason>",
    "count",
    "requests refused, by reason (a 4xx's reason code)",
    RUN,
    _counter("echo2_store_rejected", "requests refused, by reason", ("reason",)),
)
STORE_TRAINED = _m(
    "store/trained",
    "count",
    "trajectories updates have taken (less those a restart handed back or poison purged)",
    BOTH,
)
STORE_YIELD = _m(
    "store/yield",
    "fraction",
    "of the trajectories that reached the store (admitted, or stale on arrival), the share trained: the "
    "run's yield",
    BOTH,
)
STORE_YIELD_LOST = _m(
    "store/yield_lost/<cause>",
    "fraction",
    "of the trajectories that reached the store, the share lost by cause (stale, zero_variance, purged, "
    "unchecked) or still buffered",
    BOTH,
)
STORE_PURGED = _m(
    "store/purged", "count", "trajectories purged untrained because their worker was quarantined", BOTH
)
STORE_POISONED = _m(
    "store/poisoned", "count", "groups purged because their loss or gradient was not finite", BOTH
)
STORE_HELD = _m(
    "store/held",
    "count",
    "buffered trajectories waiting for their generation check (not trainable until it passes)",
    BOTH,
    _gauge("echo2_store_held", "trajectories held for their generation check"),
)
STORE_UNCHECKED_DROPPED = _m(
    "store/unchecked_dropped",
    "count",
    "trajectories discarded untrained because their generation check could not run (so far)",
    BOTH,
)
DATA_EPOCH = _m(
    "data/epoch",
    "epochs",
    "how far the leases are through the training split: 1.5 = half way through the second epoch (a finite "
    "split only: dataset files)",
    BOTH,
)
DATA_PROMPTS_REQUEUED = _m(
    "data/prompts_requeued",
    "count",
    "prompts leased again so far: their lease expired or its answer was refused, or their groups were "
    "dropped as stale, purged or left out as poison",
    BOTH,
)
DATA_PROMPTS_SKIPPED = _m(
    "data/prompts_skipped",
    "count",
    "prompts given up so far, each with a logged reason (its admitted groups dropped as stale 3 "
    "times; answers stale on arrival never count)",
    BOTH,
)
DATA_TOKENS_GENERATED = _m(
    "data/completion_tokens_generated",
    "tokens",
    "mean completion length of the trajectories admitted since the previous step record",
    BOTH,
)
DATA_TOKENS_TRAINED = _m(
    "data/completion_tokens_trained",
    "tokens",
    "mean completion length of the step's batch (against the generated mean: a length bias of staleness)",
    BOTH,
)
STORE_STALENESS_MAX = _m(
    "store/staleness_max",
    "versions",
    "Delta(t) = v_t - min v of the trained batch (never above S)",
    ALL,
    Prom("echo2_staleness", "histogram", "max staleness Delta(t) of each step's batch"),
    report=("staleness",),
    dashboard="stale",
    label="staleness max",
)
STORE_STALENESS_MEAN = _m(
    "store/staleness_mean",
    "versions",
    "mean v_t - v over the trained batch",
    ALL,
    report=("staleness",),
    dashboard="stale",
    label="staleness mean",
)

# ---- rollout/, env/: what the batch cost to generate ----------------------------------------------
ROLLOUT_T_GEN_S = _m(
    "rollout/t_gen_s", "s", "seconds the synchronous loop spent generating the step's batch", TRAIN
)
ROLLOUT_TOKENS = _m("rollout/tokens", "tokens", "completion tokens generated for the step's batch", TRAIN)
ENV_TURNS_MEAN = _m(
    "env/turns_mean", "decisions", "an environment's decisions per episode of the trained batch", BOTH
)
ENV_ILLEGAL_RATE = _m(
    "env/illegal_rate", "fraction", "illegal actions / decisions of the trained batch's episodes", BOTH
)
ENV_CUT = _m("env/cut", "count", "episodes of the trained batch cut (max_turns or the context)", BOTH)
ENV_ERRORS = _m("env/errors", "count", "episodes of the trained batch ended by an environment error", BOTH)

# ---- pool/, cost/: the fleet and what it costs ----------------------------------------------------
POOL_MU_POOL = _m(
    "pool/mu_pool",
    "rollouts/s",
    "measured rollout rate of the active pool (the simulator: true mean rates)",
    RUN_SIM,
    _gauge("echo2_pool_mu_pool", "measured rollouts/s of the active pool"),
    dashboard="mu",
    label="μ pool /s",
)
POOL_MU_CHECK_MAX = _m(
    "pool/mu_check_max",
    "rollouts/s",
    "the largest pool rate whose check_floor share the generation check can re-run: its measured "
    "capacity / check_floor; the target is capped at it (null before the first check)",
    RUN,
)
POOL_USEFUL_SHARE = _m(
    "pool/useful_share",
    "fraction",
    "the share of received rollouts a batch can use, which the target is sized for (R / share): "
    "1 - the zero-variance share when grpo.drop_zero_variance",
    RUN,
)
POOL_MU_TARGET = _m(
    "pool/mu_target",
    "rollouts/s",
    "the controller's target gamma * mu_min (null until T_train is measured)",
    RUN_SIM,
    _gauge("echo2_pool_mu_target", "gamma * mu_min (rollouts/s)"),
    dashboard="mu",
    label="μ target /s",
)
POOL_ACTIVE_WORKERS = _m(
    "pool/active_workers",
    "count",
    "workers the controller has active (billed)",
    RUN_SIM,
    _gauge("echo2_pool_active_workers", "workers the controller has active"),
    report=("pool",),
    dashboard="workers",
    label="active workers",
)
POOL_MU_POOL_MEASURED = _m(
    "pool/mu_pool_measured", "rollouts/s", "the simulated controller's estimate of mu_pool", SIM
)
COST_USD_PER_STEP = _m(
    "cost/usd_per_step", "$", "dollars billed during the step (learner + active workers)", RUN_SIM
)
COST_USD_TOTAL = _m(
    "cost/usd_total",
    "$",
    "dollars billed so far, at the registered prices",
    RUN_SIM,
    _gauge("echo2_cost_usd", "dollars spent so far"),
    report=("pool",),
    dashboard="cost",
    label="$ total",
)
COST_USD_PER_HOUR = _m(
    "cost/usd_per_hour",
    "$/h",
    "the learner's price plus the active workers' registered prices",
    RUN,
    _gauge("echo2_cost_usd_per_hour", "learner + active workers, $/h"),
    report=("usd_rate",),
    dashboard="cost",
    label="$/h",
)

# ---- broadcast/: the newest measured dissemination, the newest publication, the publisher's counts ----
BROADCAST_T_BCAST_S = _m(
    "broadcast/t_bcast_s",
    "s",
    "last measured T_bcast: seconds until ceil(N/gamma) of the targeted workers acked the install",
    RUN_SIM,
    _gauge("echo2_broadcast_t_bcast_seconds", "last measured T_bcast"),
    report=("bcast",),
    label="T_bcast",
)
BROADCAST_BYTES = _m(
    "broadcast/bytes",
    "bytes",
    "payload bytes the learner uploaded for the last measured version",
    RUN_SIM,
    _gauge("echo2_broadcast_learner_bytes", "bytes the learner uploaded for it"),
)
BROADCAST_INSTALL_P90_S = _m(
    "broadcast/install_p90_s",
    "s",
    "seconds until 90% of the targeted workers installed it",
    RUN_SIM,
    report=("bcast",),
    label="install p90",
)
BROADCAST_PUBLICATION_BYTES = _m(
    "broadcast/publication_bytes",
    "bytes",
    "bytes of the newest publication (an anchor or a patch)",
    RUN,
    _gauge("echo2_broadcast_bytes", "bytes of the newest publication (an anchor or a patch)"),
)
BROADCAST_FULL_BYTES = _m(
    "broadcast/full_bytes",
    "bytes",
    "bytes of a full snapshot in the publication dtype",
    RUN,
    _gauge("echo2_broadcast_full_bytes", "bytes of a full snapshot in the publication dtype"),
)
BROADCAST_PATCH_RATIO = _m(
    "broadcast/patch_ratio", "fraction", "newest publication's bytes / full_bytes", RUN
)
BROADCAST_ANCHOR = _m(
    "broadcast/anchor", "0/1", "1 if the newest publication is a full anchor, 0 if a patch", RUN
)
BROADCAST_ENCODE_S = _m("broadcast/encode_s", "s", "seconds encoding the newest publication", RUN)
BROADCAST_PUBLISH_S = _m(
    "broadcast/publish_s",
    "s",
    "wall seconds of the newest publication: copy, encode, digests, signature, announce",
    RUN,
)
BROADCAST_PUBLISH_CPU_S = _m(
    "broadcast/publish_cpu_s", "s", "CPU seconds of the threads that copied and encoded it", RUN
)
BROADCAST_STALL_REPORTS = _m(
    "broadcast/stall_reports", "count", "valid reports of a peer that stalled for its reporter (so far)", RUN
)
BROADCAST_REPORTS_REFUSED = _m(
    "broadcast/reports_refused",
    "count",
    "stall reports refused: unknown version, not the source, repeated",
    RUN,
)
BROADCAST_REPORTS_STARVED = _m(
    "broadcast/reports_starved",
    "count",
    "stall reports against a member its own source starved in that version: not counted against it",
    RUN,
)
BROADCAST_RELAYS_DEMOTED = _m(
    "broadcast/relays_demoted",
    "count",
    "members no longer planned as relays after repeated stall reports",
    RUN,
)
BROADCAST_RELAYS_SLOW = _m(
    "broadcast/relays_slow",
    "count",
    "findings of a relay slow to its children (their acks' paces): planned over a link that slow for a while",
    RUN,
)
BROADCAST_ACKS_REFUSED = _m(
    "broadcast/acks_refused",
    "count",
    "install acks not counted: receipts inconsistent, or reported stalling",
    RUN,
)
BROADCAST_BAD_FRAMES = _m(
    "broadcast/bad_frames", "count", "broadcast connections dropped on a malformed frame from a peer", RUN
)
BROADCAST_PEER_ERRORS = _m(
    "broadcast/peer_errors",
    "count",
    "broadcast connections dropped on an unexpected error from a peer's bytes",
    RUN,
)
BROADCAST_SPILL_FAILED = _m(
    "broadcast/spill_failed",
    "count",
    "publications served from memory: the descriptor table or the disk stayed full while spilling (so far)",
    RUN,
)
BROADCAST_MEMBERS_EXPELLED = _m(
    "broadcast/members_expelled",
    "count",
    "connected members whose broadcast connections closed when the run stopped trusting them",
    RUN,
)
BROADCAST_LATECOMERS = _m(
    "broadcast/latecomers",
    "count",
    "members attached to an anchor after it was announced (they pull it from a member that holds it or is "
    "receiving it)",
    RUN,
)
BROADCAST_LATECOMERS_FROM_LEARNER = _m(
    "broadcast/latecomers_from_learner",
    "count",
    "latecomers that pull the anchor from the learner: nobody in its round could take them",
    RUN,
)

# ---- perimeter/: what strangers held of each port before anyone was known (echo2/perimeter.py) ----------
PERIMETER_API = _m(
    "perimeter/api/<counter>",
    "count",
    "the API port: connections accepted, refused (full, address, rate), evicted, handshakes failed, "
    "header timeouts, requests limited, vouched (so far); open and pre_auth (now)",
    RUN,
)
PERIMETER_BROADCAST = _m(
    "perimeter/broadcast/<counter>",
    "count",
    "the broadcast port: the same counts as perimeter/api/",
    RUN,
)

# ---- leases/, security/: what untrusted workers were held to --------------------------------------
CHECKPOINT_FAILED = _m(
    "learner/checkpoint_failed",
    "count",
    "checkpoints not written: the descriptor table or the disk stayed full; the previous one stands (so far)",
    BOTH,
)
LEASES_UNRETURNED = _m(
    "leases/unreturned", "count", "leases that expired unanswered, all workers (so far)", RUN
)
LEASES_BENCHED = _m(
    "leases/benched", "count", "times a worker was benched for unreturned leases in a row", RUN
)
LEASES_STALE_ANSWERS = _m(
    "leases/stale_answers",
    "count",
    "answers too stale to admit (each a strike, never a returned lease), all workers (so far)",
    RUN,
)
SECURITY_CHECKED_SUBMISSIONS = _m(
    "security/checked_submissions", "count", "submissions whose generation the learner re-ran", RUN
)
SECURITY_CHECKED_TRAJECTORIES = _m(
    "security/checked_trajectories", "count", "trajectories the generation check re-ran", RUN
)
SECURITY_CHECKED_TOKENS = _m(
    "security/checked_tokens", "tokens", "completion tokens the generation check re-scored", RUN
)
SECURITY_WORST_PASSING_LOGPROB_ERROR = _m(
    "security/worst_passing_logprob_error",
    "nats",
    "largest log-prob difference of a completion that passed (how close honest noise comes to the tolerance)",
    RUN,
)
SECURITY_POSITION_ERROR_P99 = _m(
    "security/position_error_p99",
    "nats",
    "99th percentile over every checked position of |claimed - recomputed| sampler log-prob (the upper "
    "edge of its bin, four a decade)",
    RUN,
)
SECURITY_POSITION_ERROR_MAX = _m(
    "security/position_error_max",
    "nats",
    "largest |claimed - recomputed| sampler log-prob of any checked position (passed or not)",
    RUN,
)
SECURITY_CHECK_BACKLOG = _m(
    "security/check_backlog",
    "count",
    "submissions waiting for their generation check (at most security.check_queue)",
    RUN,
    _gauge("echo2_security_check_backlog", "submissions waiting for their generation check"),
)
SECURITY_CHECK_LATENCY_S = _m(
    "security/check_latency_s",
    "s",
    "seconds from a checked submission's arrival to its verdict, the newest one's",
    RUN,
)
SECURITY_CHECK_SHARE = _m(
    "security/check_share",
    "ratio",
    "the share of a proven identity's submissions drawn for the check now: max(check_floor, "
    "check_fraction x (1 - backlog / check_queue)) (a new one's: 1 until it passed check_first checks)",
    RUN,
)
SECURITY_CHECK_DECLINED = _m(
    "security/check_declined",
    "count",
    "submissions the full-rate draw would have checked that the backlog rule left undrawn (never below "
    "the floor)",
    RUN,
)
SECURITY_CHECK_EXPIRED = _m(
    "security/check_expired",
    "count",
    "drawn submissions whose version left the admissible window before their check ran: dropped "
    "untrained, a strike for their worker",
    RUN,
)
SECURITY_WAITS_FOR_CHECKS = _m(
    "security/waits_for_checks",
    "count",
    "times the learner waited for the check of a drawn submission at the admission floor before an update "
    "(the update would have left it behind unchecked)",
    RUN,
)
SECURITY_CHECK_CAPACITY = _m(
    "security/check_capacity",
    "completions/s",
    "completions the generation check re-ran per second of checking (its waits for updates included): "
    "the pool the check can keep at its floor is this / check_floor",
    RUN,
)
SECURITY_CHECK_CAPACITY_TOKENS = _m(
    "security/check_capacity_tokens",
    "tokens/s",
    "completion tokens the generation check re-scored per second of checking",
    RUN,
)
SECURITY_NEAR_TIES = _m(
    "security/near_ties",
    "count",
    "checked tokens that were not the check's draw but declared near ties (within gumbel_tolerance of "
    "the best perturbed score; never accepted on a token the grader reads)",
    RUN,
)
SECURITY_NEAR_TIE_ROOM = _m(
    "security/near_tie_room",
    "count",
    "checked positions where a token other than the draw lay within gumbel_tolerance of the best: "
    "where a forger could choose (docs/security.md)",
    RUN,
)
SECURITY_GRADED_TIES = _m(
    "security/graded_ties",
    "count",
    "drawn submissions dropped untrained for a near tie on a token the grader reads (no strike)",
    RUN,
)
SECURITY_HELD_BEHIND = _m(
    "security/held_behind",
    "count",
    "submissions not drawn but held behind a waiting check of their worker's, until every check it had "
    "waiting passed (so nothing sent after a drawn forgery is trained, however long its check waits)",
    RUN,
)
SECURITY_DROPPED_BEHIND = _m(
    "security/dropped_behind",
    "count",
    "of the submissions held behind a waiting check, those dropped untrained because a check they "
    "waited for found a forgery, expired or failed",
    RUN,
)
SECURITY_QUARANTINED = _m(
    "security/quarantined", "count", "workers quarantined (persisted: a restart keeps them)", RUN
)

# ---- sinks/ --------------------------------------------------------------------------------------
SINK_FAILURES = _m(
    "sinks/failures/<name>", "count", "failed writes of an experiment tracker so far (off after 3)", BOTH
)

METRICS: tuple[Metric, ...] = tuple(_ENTRIES)

# ---- Prometheus families with no metrics.jsonl key ------------------------------------------------
_WORKER = ("worker", "name", "hardware")
LIVE: tuple[Live, ...] = (
    Live("pool.n_min", "count", _gauge("echo2_planner_n_min", "N_min = ceil(mu_min / mean mu_i)")),
    Live(
        "pool.workers[].active",
        "0/1",
        _gauge("echo2_worker_active", "1 if the controller has the worker active", _WORKER),
    ),
    Live(
        "pool.workers[].installed_version",
        "version",
        _gauge("echo2_worker_installed_version", "newest installed snapshot", _WORKER),
    ),
    Live(
        "pool.workers[].install_s",
        "s",
        _gauge("echo2_worker_install_seconds", "seconds the worker's last install took", _WORKER),
    ),
    Live(
        "pool.workers[].relay_demoted",
        "0/1",
        _gauge(
            "echo2_worker_relay_demoted",
            "1 if the broadcast no longer plans the worker as a relay (its peers reported it stalling)",
            _WORKER,
        ),
    ),
    Live(
        "pool.workers[].mismatch_kl",
        "nats",
        _gauge(
            "echo2_worker_mismatch_kl",
            "k3 KL(the worker's sampler || the learner) over its fresh sequences in the latest update with "
            "any (NaN before)",
            _WORKER,
        ),
    ),
    Live(
        "pool.workers[].mu",
        "rollouts/s",
        _gauge("echo2_worker_rollouts_per_second", "measured mu_i", _WORKER),
    ),
    Live("pool.workers[].usd_per_hour", "$/h", _gauge("echo2_worker_usd_per_hour", "price c_i", _WORKER)),
    Live(
        "pool.workers[].rollouts",
        "count",
        _gauge("echo2_worker_rollouts_admitted", "trajectories admitted", _WORKER),
    ),
    Live(
        "broadcast.version", "version", _gauge("echo2_broadcast_version", "newest published snapshot version")
    ),
    Live(
        "broadcast.installed",
        "count",
        _gauge("echo2_broadcast_installed_workers", "workers that installed it so far"),
    ),
)
WORKER_GAUGES: tuple[Live, ...] = tuple(x for x in LIVE if x.source.startswith("pool.workers[]."))


def _live(source: str) -> Live:
    return next(x for x in LIVE if x.source == source)


PLANNER_N_MIN = _live("pool.n_min")
BROADCAST_VERSION = _live("broadcast.version")
BROADCAST_INSTALLED = _live("broadcast.installed")

PROMETHEUS: tuple[Prom, ...] = (*(m.prom for m in METRICS if m.prom is not None), *(x.prom for x in LIVE))

# ---- the terminal view: its columns, in order ------------------------------------------------------
VIEW: tuple[Column, ...] = (
    Column(LEARNER_VERSION, "v", "{}", 6),
    Column(REWARD_MEAN, "reward", "{:.2f}", 7),
    Column(REWARD_ACCURACY, "acc", "{:.2f}", 6),
    Column(LEARNER_BUBBLE_RATIO, "bubble", "{:.2f}", 7),
    Column(STORE_STALENESS_MAX, "stale", "{}", 6),
    Column(POOL_ACTIVE_WORKERS, "workers", "{}", 8),
    Column(COST_USD_PER_HOUR, "usd/h", "{:.2f}", 7, label="$/h"),
)


# ---- looking keys up -----------------------------------------------------------------------------
BY_KEY: dict[str, Metric] = {m.key: m for m in METRICS}


def find(key: str) -> Metric | None:
    """The entry of ``key``: its own, or the family it is a member of (None: not in the catalog)."""
    m = BY_KEY.get(key)
    if m is not None:
        return m
    return next((f for f in METRICS if f.family and f.matches(key)), None)


def unknown(keys: Iterable[str]) -> list[str]:
    """The keys of ``keys`` the catalog does not describe, sorted."""
    return sorted({k for k in keys if find(k) is None})


def in_report(panel: ReportPanel) -> tuple[Metric, ...]:
    """The metrics a report panel draws, in catalog order."""
    return tuple(m for m in METRICS if panel in m.report)


def in_dashboard(chart: DashboardChart) -> tuple[Metric, ...]:
    return tuple(m for m in METRICS if m.dashboard == chart)


DASHBOARD_SERIES: tuple[str, ...] = (STEP.key, TIME_S.key, *(m.key for m in METRICS if m.dashboard))


# ---- docs/metrics.md -----------------------------------------------------------------------------
BEGIN = "<!-- BEGIN catalog: generated by `python -m echo2.observe.catalog --write docs/metrics.md` -->"
END = "<!-- END catalog -->"
_WRITERS = {"run": "run", "train": "train", "sim": "sim"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _drawn(m: Metric) -> str:
    where = [f"report: {', '.join(m.report)}"] if m.report else []
    if m.dashboard:
        where.append(f"dashboard: {m.dashboard}")
    where += [f"view: {c.name}" for c in VIEW if c.metric is m]
    return "; ".join(where)


def _prom(p: Prom | None) -> str:
    if p is None:
        return ""
    name = p.name + ("_total" if p.kind == "counter" else "")
    labels = "{" + ",".join(p.labels) + "}" if p.labels else ""
    return f"`{name}{labels}`" + ("" if p.kind == "gauge" else f" ({p.kind})")


def markdown() -> str:
    """The tables of ``docs/metrics.md`` between its markers: every key, then the live-only families."""
    rows = ["| key | unit | written by | meaning | Prometheus | drawn in |", "|---|---|---|---|---|---|"]
    for m in METRICS:
        cells = (
            f"`{m.key}`",
            m.unit,
            ", ".join(_WRITERS[w] for w in m.writers),
            m.help,
            _prom(m.prom),
            _drawn(m),
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    rows += ["", "Prometheus families with no `metrics.jsonl` key (read from the live status):", ""]
    rows += ["| Prometheus | unit | status field | help |", "|---|---|---|---|"]
    for x in LIVE:
        rows.append(
            "| " + " | ".join(_cell(c) for c in (_prom(x.prom), x.unit, f"`{x.source}`", x.prom.help)) + " |"
        )
    return "\n".join(rows) + "\n"


def render_into(text: str) -> str:
    """``text`` (a markdown page holding the markers) with the generated block replaced."""
    pattern = re.compile(re.escape(BEGIN) + r"\n.*?" + re.escape(END), re.S)
    if not pattern.search(text):
        raise ValueError(f"no generated block ({BEGIN} ... {END}) to replace")
    return pattern.sub(lambda _: f"{BEGIN}\n{markdown()}{END}", text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m echo2.observe.catalog", description=__doc__.split("\n")[0]
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--markdown", action="store_true", help="print the metrics tables (markdown)")
    group.add_argument(
        "--write", metavar="PAGE", help="replace the generated block of PAGE (docs/metrics.md)"
    )
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(markdown())
        return 0
    page = Path(args.write)
    page.write_text(render_into(page.read_text(encoding="utf-8")), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
