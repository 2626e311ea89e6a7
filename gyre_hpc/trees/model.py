"""The data model shared by the builder, admission, packing, loss and the Zarr store.

A ``Tree`` is a prefix-shared trie of one agent run's model calls, flattened depth-first:
node i's tokens are ``tokens[node_start[i]:node_start[i]+node_len[i]]`` and
``parent[i] < i`` (-1 for the root), so a subtree is a contiguous token interval. That
layout is what makes the attention rule "a token sees its ancestors and itself" an
interval test, and what lets the store append a tree as flat 1-D arrays.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ROLES = ("main", "subagent", "summary")
# How a position that several calls sampled is trained (``train.shared_targets``): ``once``
# (the paper's tree-mask rule: one target, the first call's behaviour logprob) or
# ``per_sample`` (one target per sampling event, each with its own behaviour logprob: the
# score-function estimator of the run's gradient). docs/trees.md says why per_sample is the default.
SHARED_TARGETS = ("once", "per_sample")
ROLE_CODE = {r: i for i, r in enumerate(ROLES)}
STATUSES = ("finished", "timeout", "failed")


@dataclass(frozen=True)
class ModelCall:
    """One model call as the harness journal records it.

    ``prompt`` is the exact token context the model was conditioned on (tool outputs and
    environment text included), ``output`` the tokens it sampled and ``logprobs`` their
    behaviour log-probabilities under the policy that sampled them.
    """

    prompt: np.ndarray
    output: np.ndarray
    logprobs: np.ndarray
    role: str = "main"
    agent: str = "main"
    policy_version: int = 0

    def __post_init__(self) -> None:
        check_call_record(self, "prompt")


def check_call_record(call, tokens: str) -> None:
    """A frozen call record's arrays as 1-D int32 (``tokens``, ``output``) and float32
    (``logprobs``), its role known and one logprob per output token (``ModelCall``, and the
    journal's ``calls.CallIncrement``)."""
    kind = type(call).__name__
    for name, dtype in ((tokens, np.int32), ("output", np.int32), ("logprobs", np.float32)):
        object.__setattr__(call, name, np.asarray(getattr(call, name), dtype=dtype).reshape(-1))
    if call.role not in ROLE_CODE:
        raise ValueError(f"{kind}.role={call.role!r}: valid roles are {', '.join(ROLES)}")
    if call.logprobs.shape != call.output.shape:
        raise ValueError(f"{kind}.logprobs has {call.logprobs.size} values for {call.output.size} output tokens")


@dataclass
class Tree:
    """One run as a prefix-shared token tree (see module docstring for the layout)."""

    tokens: np.ndarray          # int32 [T]
    logprobs: np.ndarray        # float32 [T], behaviour logprob where trained, 0 elsewhere
    trained: np.ndarray         # bool [T], True exactly once per policy-sampled token
    node_start: np.ndarray      # int64 [N]
    node_len: np.ndarray        # int32 [N]
    parent: np.ndarray          # int32 [N], -1 for roots
    node_role: np.ndarray       # int8 [N], ROLE_CODE of the call that first created the node
    call_node: np.ndarray       # int32 [C], node at whose end call c's prompt+output path ends
    call_role: np.ndarray       # int8 [C]
    call_agent: list[str]       # [C]
    run_id: str = ""
    task_id: str = ""
    reward: float = 0.0
    status: str = "finished"
    policy_version: int = 0
    wall_s: float = 0.0
    # Calls that admission left out (indices into the original journal), never silently dropped.
    dropped_calls: list[int] = field(default_factory=list)
    # Sampling events, one per (call, generated position), sorted by token then journal order:
    # ``sample_token`` (tree-local token index), ``sample_logprob`` (that call's own behaviour
    # logprob), ``sample_run`` (run within a group forest, 0 in a run's own tree),
    # ``sample_call`` (journal index of the sampling call, -1 unknown). None (a tree of schema 1,
    # or built by hand) means one sample per trained token with ``logprobs``.
    sample_token: np.ndarray | None = None     # int64 [S]
    sample_logprob: np.ndarray | None = None   # float32 [S]
    sample_run: np.ndarray | None = None       # int32 [S]
    sample_call: np.ndarray | None = None      # int32 [S]
    n_runs: int = 1                            # runs a group forest holds; 1 for a run's tree

    def __post_init__(self) -> None:
        if self.sample_token is None:
            self.sample_token = np.flatnonzero(np.asarray(self.trained, dtype=bool)).astype(np.int64)
            self.sample_logprob = np.asarray(self.logprobs, dtype=np.float32)[self.sample_token]
        if self.sample_logprob is None:
            raise ValueError("Tree.sample_logprob is missing while sample_token is given")
        if self.sample_run is None:
            self.sample_run = np.zeros(np.asarray(self.sample_token).size, dtype=np.int32)
        if self.sample_call is None:
            self.sample_call = np.full(np.asarray(self.sample_token).size, -1, dtype=np.int32)

    @property
    def multiplicity(self) -> np.ndarray:
        """Calls that sampled each token (0 where the policy did not generate it)."""
        return np.bincount(self.sample_token, minlength=self.n_tokens).astype(np.int32)

    def targets(self, shared_targets: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(token, behaviour logprob, run) of each target under the rule (see SHARED_TARGETS).

        ``once`` keeps the first sample of each (token, run): in a run's own tree that is the
        first call in journal order that generated the position, the builder's ``logprobs``.
        """
        if shared_targets == "per_sample":
            return self.sample_token, self.sample_logprob, self.sample_run
        if shared_targets != "once":
            raise ValueError(f"shared_targets={shared_targets!r}: valid rules are {', '.join(SHARED_TARGETS)}")
        key = self.sample_token * max(self.n_runs, 1) + self.sample_run
        first = np.ones(key.size, dtype=bool)
        first[1:] = key[1:] != key[:-1]     # samples are sorted by token, runs ascending within one
        return self.sample_token[first], self.sample_logprob[first], self.sample_run[first]

    def n_targets(self, shared_targets: str) -> np.ndarray:
        """Targets per run of the tree under the rule: the run's token count for averaging."""
        return np.bincount(self.targets(shared_targets)[2], minlength=self.n_runs).astype(np.int64)

    @property
    def n_tokens(self) -> int:
        return int(self.tokens.size)

    @property
    def n_nodes(self) -> int:
        return int(self.node_start.size)

    @property
    def n_paths(self) -> int:
        return int(self.call_node.size)

    def node_path(self, call: int) -> list[int]:
        """Nodes from the root to the end of call ``call``'s prompt+output, root first."""
        nodes = []
        node = int(self.call_node[call])
        while node >= 0:
            nodes.append(node)
            node = int(self.parent[node])
        return nodes[::-1]

    def path(self, call: int) -> np.ndarray:
        """Exactly the tokens call ``call`` saw and produced: its prompt followed by its output."""
        parts = [self.tokens[self.node_start[n]:self.node_start[n] + self.node_len[n]] for n in self.node_path(call)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
