"""The names other modules imported before the model became a standard HF decoder.

Kept so code written against the old byte-level TinyLM still imports: ``TinyLM`` is the
decoder (``decoder.CausalLM``), and the token ids are the embedded tokenizer's. New code
imports ``gyre_hpc.models.decoder`` and takes token ids and the vocabulary size from the
tokenizer or the model config, never from here.
"""
from gyre_hpc.models.decoder import PRESETS, AttentionFn, CausalLM, LMConfig, PastKV, build_model, init_weights
from gyre_hpc.models.tokenizer import EMBEDDED_VOCAB_SIZE, SPECIAL_TOKENS

TinyLM = CausalLM
VOCAB_SIZE = EMBEDDED_VOCAB_SIZE
PAD_ID = SPECIAL_TOKENS.index("<|endoftext|>")
# The embedded chat format has no BOS token; every prompt starts with <|im_start|>.
BOS_ID = SPECIAL_TOKENS.index("<|im_start|>")
EOS_ID = SPECIAL_TOKENS.index("<|im_end|>")

__all__ = ["PRESETS", "AttentionFn", "CausalLM", "LMConfig", "PastKV", "TinyLM", "build_model", "init_weights",
           "VOCAB_SIZE", "PAD_ID", "BOS_ID", "EOS_ID"]
