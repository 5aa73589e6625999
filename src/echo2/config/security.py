"""``[security]`` (and ``[security.perimeter]``): what the learner checks of untrusted workers and what a
stranger may hold before anyone is known."""

from __future__ import annotations

from pydantic import Field, model_validator

from echo2.config.base import (
    FloatDtype,
    _Section,
)

# The generation check's default (log-prob, draw) tolerances per engine precision. float32: the
# learner's float32 re-run of a float32 engine differs by reduction order only. bfloat16: first set to
# 0.3 / 0.2 from honest bf16 HF-engine samples of the embedded model (1,024 completions, 3,618 tokens:
# largest |log-prob error| 0.143, p99 0.097; no drawn token further than 0.1 below the best perturbed
# score); the validating run (benchmarks/adversary.py --study honest_bf16) then quarantined both honest
# workers within 90 s (errors of 0.301 and 0.305, one drawn token beyond 0.2), so they are 0.6 / 0.5 now,
# about twice the worst seen; with the check then computing in the declared precision too
# (models/snapshot.aliasing_model) the worst honest error fell to 0.092 (docs/security.md). float16 (10
# mantissa bits to bfloat16's 7) is not measured and takes bfloat16's.
ENGINE_TOLERANCES: dict[str, tuple[float, float]] = {
    "float32": (0.05, 0.05),
    "bfloat16": (0.6, 0.5),
    "float16": (0.6, 0.5),
}


class PerimeterConfig(_Section):
    """What a stranger may hold on a listening port before anyone is known (``[security.perimeter]``;
    ``echo2/perimeter.py``, docs/security.md "The perimeter"). The same rules on the API port, the
    broadcast port and every worker's chunk relay; the connection caps are cut to fit the descriptor
    limit (raised to the hard limit at start)."""

    max_connections: int = Field(
        16384,
        ge=16,
        description="connections one port holds at once (members and strangers); at most 40% of the "
        "descriptors left after 256 kept for files, whatever is set",
    )
    max_per_address: int = Field(
        64,
        ge=1,
        description="connections one peer address may hold on one port (workers behind one NAT share it)",
    )
    pre_auth_share: float = Field(
        0.5,
        gt=0.0,
        le=1.0,
        description="share of max_connections that connections no request has authenticated yet may hold; "
        "past it the oldest of the address holding the most is closed for a new one",
    )
    accepts_per_s: float = Field(
        20.0, gt=0.0, allow_inf_nan=False, description="new connections one address may open per second"
    )
    accept_burst: float = Field(64.0, ge=1.0, allow_inf_nan=False, description="... in bursts of this many")
    accepts_per_s_total: float = Field(
        30.0,
        gt=0.0,
        allow_inf_nan=False,
        description="new connections one port accepts per second from all addresses together (each a TLS "
        "handshake: about 0.5 ms of the serving thread); a flood from many addresses is held to it",
    )
    handshake_s: float = Field(
        10.0, gt=0.0, allow_inf_nan=False, description="seconds a TLS handshake may take"
    )
    header_s: float = Field(
        10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="seconds after the handshake by which a connection's first request (line and headers, "
        "or first frame) must have authenticated; else it is closed",
    )
    idle_s: float = Field(
        30.0,
        gt=0.0,
        allow_inf_nan=False,
        description="an API connection with no request in progress for this long is closed (HTTP keep-alive)",
    )
    requests_per_s: float = Field(
        10.0,
        gt=0.0,
        allow_inf_nan=False,
        description="requests one address may make that no identity vouches for (registration, a bad "
        "credential); more get 429",
    )
    request_burst: float = Field(20.0, ge=1.0, allow_inf_nan=False, description="... in bursts of this many")


class SecurityConfig(_Section):
    """What the learner checks of strangers' machines (``[security]``; docs/security.md)."""

    tls: bool = Field(
        True,
        description="TLS on the API and broadcast planes with a certificate made for the run; workers "
        "pin its fingerprint from the join string (false: plain text, for trusted networks only)",
    )
    check_fraction: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="share of submissions whose generation is re-checked (log-probs and seeded "
        "Gumbel-max tokens recomputed with the claimed version's weights); 0 = never",
    )
    check_floor: float = Field(
        0.25,
        ge=0.0,
        le=1.0,
        description="the least share of every proven identity's submissions drawn for the generation check, "
        "whatever the check queue does: a full queue lowers the draw from check_fraction to this and no "
        "further, and a drawn submission waits for its check (held, within the in-flight budget), never "
        "admitted unchecked; taken as check_fraction when above it",
    )
    check_samples: int = Field(
        0,
        ge=0,
        description="completions re-run per drawn submission; 0 = every one, so a submission with one "
        "forged completion fails whenever it is drawn",
    )
    check_first: int = Field(
        3,
        ge=0,
        description="generation checks a new identity must pass before its submissions are drawn at "
        "check_fraction: until then every one of them is drawn (at a full check queue refused, check_busy, "
        "never admitted unchecked), so a forger is caught in its first submissions, before it has been "
        "trusted with much; 0 = none",
    )
    check_queue: int = Field(
        32,
        ge=1,
        description="submissions waiting for their generation check beyond which a new identity's is "
        "refused (check_busy, no strike); a proven identity's share drawn falls as the queue fills, "
        "max(check_floor, check_fraction x (1 - waiting / check_queue)), and its drawn submissions wait "
        "beyond it (held, within the in-flight budget)",
    )
    check_behind_free: int = Field(
        0,
        ge=0,
        description="submissions of a worker admitted trainable while a drawn submission of its own waits "
        "for its check; beyond these, what it sends is held behind that check (released when it passes, "
        "dropped with a forgery), so a forger gets at most this many more trained after its first drawn "
        "lie, however long the check waits (docs/security.md); 0 = hold everything behind it",
    )
    check_nice: int = Field(
        19,
        ge=0,
        le=19,
        description="niceness of the checker's thread and of the compute threads it starts (Linux): at 19 "
        "the update, publications and the request path come first and checks use the cores they leave "
        "(about 1/70 of a core they keep busy, all of an idle one); 0 = an equal share",
    )
    check_duty: float = Field(
        0.02,
        ge=0.0,
        le=1.0,
        description="while the learner updates, the share of the update's time the generation check may "
        "compute: after each chunk of its work it waits that chunk's time x (1 / check_duty - 1), or until "
        "the update ends; between updates it runs freely (check/turns.py). A new identity's check, and one "
        "whose claim is at the admission floor, never wait. 1 = never waits (check_nice alone); 0 = waits "
        "for the update to end",
    )
    check_chunk_tokens: int = Field(
        64,
        ge=1,
        description="completion positions whose logits, seeded noise and nucleus the check holds at once "
        "(peak memory: about 60 x this x vocabulary bytes, whatever the completion's length)",
    )
    engine_precision: FloatDtype = Field(
        "float32",
        description="the precision the run's workers' engines compute in (a run setting, never a worker's "
        "claim): the generation check computes in it too and takes its default tolerances (float32: "
        "log-prob 0.05, draw 0.05; bfloat16: 0.6, 0.5, docs/security.md); bfloat16 for GPU workers in bf16",
    )
    logprob_tolerance: float | None = Field(
        None,
        gt=0.0,
        description="largest |claimed - recomputed| sampler log-prob of a token counted as numerical noise; "
        "unset = engine_precision's (float32 0.05, bfloat16 0.6)",
    )
    gumbel_tolerance: float | None = Field(
        None,
        gt=0.0,
        description="a sampled token whose perturbed score is within this of the best (logit units) "
        "is taken as the seeded draw (numerical noise near ties); unset = engine_precision's (float32 0.05, "
        "bfloat16 0.5)",
    )
    min_logprob: float | None = Field(
        None,
        allow_inf_nan=False,
        description="lowest sampler log-prob a submitted token may carry; unset = the lowest seeded "
        "Gumbel-max can draw at the model's vocabulary (rollout/sampling.py: min_drawn_logprob)",
    )
    max_workers: int = Field(
        64,
        ge=1,
        description="registration slots of the join token: an identity holds one while trusted and heard "
        "from within slot_idle_s, or for slot_idle_s after it was quarantined",
    )
    max_identities: int = Field(
        256,
        ge=1,
        description="identities the join token may register over the whole run (restarts included: "
        "workers.json keeps them): every registration, re-registration and quarantined identity counts, so "
        "an attacker's identities, and what each can get trained before it is caught, are finite "
        "(identity_budget once spent)",
    )
    slot_idle_s: float = Field(
        600.0,
        gt=0.0,
        allow_inf_nan=False,
        description="an identity silent this long (holding no lease) is retired and frees its slot; a "
        "quarantined one frees it this long after it was caught",
    )
    min_usd_per_hour: float = Field(
        0.01, gt=0.0, allow_inf_nan=False, description="lowest price a worker may register with"
    )
    max_usd_per_hour: float = Field(
        100.0, gt=0.0, allow_inf_nan=False, description="highest price a worker may register with"
    )
    max_rollouts_per_s: float = Field(
        10000.0, gt=0.0, description="highest own throughput estimate a worker may register with"
    )
    probation_prompts: int = Field(
        1,
        ge=1,
        description="prompts per lease of a worker on probation (none of its work admitted yet, or an "
        "unreturned lease since)",
    )
    probation_share: float = Field(
        0.125,
        gt=0.0,
        le=1.0,
        description="share of the in-flight budget (leased + buffered rollouts) all workers on "
        "probation may hold together",
    )
    max_unreturned: int = Field(
        3,
        ge=1,
        description="unreturned leases in a row after which a worker is benched (no leases) for "
        "4 x runtime.lease_ttl_s; each one halves its next lease's time to live",
    )
    max_requests_per_s: float = Field(
        50.0,
        gt=0.0,
        allow_inf_nan=False,
        description="API requests per second one identity may make (bursts of twice that); more get 429",
    )
    body_timeout_s: float = Field(
        30.0, gt=0.0, allow_inf_nan=False, description="seconds a request body may take to arrive"
    )
    token_copies_per_hour: float = Field(
        16.0,
        gt=0.0,
        allow_inf_nan=False,
        description="copies of each object the API serves (the model files, the version's manifest, a "
        "snapshot chain, a LoRA run's base) that all identities of the join token together may pull per "
        "hour, beyond a burst of max_workers copies (docs/security.md: what a token holder can pull)",
    )
    perimeter: PerimeterConfig = Field(default_factory=PerimeterConfig)

    def floor(self) -> float:
        """The least share of a proven identity's submissions drawn: ``check_floor``, at most
        ``check_fraction`` (0 there turns the check off)."""
        return min(self.check_floor, self.check_fraction)

    def tolerances(self) -> tuple[float, float]:
        """(log-prob, draw) tolerances of the generation check: the ones set, else the engine
        precision's (ENGINE_TOLERANCES)."""
        lp, draw = ENGINE_TOLERANCES[self.engine_precision]
        return (
            lp if self.logprob_tolerance is None else self.logprob_tolerance,
            draw if self.gumbel_tolerance is None else self.gumbel_tolerance,
        )

    @model_validator(mode="after")
    def _price_range(self) -> SecurityConfig:
        if self.min_usd_per_hour > self.max_usd_per_hour:
            raise ValueError(
                f"min_usd_per_hour={self.min_usd_per_hour} is above max_usd_per_hour={self.max_usd_per_hour}"
            )
        return self
