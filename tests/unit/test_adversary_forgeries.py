"""The benchmark attackers' forgeries are forgeries: a ``prompt`` attacker never answers with the
tokens of a prompt it was actually leased (a small task can lease "1+1=" itself)."""

from __future__ import annotations

from types import SimpleNamespace

from echo2.protocol import LeasedPrompt, LeaseGrant
from echo2.types import Trajectory
from echo2_bench.adversary import FORGE


def _codec() -> SimpleNamespace:
    return SimpleNamespace(encode_prompt=lambda text: [ord(c) for c in text])


def test_prompt_forgery_never_uses_a_leased_prompt() -> None:
    codec = _codec()
    leased = [LeasedPrompt(prompt_id=t[:-1], text=t) for t in ("1+1=", "2+2=", "7+4=")]
    lease = LeaseGrant(lease_id="l", prompts=leased, group_size=1, min_version=0, expires_in_s=1.0, seed=0)
    groups = [
        [Trajectory(p.prompt_id, f"l:{i}", tuple(codec.encode_prompt(p.text)), (1,), (0.0,), 0.0, 0)]
        for i, p in enumerate(leased)
    ]
    att = SimpleNamespace(w=SimpleNamespace(codec=codec))
    forged = FORGE["prompt"](att, groups, lease, None)
    want = tuple(codec.encode_prompt("3+3="))  # the first of 1+1=, 2+2=, ... that was not leased
    assert [t.prompt_ids for g in forged for t in g] == [want] * 3
    assert all(t.prompt_id == p.prompt_id for g, p in zip(forged, leased, strict=True) for t in g)
