"""Forward and backward of a packed row in chunks: any path length, memory bounded by the chunk.

A row longer than ``chunk_tokens`` (a tree with a path deeper than ``train.row_tokens``,
which packing keeps whole rather than repeating its ancestors row after row) runs in
chunks [s, e) of at most ``chunk_tokens`` tokens. Chunk i's queries attend to the keys and
values of every earlier chunk (tree mask over the whole row), and the gradient flows
through them exactly, in two passes:

1. forward, no grad, chunk by chunk: each layer's keys and values of the whole row are
   kept (detached; 2 x layers x T x d values, like a KV cache), activations are not;
2. backward, last chunk first: chunk i is recomputed with grad, its earlier chunks' keys
   and values entering as leaf tensors. Backpropagating its loss together with the
   gradient that later chunks sent to *its own* keys and values gives the parameters'
   gradient of everything downstream of chunk i, plus the gradient for the earlier keys
   and values, which is added into their accumulators for the chunks still to come.

Only one chunk's activations exist at a time; what grows with the row is two
KV-cache-sized buffers (values and their gradients). Recomputation is deterministic, so
the result is the full row's loss and gradient to rounding: the float64 tests hold it to
the call-by-call reference. The loss of chunk i is that of the tokens whose *predecessor*
(whose logits score them) lies in chunk i, so each trained token is scored once.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from gyre_hpc.trees.attention import tree_attention
from gyre_hpc.trees.loss import LogprobGap, StepWeights, head_loss, invariant_kwargs, packed_loss
from gyre_hpc.trees.packing import PackedBatch
from gyre_hpc.trees.token_logprobs import LOGIT_CHUNK_TOKENS


def chunk_bounds(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    return [(s, min(n_tokens, s + chunk_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def _forward_chunk(model, batch: PackedBatch, s: int, e: int, past, attention: str, head: bool = True,
                   checkpoint_layers: bool = False):
    attention_fn = tree_attention(attention, batch.subtree_end[:, :e], needs_grad=torch.is_grad_enabled(),
                                  q_len=e - s, kv_len=e, position_ids=batch.position_ids)
    return model(batch.input_ids[:, s:e], batch.position_ids[:, s:e], past_kv=past, use_cache=True,
                 attention_fn=attention_fn, head=head, checkpoint_layers=checkpoint_layers,
                 **invariant_kwargs(attention_fn))


def _chunk_batch(batch: PackedBatch, s: int, e: int) -> PackedBatch:
    """The batch as seen by chunk [s, e)'s logits: only tokens scored there, predecessors
    local, and only the targets (samples) of those tokens."""
    pred = batch.pred_index
    mask = batch.loss_mask & (pred >= s) & (pred < e)
    keep = mask[batch.sample_row, batch.sample_index]
    return replace(batch, loss_mask=mask, pred_index=pred - s, sample_row=batch.sample_row[keep],
                   sample_index=batch.sample_index[keep], sample_logprobs=batch.sample_logprobs[keep],
                   sample_run=batch.sample_run[keep])


def backward_packed(model: torch.nn.Module, batch: PackedBatch, weights: StepWeights, clip_eps: float,
                    attention: str = "auto", chunk_tokens: int | None = None, gap: LogprobGap | None = None,
                    logit_chunk_tokens: int = LOGIT_CHUNK_TOKENS, checkpoint_layers: bool = False) -> float:
    """Accumulate this micro-batch's loss gradient into the parameters; return its loss.

    Rows of at most ``chunk_tokens`` tokens (or any row, with ``chunk_tokens=None``) take the
    plain path (one forward, ``loss.backward()``); longer rows go chunk by chunk (module doc).
    Either way the output head runs ``logit_chunk_tokens`` loss tokens at a time
    (``trees.token_logprobs``). ``checkpoint_layers`` (``train.activation_checkpointing``):
    each layer recomputed in the backward, one layer's activations held at a time. ``gap``
    collects the trainer-vs-behaviour logprob figures of every target.
    """
    L = batch.shape[1]
    if chunk_tokens is None or L <= chunk_tokens:
        loss = packed_loss(model, batch, weights, clip_eps, attention, gap, logit_chunk_tokens, checkpoint_layers)
        loss.backward()
        return float(loss.detach())
    bounds = chunk_bounds(L, chunk_tokens)
    # Pass 1: keys and values of the whole row, layer by layer (each chunk's `present` is the
    # concatenation of the past it was given and its own).
    keys_values = None
    with torch.no_grad():
        for s, e in bounds:
            _, keys_values = _forward_chunk(model, batch, s, e, keys_values, attention, head=False)
    grads = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in keys_values]
    total = 0.0
    # Pass 2: last chunk first, so a chunk's own keys and values have all their gradient.
    for i in range(len(bounds) - 1, -1, -1):
        s, e = bounds[i]
        past = None
        if s > 0:
            past = [(k[:, :, :s].detach().requires_grad_(), v[:, :, :s].detach().requires_grad_())
                    for k, v in keys_values]
            # Each layer's gradient for the earlier keys and values goes into the accumulators
            # as soon as the backward reaches it, and is freed: kept on the leaves until the
            # backward ends, every layer's would be held at once (2 x layers x s x kv width).
            for pair, dpair in zip(past, grads):
                for leaf, acc in zip(pair, dpair):
                    leaf.register_post_accumulate_grad_hook(_drain_into(acc[:, :, :s]))
        chunk = _chunk_batch(batch, s, e)
        last = i == len(bounds) - 1
        if last and not bool(chunk.loss_mask.any()):
            continue  # nothing scored here and nothing downstream
        hidden, present = _forward_chunk(model, batch, s, e, past, attention, head=False,
                                         checkpoint_layers=checkpoint_layers)
        outputs, upstream = [], []
        if bool(chunk.loss_mask.any()):
            loss = head_loss(hidden, model.output_weight, chunk, weights, clip_eps, gap, logit_chunk_tokens,
                             attention == "invariant")
            total += float(loss.detach())
            outputs.append(loss)
            upstream.append(torch.ones_like(loss))
        if not last:
            for (k, v), (dk, dv) in zip(present, grads):
                # Copies of the chunk's own keys and values: views would keep every layer's
                # whole-row concatenation (s + chunk keys) alive until the backward ends.
                outputs += [k[:, :, s:e].clone(), v[:, :, s:e].clone()]
                upstream += [dk[:, :, s:e], dv[:, :, s:e]]
        del present
        torch.autograd.backward(outputs, upstream)
    return total


def _drain_into(acc: torch.Tensor):
    """A post-accumulate-grad hook adding a leaf's gradient into ``acc`` and dropping it."""
    def drain(leaf: torch.Tensor) -> None:
        acc.add_(leaf.grad)
        leaf.grad = None
    return drain
