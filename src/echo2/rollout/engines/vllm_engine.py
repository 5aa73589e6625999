"""Rollout engine on vLLM (``echo2 worker --engine vllm``): vLLM's scheduler, paged KV cache and
kernels, echo2's seeded sampler, and new weights loaded into the running engine.

- **Sampling.** Every request is a greedy vLLM request whose draw :class:`~echo2.rollout.engines.
  vllm_sampler.Echo2Sampler` makes (a vLLM logits processor): the token is the seeded Gumbel-max draw of
  :mod:`echo2.rollout.sampling`, bit for bit the HF engine's on the same logits, and the log-prob vLLM
  reports (``logprobs_mode="processed_logits"``, ``logprobs=0``) is ``log_softmax(logits / T)`` of that
  token: the convention of :mod:`echo2.rollout.engines.base`. The learner's seeded re-check therefore
  holds a vLLM worker to the same standard as an HF one.
- **Installs.** The engine starts with placeholder weights (``load_format="dummy"``); every version,
  the first included, goes in through vLLM's in-place reload (``collective_rpc("reload_weights",
  weights_iterator=...)``, the path vLLM's RL weight updates use) after echo2 checked every name and
  shape, then the prefix cache is dropped. ``LLM.generate`` is synchronous and the worker holds its
  engine lock across both calls, so no completion mixes two versions and each carries the version it
  was sampled under (``rollout/worker.py``).
- **LoRA, natively** (``EngineOptions.lora_rank``, a LoRA run with ``lora.vllm = "native"``): vLLM is
  built with ``enable_lora``; the base goes in once through the reload above, and each published
  adapter is written as a PEFT adapter directory and loaded as a LoRA request of its own
  (``add_lora``) that every later ``generate`` uses; the previous one is removed once the new one
  loaded, and an adapter vLLM refuses leaves the previous one serving.
- **Process and thread.** The engine core runs in the worker's process
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): the sampler class and the weights are handed over by
  reference, not serialised. Every vLLM call (construction included) runs on one thread the engine
  owns: vLLM is not thread-safe, and its CPU attention checks that it runs with the OpenMP threads it
  was set up with, which are per thread. One GPU (or the host), no tensor parallelism.

vLLM is an optional dependency: :func:`require_vllm` says in one line what to install when it is
missing or broken (``scripts/install-vllm.sh``).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from echo2.config import SamplingConfig
from echo2.errors import CheckpointError, ConfigError
from echo2.models.snapshot import check_snapshot, snapshot_layout
from echo2.rollout.engines.base import EngineOptions, EosIds, Sample, eos_tuple

if TYPE_CHECKING:
    from echo2.models.snapshot import SnapshotLayout

INSTALL_HINT = "bash scripts/install-vllm.sh (or pip install 'echo2[vllm]' on a CUDA machine)"


def require_vllm() -> Any:
    """The ``vllm`` module, or a :class:`ConfigError` saying in one line what to install or remove.
    vLLM logs warnings and errors only (``VLLM_LOGGING_LEVEL`` overrides): a worker installs a version
    every learner step, and vLLM's per-reload lines would drown the worker's log."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":
            raise ConfigError(f"the vLLM engine cannot import {exc.name!r}: {INSTALL_HINT}") from None
        raise ConfigError(f"the vLLM engine needs the vllm package: {INSTALL_HINT}") from None
    except (ImportError, OSError, RuntimeError) as exc:  # e.g. a torchvision built for another torch
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"vllm is installed but does not import ({first}): {INSTALL_HINT}") from None
    # the in-place reload warns on every install that the rotary embedding (no weights) got none
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    return vllm


class VLLMEngine:
    """Samples completions with vLLM; implements the :class:`~echo2.rollout.engines.base.Engine` seam."""

    def __init__(
        self,
        llm: Any,
        layout: SnapshotLayout,
        eos_id: EosIds,
        sampling: SamplingConfig,
        thread: ThreadPoolExecutor | None = None,
    ) -> None:
        self.llm = llm
        self._thread = thread or ThreadPoolExecutor(1, thread_name_prefix="echo2-vllm")  # every vLLM call
        self.layout = layout  # the weights a snapshot must carry, and the tied names vLLM also wants
        self.eos_ids = eos_tuple(eos_id)  # every token that ends a completion
        self.sampling = sampling
        self.last_install_s = 0.0  # seconds the engine took to load the last version (a metric)
        self._serving: Mapping[str, Any] | None = None  # the version loaded (the worker's own tensors)
        self.serves_lora = False  # built with enable_lora: adapters go in by install_adapter
        self._lora: Any = None  # the LoRA request every generate uses (the adapter installed last)
        self._lora_dir: Any = None  # a TemporaryDirectory holding the adapters' PEFT directories

    @classmethod
    def from_skeleton(
        cls,
        skeleton_dir: Path,
        eos_id: EosIds,
        pad_id: int,
        sampling: SamplingConfig,
        options: EngineOptions | None = None,
    ) -> VLLMEngine:
        """A vLLM engine on the skeleton's architecture with placeholder weights (the first install
        fills them). Reads ``skeleton_dir`` only here."""

        opts = options or EngineOptions()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        vllm = require_vllm()
        import torch

        from echo2.rollout.engines.vllm_sampler import Echo2Sampler

        eager = opts.eager if opts.eager is not None else not torch.cuda.is_available()
        kwargs: dict[str, Any] = {
            "model": str(skeleton_dir),
            "load_format": "dummy",  # every weight arrives in a snapshot
            "skip_tokenizer_init": True,  # token ids in, token ids out
            "dtype": opts.dtype,
            "logits_processors": [Echo2Sampler],
            "logprobs_mode": "processed_logits",
            "gpu_memory_utilization": opts.memory,
            "enforce_eager": eager,
            "seed": 0,
        }
        if opts.lora_rank is not None:  # vLLM reserves its LoRA slots for one of its allowed ranks
            allowed = [r for r in (1, 8, 16, 32, 64, 128, 256, 320, 512) if r >= opts.lora_rank]
            if not allowed:
                raise ConfigError(f"lora.r = {opts.lora_rank}: vLLM serves LoRA ranks up to 512")
            kwargs.update(enable_lora=True, max_lora_rank=allowed[0], max_loras=1)
        if opts.max_context:  # never beyond the model's own limit, which vLLM refuses
            limit = json.loads((skeleton_dir / "config.json").read_text()).get("max_position_embeddings")
            kwargs["max_model_len"] = min(opts.max_context, limit or opts.max_context)
        thread = ThreadPoolExecutor(1, thread_name_prefix="echo2-vllm")
        try:
            llm = thread.submit(vllm.LLM, **kwargs).result()
        except (ValueError, RuntimeError, TypeError) as exc:
            thread.shutdown()
            raise CheckpointError(f"vLLM cannot serve the model in {skeleton_dir.name}: {exc}") from exc
        engine = cls(llm, snapshot_layout(skeleton_dir), eos_id, sampling, thread)
        engine.serves_lora = opts.lora_rank is not None
        return engine

    def install(self, weights: Mapping[str, Any]) -> None:
        """Load a whole verified version into the running engine (names and shapes checked first, so a
        snapshot that does not fit changes nothing), then drop cached prefixes of the old weights.
        vLLM's reload is not transactional: if it fails part-way, the version served before is loaded
        back and :class:`CheckpointError` says so."""

        check_snapshot(weights, self.layout.shapes)
        t0 = time.perf_counter()
        try:
            self._thread.submit(self._reload, weights).result()
        except Exception as exc:  # vLLM raises many kinds; the engine must not keep half a version
            if self._serving is None:
                raise CheckpointError(f"vLLM could not load the first version: {exc}") from exc
            self._thread.submit(self._reload, self._serving).result()
            msg = f"vLLM failed loading the new version ({exc}); the old one is back"
            raise CheckpointError(msg) from exc
        self._serving = weights
        self.last_install_s = time.perf_counter() - t0

    def install_adapter(self, adapter: Mapping[str, Any], scale: float) -> None:
        """Serve a published LoRA adapter (its tensors by their live names, ``lora.adapter_copy``) on the
        installed base, as vLLM's own LoRA request; the one served before stays if vLLM refuses it."""
        import tempfile

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        from echo2.models.lora import LORA_A, LORA_B

        if not self.serves_lora:
            raise CheckpointError("this vLLM engine was built without LoRA (EngineOptions.lora_rank)")
        if self._lora_dir is None:
            self._lora_dir = tempfile.TemporaryDirectory(prefix="echo2-lora-")
        t0 = time.perf_counter()
        n = 1 if self._lora is None else self._lora.lora_int_id + 1
        tensors, modules, rank = {}, set(), 0
        for name, t in adapter.items():  # live names (lora.LORA_A / LORA_B) to PEFT's file names
            kind = "A" if name.endswith(LORA_A) else "B" if name.endswith(LORA_B) else None
            if kind is None:
                raise CheckpointError(f"{name} is no LoRA adapter tensor")
            head = name[: -len(LORA_A if kind == "A" else LORA_B)]
            tensors[f"base_model.model.{head}.lora_{kind}.weight"] = t.detach().cpu().contiguous()
            modules.add(head.rsplit(".", 1)[-1])
            rank = int(t.shape[0]) if kind == "A" else rank
        folder = Path(self._lora_dir.name) / f"v{n}"
        folder.mkdir()
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "lora_dropout": 0.0,
                  "target_modules": sorted(modules), "bias": "none", "task_type": "CAUSAL_LM"}  # fmt: skip
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        request = LoRARequest(f"v{n}", n, str(folder))
        try:
            self._thread.submit(self.llm.llm_engine.add_lora, request).result()
        except Exception as exc:  # vLLM raises many kinds; the adapter served before stays
            raise CheckpointError(f"vLLM refused the adapter: {exc}") from exc
        old, self._lora = self._lora, request
        if old is not None:
            self._thread.submit(self.llm.llm_engine.remove_lora, old.lora_int_id).result()
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.last_install_s = time.perf_counter() - t0

    def _reload(self, weights: Mapping[str, Any]) -> None:
        named = list(self.layout.untied(weights).items())
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        self.llm.reset_prefix_cache()

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        seed: int,
        greedy: bool = False,
        max_new_tokens: int | None = None,
        rows: Sequence[int] | None = None,
        first_steps: Sequence[int] | None = None,
    ) -> list[Sample]:
        """One completion per entry of ``prompts``; the same draws as the HF engine on the same logits."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from echo2.rollout.engines.vllm_sampler import EXTRA_KEY

        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        steps = max_new_tokens or self.sampling.max_new_tokens
        params = [
            SamplingParams(
                temperature=0.0,  # the draw is Echo2Sampler's; vLLM takes its argmax
                max_tokens=steps,
                logprobs=0,  # the sampled token's processed logit = its sampler log-prob
                detokenize=False,
                ignore_eos=True,  # the tokenizer's EOS is not necessarily the run's
                stop_token_ids=list(self.eos_ids),
                extra_args={
                    EXTRA_KEY: {
                        "seed": seed,
                        "row": b if rows is None else int(rows[b]),
                        "first_step": 0 if first_steps is None else int(first_steps[b]),
                        "temperature": self.sampling.temperature,
                        "top_p": self.sampling.top_p,
                        "greedy": greedy,
                    }
                },
            )
            for b in range(len(prompts))
        ]
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        lora = {"lora_request": self._lora} if self._lora is not None else {}
        outputs = self._thread.submit(self.llm.generate, requests, params, use_tqdm=False, **lora).result()
        return [_sample(out.outputs[0], self.eos_ids) for out in outputs]


def _sample(completion: Any, eos_ids: tuple[int, ...]) -> Sample:
    ids = tuple(int(t) for t in completion.token_ids)
    logprobs = tuple(float(step[tok].logprob) for tok, step in zip(ids, completion.logprobs, strict=True))
    return Sample(completion_ids=ids, logprobs=logprobs, finished=bool(ids) and ids[-1] in eos_ids)
