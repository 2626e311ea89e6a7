"""What ``bench xlong`` measures on a finished xLong step, each in its own process.

Every function here takes the run directory's own artefacts (a run's journal, the step's
trees, the warm-start checkpoint the step started from) and puts its figures on a queue
(``bench.scale.in_child`` runs it in a fresh process, so an RSS is that measurement's own).

- ``measure_run``: one run's journal loaded (the memory its calls hold: the harness's
  increments), its tokens and roles, how it ended, ``build_tree`` from the increments beside
  ``build_tree`` fed every whole prompt (the two trees must be identical), a store append and
  ``pack`` of its tree.
- ``time_builds``: both builds timed for every run, the runs in turn.
- ``measure_call_costs``: the cost of each of the run's calls through the code a live call
  runs, replayed from the journal in order: the prompt assembled from its context segments and
  made a client request (``TokenContext.array``, the ids the router sends), the journal record
  appended with its fsync (``JournalWriter.append``), and the engine's prefill of it behind the
  session's retained context (``TorchEngine`` with the step's starting weights, one sampled
  token). Then the whole call (``whole_call``): every call once more, and the first and last
  tenth of the calls, which the ratio compares, once again (the least of the two): the same
  request as the live run's, its seed, sampling and stop tokens, so the engine prefills and
  decodes the very output the journal holds (``outputs_reproduced`` counts the calls whose
  tokens match; a step-1 run was sampled by these weights, and the kernels are
  batch-invariant) and keeps it as the live engine kept it. Replayed rather than timed in the
  live run so a call's figure is its own cost, not the queueing of seven other runs on two
  shared cores.
- ``check_loss``: the training step's loss recomputed from the stored trees with the
  trainer's packing and kernels (forward only) and by the call-by-call float64 reference
  (``trees.reference``), with the step's rewards and with rewards that make every advantage
  non-zero (a group whose runs all score alike has advantage 0 and a loss of 0 whatever the
  trainer computes).
"""
from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np


def ended_by(log, status: str, max_turns: int) -> str:
    """How a run ended: ``finish`` (the main agent's last call finished it), ``turn_budget``
    (its main turns ran out), ``wall_clock`` (the run timeout), ``failed``."""
    from gyre_hpc.harness.actions import parse_action

    if status == "timeout":
        return "wall_clock"
    if status == "failed":
        return "failed"
    mains = [i for i in log.increments if i.agent == "main" and i.role == "main"]
    if mains and parse_action(mains[-1].output).tool == "finish":
        return "finish"
    return "turn_budget" if len(mains) >= max_turns else "other"


def measure_run(journal: str, max_turns: int, row_tokens: int, workdir: str, queue) -> None:
    from gyre_hpc.bench.scale import load_held
    from gyre_hpc.trees.builder import build_tree
    from gyre_hpc.trees.packing import pack
    from gyre_hpc.trees.store import TreeStore

    state, load_s, held, traced = load_held(journal)
    log = state.calls
    incs = log.increments
    roles = {r: sum(i.role == r for i in incs) for r in ("main", "subagent", "summary")}
    context = sum(i.prompt_len for i in incs)
    outputs = sum(int(i.output.size) for i in incs)
    meta = dict(run_id=state.run_id, task_id=state.task_id, reward=state.reward or 0.0,
                status=state.status if state.finished else "finished")
    # Built once here, timed across the runs by ``time_builds``.
    tree = build_tree(log, **meta)
    whole = build_tree(list(log), **meta)       # every prompt whole: the baseline's input
    identical = all(np.array_equal(getattr(tree, f), getattr(whole, f))
                    for f in ("tokens", "logprobs", "trained", "node_start", "node_len", "parent", "node_role",
                              "call_node", "sample_token", "sample_logprob", "sample_call"))
    del whole
    t0 = time.perf_counter()
    with TreeStore.open(Path(workdir) / f"{state.run_id}.zarr", "a") as store:
        store.append([tree])
    store_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    rows = pack([tree], row_tokens)
    pack_s = time.perf_counter() - t0
    queue.put({
        "run_id": state.run_id, "task_id": state.task_id, "status": state.status, "reward": state.reward,
        "wall_s": state.wall_s, "ended_by": ended_by(log, state.status, max_turns),
        "calls": len(log), "roles": roles, "context_tokens": context, "output_tokens": outputs,
        "journal_tokens": log.unique_tokens, "tree_tokens": tree.n_tokens,
        "trained_tokens": int(tree.trained.sum()), "sharing_ratio": (context + outputs) / max(tree.n_tokens, 1),
        "journal_bytes": Path(journal).stat().st_size, "journal_load_s": load_s,
        "harness_held_mb": traced / 2**20, "harness_rss_mb": held / 2**20,
        "build_identical": bool(identical),
        "store_append_s": store_s, "pack_s": pack_s, "packed_rows": len(rows),
    })


def window_size(calls: int, share: float = 0.1) -> int:
    """Calls in the first (and in the last) ``share`` of a run of ``calls``: what
    ``tail_ratio`` compares."""
    return max(1, math.ceil(share * calls))


def window_calls(calls: int, share: float = 0.1) -> set[int]:
    """Indices of the calls in the first and the last ``share`` of a run of ``calls``."""
    n = window_size(calls, share)
    return set(range(min(n, calls))) | set(range(max(0, calls - n), calls))


BUILD_TRIES = 50        # ~5 ms a build from increments
WHOLE_BUILD_TRIES = 7   # ~40 ms from every whole prompt


def time_builds(journals: list[str], queue) -> None:
    """Each run's least CPU time of ``build_tree`` from its increments (``BUILD_TRIES``) and
    from every whole prompt (``WHOLE_BUILD_TRIES``), the runs taken in turn each round. Why in
    turn: on a shared host a slow spell lasts seconds, longer than one run's tries, and timed
    one run after the other it landed on some runs only (a 430-call run's least of 25 at 7.4
    ms against 5.1 ms for its twin, and a growth exponent of 0.47); in turn it lands on all."""
    from gyre_hpc.harness.journal import load_journal
    from gyre_hpc.trees.builder import build_tree

    logs = [load_journal(j).calls for j in journals]
    wholes = [list(log) for log in logs]

    def least(inputs: list, tries: int) -> list[float]:
        best = [math.inf] * len(inputs)
        for _ in range(tries):
            for i, x in enumerate(inputs):
                t0 = time.process_time()
                build_tree(x)
                best[i] = min(best[i], time.process_time() - t0)
        return best

    queue.put({"build_s": least(logs, BUILD_TRIES), "build_whole_prompts_s": least(wholes, WHOLE_BUILD_TRIES)})


def tail_ratio(costs: list[float], share: float = 0.1) -> dict:
    """Mean cost of the last ``share`` of the calls, of the first, and their ratio."""
    n = window_size(len(costs), share)
    first, last = float(np.mean(costs[:n])), float(np.mean(costs[-n:]))
    return {"first_ms": 1e3 * first, "last_ms": 1e3 * last, "last_over_first": last / first if first > 0 else None}


def same_context_ratio(costs: list[float], context: list[int], share: float = 0.1,
                       outputs: list[int] | None = None) -> float | None:
    """The last ``share`` of a run's calls against the first at the same context length.

    A call's cost grows with its context (the attention over it, the prompt the client
    sends), which compressions bound but which is short in every run's first calls, so the
    plain ratio (``tail_ratio``) charges the window to the run's length. Here the cost is
    fitted as ``a + b * context + c * k`` over the run's calls (least squares) and the ratio is
    the fit at the run's mean context, at the mean k of the last share over the first.
    ``outputs``: each call's output tokens, a term of the fit too (a whole call's decode
    follows how much it writes, a read's few tokens or a module's ~46)."""
    n = len(costs)
    m = max(1, math.ceil(share * n))
    terms = [np.ones(n), np.asarray(context, dtype=np.float64)]
    if outputs is not None:
        terms.append(np.asarray(outputs, dtype=np.float64))
    if n < len(terms) + 1:
        return None
    k = np.arange(n, dtype=np.float64)
    coef, *_ = np.linalg.lstsq(np.stack([*terms, k], axis=1), np.asarray(costs, dtype=np.float64), rcond=None)
    at_means = sum(w * t.mean() for w, t in zip(coef[:-1], terms))
    first = at_means + coef[-1] * k[:m].mean()
    last = at_means + coef[-1] * k[-m:].mean()
    return float(last / first) if first > 0 else None


def _deciles(values: list[float]) -> list[float]:
    parts = np.array_split(np.asarray(values, dtype=np.float64), min(10, len(values)))
    return [1e3 * float(p.mean()) for p in parts if p.size]


def call_cost_summary(costs: dict) -> dict:
    total = [a + b + c for a, b, c in zip(costs["assemble_s"], costs["append_s"], costs["prefill_s"])]
    out = {name: tail_ratio(costs[key]) for name, key in
           (("assemble", "assemble_s"), ("journal_append", "append_s"), ("engine_prefill", "prefill_s"))}
    out["total"] = tail_ratio(total)
    out["total"]["same_context_last_over_first"] = same_context_ratio(total, costs["context_tokens"])
    out["total_ms_by_decile"] = _deciles(total)
    out["total_s"] = float(sum(total))
    out["context_tokens_by_decile"] = [float(p.mean()) for p in np.array_split(np.asarray(costs["context_tokens"]),
                                                                              min(10, len(total)))]
    out["prefill_tokens"] = int(sum(costs["prefill_tokens"]))
    return out


def whole_call_summary(costs: dict) -> dict:
    """The whole call (prompt assembly, journal append, the engine's prefill and decode of the
    call's own output; ``engine_s``) from ``measure_call_costs``' whole-call replays."""
    whole = [a + b + c for a, b, c in zip(costs["assemble_s"], costs["append_s"], costs["engine_s"])]
    out = tail_ratio(whole)
    out["same_context_last_over_first"] = same_context_ratio(whole, costs["context_tokens"])
    out["same_context_and_output_last_over_first"] = same_context_ratio(whole, costs["context_tokens"],
                                                                        outputs=costs["decode_tokens"])
    out["ms_by_decile"] = _deciles(whole)
    out["total_s"] = float(sum(whole))
    out["engine"] = tail_ratio(costs["engine_s"])
    out["decode_tokens"] = int(sum(costs["decode_tokens"]))
    out["outputs_reproduced"] = int(sum(costs["reproduced"]))
    out["calls"] = len(whole)
    return out


REPLAYS = 3   # a call costs ~10 ms; on a shared 2-core box a wait for a core is as long
# A whole call costs ~50 ms (its decode), so fewer replays keep the bench in its 15 minutes:
# the first replays every call whole, the others only the first and last tenth of the calls
# that the ratio compares (the rest run as the pipeline replays do, one token, and are not
# timed). One replay alone showed bursts (a tenth of a run's calls at 1.4x, not there in the
# other parts).
WHOLE_REPLAYS = 2


def measure_call_costs(journal: str, model_dir: str, invariant: bool, workdir: str, sampling: dict | None,
                       queue) -> None:
    """Each call's cost, each part the least of ``REPLAYS`` replays of the whole run (each with
    a fresh engine and journal, so every replay sees the same retained contexts); with
    ``sampling`` (the run's seed, the rollout's ``temperature``, ``top_p``, ``max_new_tokens``
    and the tokenizer's ``stop`` ids) ``WHOLE_REPLAYS`` more of the calls whole (``whole_call``:
    the first of every call, the others of the first and last tenth; an output counts as
    reproduced when every replay that ran it whole gave the journal's)."""
    import torch

    from gyre_hpc.engines.requests import Request, SamplingParams
    from gyre_hpc.engines.torch_engine import TorchEngine
    from gyre_hpc.harness.context import TokenContext
    from gyre_hpc.harness.engine_client import call_seed
    from gyre_hpc.harness.journal import JournalWriter, load_journal
    from gyre_hpc.models.checkpoint import load_pretrained

    torch.set_num_threads(1)
    log = load_journal(journal).calls

    def params(k: int, ids: list[int], whole: bool) -> SamplingParams:
        if not whole:
            return SamplingParams(max_new_tokens=1, seed=k)
        return SamplingParams(max_new_tokens=sampling["max_new_tokens"], temperature=sampling["temperature"],
                              top_p=sampling["top_p"], seed=call_seed(sampling["run_seed"], ids),
                              stop_token_ids=tuple(sampling["stop"]))

    def replay(r: int, whole: bool = False, only: set[int] | None = None) -> dict:
        """One replay of the run; ``whole``: each call whole, or with ``only`` just those calls
        (the others sample one token, as the pipeline replays do, and time as NaN)."""
        engine = TorchEngine(load_pretrained(model_dir, dtype=torch.float32), invariant=invariant)
        writer = JournalWriter.create(Path(workdir) / f"replay{r}.journal", "replay", "replay")
        seqs: list[TokenContext] = []
        assemble, append, engine_s, prefill_tokens, context, decoded, reproduced = [], [], [], [], [], [], []
        for k, inc in enumerate(log.increments):
            ctx = (seqs[inc.base].prefix(inc.shared).extend(inc.new) if inc.base >= 0
                   else TokenContext.of(inc.new)).as_call(k)
            timed = whole and (only is None or k in only)
            t0 = time.perf_counter()
            ids = ctx.array.tolist()                           # the loop: the prompt for the client
            request = Request(f"c{k}", tuple(int(t) for t in ids), params(k, ids, timed),
                              session=inc.agent)               # the router: the request it sends
            new = ctx.tail(inc.shared)                         # the loop: the journal's new tokens
            t1 = time.perf_counter()
            writer.append(type(inc)(inc.base, inc.shared, new, inc.output, inc.logprobs, inc.role, inc.agent,
                                    inc.policy_version))
            t2 = time.perf_counter()
            before = engine.counters().prefill_tokens
            engine.submit(request)
            done = []
            while not done:
                done = engine.pop_finished()
                if not done:
                    engine.step()
            t3 = time.perf_counter()
            untimed = whole and not timed
            assemble.append(math.nan if untimed else t1 - t0)
            append.append(math.nan if untimed else t2 - t1)
            engine_s.append(math.nan if untimed else t3 - t2)
            prefill_tokens.append(engine.counters().prefill_tokens - before)
            context.append(inc.prompt_len)
            decoded.append(len(done[0].token_ids))
            reproduced.append(None if untimed else tuple(done[0].token_ids) == tuple(int(t) for t in inc.output))
            seqs.append(ctx.extend(inc.output).as_call(k))
        writer.close()
        return {"assemble_s": assemble, "append_s": append, "engine_s": engine_s,
                "prefill_tokens": prefill_tokens, "context_tokens": context, "decode_tokens": decoded,
                "reproduced": reproduced}

    def least(replays: list[dict]) -> dict:
        """Each call's least time of each timed part over the ``replays`` that timed it."""
        return {key: np.nanmin([r[key] for r in replays], axis=0).tolist()
                for key in ("assemble_s", "append_s", "engine_s")}

    runs = [replay(r) for r in range(REPLAYS)]
    costs = least(runs)
    out = call_cost_summary({"assemble_s": costs["assemble_s"], "append_s": costs["append_s"],
                             "prefill_s": costs["engine_s"], "prefill_tokens": runs[0]["prefill_tokens"],
                             "context_tokens": runs[0]["context_tokens"]})
    out["replays"] = REPLAYS
    if sampling is not None:
        windows = window_calls(len(log.increments))
        whole = [replay(REPLAYS + r, whole=True, only=None if r == 0 else windows) for r in range(WHOLE_REPLAYS)]
        out["whole_call"] = whole_call_summary({
            **least(whole),
            "context_tokens": whole[0]["context_tokens"], "decode_tokens": whole[0]["decode_tokens"],
            "reproduced": [all(w["reproduced"][k] is not False for w in whole) for k in range(len(log.increments))]})
        out["whole_call"]["replays"] = WHOLE_REPLAYS
        out["whole_call"]["replays_of_the_other_calls"] = 1
    queue.put(out)


PROBE_CLIP = 1e9   # no clipping: the probe's loss is -sum(advantage x weight x p(token))


def check_loss(model_dir: str, journals: list[str], trees_path: str, train: dict, attention: str, queue) -> None:
    """The step's loss from the stored trees (the trainer's micro-batches, forward only) and from
    the float64 reference, twice: ``step`` as the fleet trained it (its rewards, behaviour
    logprobs and clip), and ``probe``: rewards 0, 1/n, 2/n, ... by run, behaviour logprobs 0 and
    no clipping. On-policy the ratio is 1 and the step's loss is minus the mean advantage, 0
    whatever the logprobs; the probe's is a weighted sum of the token probabilities themselves,
    so it agrees only if every logprob does."""
    import dataclasses

    import torch

    from gyre_hpc.harness.journal import load_journal
    from gyre_hpc.models.checkpoint import load_pretrained
    from gyre_hpc.rl.batches import group_micro_batches
    from gyre_hpc.trees.attention import tree_attention
    from gyre_hpc.trees.calls import CallLog
    from gyre_hpc.trees.loss import StepWeights, group_advantages, invariant_kwargs, run_targets, step_denominator, tree_loss
    from gyre_hpc.trees.packing import collate
    from gyre_hpc.trees.reference import reference_loss
    from gyre_hpc.trees.store import TreeStore

    torch.set_num_threads(1)
    with TreeStore.open(trees_path) as store:
        trees = [store.read(i) for i in range(len(store))]
    model = load_pretrained(model_dir, dtype=torch.float32)
    shared, averaging = train["shared_targets"], train["averaging"]
    n_runs = step_denominator([run_targets(t, shared) for t in trees], averaging)
    variants = {"step": ([t.reward for t in trees], train["clip_eps"], False),
                "probe": ([k / len(trees) for k in range(len(trees))], PROBE_CLIP, True)}
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(trees):
        groups.setdefault(t.task_id, []).append(i)
    t0 = time.perf_counter()
    trainer = {name: 0.0 for name in variants}
    cut = []      # the groups in commit order, with their micro-batch counts (train_mb events by id)
    with torch.no_grad():
        for task_id, members in groups.items():
            group = [trees[i] for i in members]
            mbs = group_micro_batches(group, 1, 0, train["row_tokens"], train["micro_batch_tokens"], shared, averaging,
                                      train["group_forest"])
            cut.append({"task_id": task_id, "run_ids": [t.run_id for t in group], "micro_batches": len(mbs),
                        "tokens": sum(mb.tokens for mb in mbs)})
            for mb in mbs:
                batch = collate(list(mb.rows))
                fn = tree_attention(attention, batch.subtree_end, needs_grad=False, position_ids=batch.position_ids)
                logits = model(batch.input_ids, batch.position_ids, attention_fn=fn, **invariant_kwargs(fn))
                for name, (rewards, clip, zero_behaviour) in variants.items():
                    # The trainer's micro-batch weights (MicroBatch.weights) with these rewards.
                    advantages = group_advantages([rewards[i] for i in members], [trees[i].task_id for i in members])
                    weights = StepWeights(advantages, mb.run_tokens, 1, averaging, total_tokens=1)
                    b = dataclasses.replace(batch, sample_logprobs=torch.zeros_like(batch.sample_logprobs)) \
                        if zero_behaviour else batch
                    trainer[name] += float(tree_loss(logits, b, weights, clip)) / n_runs
    trainer_s = time.perf_counter() - t0
    logs = [load_journal(j).calls for j in journals]
    zeroed = [CallLog([dataclasses.replace(i, logprobs=np.zeros_like(i.logprobs)) for i in log.increments])
              for log in logs]
    kept = [sorted(set(range(len(log))) - set(t.dropped_calls)) for log, t in zip(logs, trees)]
    reference, skipped = {}, {}
    t0 = time.perf_counter()
    model64 = load_pretrained(model_dir, dtype=torch.float64)
    with torch.no_grad():
        for name, (rewards, clip, zero_behaviour) in variants.items():
            if not np.any(group_advantages(rewards, [t.task_id for t in trees])):
                # Every term of the loss is an advantage times a weight: 0 whatever the model
                # says, so the reference is 0 exactly (the trainer's figure is still compared
                # with it); its float64 pass over every call would take minutes for nothing.
                reference[name], skipped[name] = 0.0, "every advantage is 0"
                continue
            loss, _ = reference_loss(model64, zeroed if zero_behaviour else logs, rewards, [t.task_id for t in trees],
                                     clip, kept, shared, averaging)
            reference[name] = float(loss)
    reference_s = time.perf_counter() - t0
    queue.put({"trainer_forward": trainer, "reference": reference, "reference_not_computed": skipped,
               "trainer_forward_s": trainer_s,
               "reference_s": reference_s, "runs": len(trees), "kept_calls": sum(len(k) for k in kept),
               "calls": sum(len(log) for log in logs), "groups": cut})
