"""The wire protocol's trajectory codec: what the worker sends, the validator admits and the store
keeps is one format, and decoding gives back exactly what was encoded."""

from __future__ import annotations

import pytest

from echo2.data.submission import SubmissionLimits, parse_model, validate_submission
from echo2.protocol import SubmitRequest, decode_group, encode_group, group_id, group_to_wire
from echo2.types import Trajectory


def _group(n: int = 3) -> tuple[Trajectory, ...]:
    return tuple(
        Trajectory(
            prompt_id="7+5",
            group_id=group_id("L1", 0),
            prompt_ids=(3, 4, 5),
            completion_ids=(9, 1 + i),
            sampler_logprobs=(-0.25, -1.5 - i),
            reward=float(i % 2),
            policy_version=4,
            meta={"parsed": True, "finished": i == 0, "note": None, "len": 2},
        )
        for i in range(n)
    )


def test_store_encoding_round_trips_exactly():
    g = _group()
    assert decode_group(encode_group(g), group_id("L1", 0), 4) == g


def test_what_a_worker_sends_is_what_the_store_gets_back():
    g = _group()
    body = SubmitRequest(lease_id="L1", policy_version=4, groups=[group_to_wire(g)]).model_dump_json()
    limits = SubmissionLimits(
        vocab_size=16, group_size=3, max_prompt_tokens=8, max_completion_tokens=4, max_groups=1
    )
    sub = validate_submission(parse_model(SubmitRequest, body.encode()), limits, latest_published=4)
    assert sub.groups == (g,)
    assert decode_group(encode_group(sub.groups[0]), group_id("L1", 0), 4) == g


def test_an_empty_group_is_not_a_group():
    with pytest.raises(ValueError, match="at least one"):
        group_to_wire(())
