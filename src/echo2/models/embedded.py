"""The embedded policy: a small Qwen3-architecture causal LM and a character-level tokenizer that
echo2 builds locally, so the default run needs no download.

The tokenizer is a ``tokenizers`` WordLevel model over printable ASCII (one token per character)
wrapped as a transformers fast tokenizer; both save and load with ``save_pretrained`` /
``from_pretrained`` (safetensors), exactly like any HF checkpoint a user brings.
"""

from __future__ import annotations

import string

from echo2.config import EmbeddedModelConfig

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def build_tokenizer():  # -> PreTrainedTokenizerFast
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *CHARACTERS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=PAD, unk_token=UNK)


def build_model(cfg: EmbeddedModelConfig, tokenizer, seed: int):  # -> Qwen3ForCausalLM
    """A freshly initialised ``Qwen3ForCausalLM`` of the configured shape (deterministic in ``seed``)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.hidden_size // cfg.num_heads,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3ForCausalLM(config)
