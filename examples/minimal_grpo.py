"""The whole GRPO algorithm in one readable file (synchronous, one process, CPU).

It borrows only the *inputs* from echo2 — the embedded model's warm-started checkpoint and the
arithmetic task — and writes everything that makes it RL by hand: sampling with per-token
log-probs, the reward, group-normalised advantages, the clipped policy-gradient loss and the
update. `echo2 train` does the same with the reusable pieces (rollout/engines/hf.py,
learner/grpo.py, learner/trainer.py); if the two disagree, one of them has a bug.

    python examples/minimal_grpo.py --minutes 3
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from echo2.config import load_config
from echo2.models.policy import configure_torch, load_checkpoint
from echo2.tasks.registry import build_task
from echo2.tasks.warm_cache import starting_checkpoint


@torch.no_grad()
def sample(
    model,
    prompts_BT: list[list[int]],
    eos: int,
    pad: int,
    max_new: int,
    temperature: float,
    gen: torch.Generator | None,
):
    """Sample one completion per prompt; greedy when ``gen`` is None. No KV cache, for clarity:
    every step re-reads the whole (right-aligned) sequence."""
    width = max(len(p) for p in prompts_BT)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts_BT])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts_BT])
    done = torch.zeros(len(prompts_BT), dtype=torch.bool)
    completions = [[] for _ in prompts_BT]
    logprobs = [[] for _ in prompts_BT]
    for _ in range(max_new):
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1] / temperature
        logp = torch.log_softmax(logits, -1)
        nxt = (
            logits.argmax(-1) if gen is None else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
        )
        for i in range(len(prompts_BT)):
            if not done[i]:
                completions[i].append(int(nxt[i]))
                logprobs[i].append(float(logp[i, nxt[i]]))
        done |= nxt == eos
        if done.all():
            break
        ids = torch.cat([ids, nxt[:, None]], 1)
        mask = torch.cat([mask, (~done).long()[:, None]], 1)
    return completions, logprobs


def completion_logprobs(model, prompts, completions, pad: int, temperature: float):
    """log pi(y_t | x, y_<t) for every completion token: [B, T] log-probs and a 0/1 mask."""
    seqs = [p + c for p, c in zip(prompts, completions, strict=True)]
    L, T = max(map(len, seqs)), max(map(len, completions))
    ids = torch.tensor([s + [pad] * (L - len(s)) for s in seqs])
    attention = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
    logp_all = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits / temperature, -1)
    out, mask = torch.zeros(len(seqs), T), torch.zeros(len(seqs), T)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        positions = torch.arange(len(p) - 1, len(p) - 1 + len(c))  # logits at t-1 predict token t
        out[i, : len(c)] = logp_all[i, positions, torch.tensor(c)]
        mask[i, : len(c)] = 1
    return out, mask


def accuracy(model, task, tok, prompts, eos, pad, max_new) -> float:
    enc = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
    comps, _ = sample(model, enc, eos, pad, max_new, 1.0, gen=None)
    return sum(
        task.grade(p, tok.decode(c, skip_special_tokens=True)).reward
        for p, c in zip(prompts, comps, strict=True)
    ) / len(prompts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--steps", type=int, default=10**9, help="stop after this many updates")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    cfg = load_config(overrides=[f"seed={args.seed}"])  # the embedded default: tiny Qwen3 + arithmetic
    configure_torch(cfg)
    policy = load_checkpoint(starting_checkpoint(cfg))  # the warm start (built and cached on first use)
    model, tok, eos, pad = policy.model, policy.tokenizer, policy.eos_id, policy.pad_id
    task = build_task(cfg.task, cfg.seed)
    P, G = cfg.batch.prompts, cfg.batch.group_size
    temp, max_new, eps = cfg.sampling.temperature, cfg.sampling.max_new_tokens, cfg.grpo.clip_eps
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.grpo.lr, weight_decay=0.0)
    rng, gen = random.Random(args.seed), torch.Generator().manual_seed(args.seed)
    held_out = task.eval_prompts(256)
    print(f"start: held-out accuracy {accuracy(model, task, tok, held_out, eos, pad, max_new):.3f}")

    t0, step = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.minutes * 60 and step < args.steps:
        step += 1
        # 1. rollouts: G samples of each of P prompts from the current policy
        prompts = task.sample_train(rng, P)
        enc = [tok(p.text, add_special_tokens=False)["input_ids"] for p in prompts for _ in range(G)]
        model.eval()
        comps, old_logp = sample(model, enc, eos, pad, max_new, temp, gen)
        # 2. verifiable reward, then group-normalised advantages A = (r - mean) / (std + eps)
        rewards = torch.tensor(
            [
                task.grade(prompts[i // G], tok.decode(c, skip_special_tokens=True)).reward
                for i, c in enumerate(comps)
            ]
        ).view(P, G)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (
            rewards.std(1, unbiased=False, keepdim=True) + 1e-6
        )
        adv = adv.flatten()[:, None]
        # 3. clipped policy gradient, token-mean aggregation
        model.train()
        logp, mask = completion_logprobs(model, enc, comps, pad, temp)
        old = torch.zeros_like(logp)
        for i, lp in enumerate(old_logp):
            old[i, : len(lp)] = torch.tensor(lp)
        ratio = torch.exp(logp - old)
        surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)
        loss = -(surrogate * mask).sum() / mask.sum()
        # 4. update
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grpo.max_grad_norm)
        opt.step()
        if step % 50 == 0:
            acc = accuracy(model, task, tok, held_out, eos, pad, max_new)
            print(
                f"step {step:4d}  {time.perf_counter() - t0:5.0f}s  reward {rewards.mean():.3f}  "
                f"held-out accuracy {acc:.3f}"
            )
    print(
        f"end after {step} steps: held-out accuracy "
        f"{accuracy(model, task, tok, held_out, eos, pad, max_new):.3f}"
    )


if __name__ == "__main__":
    main()
