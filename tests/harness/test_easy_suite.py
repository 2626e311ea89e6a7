"""The easy suite with a real, untrained tiny model: every output is an action, rewards are graded."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from gyre_hpc.engines.torch_engine import TorchEngine
from gyre_hpc.harness.engine_client import EngineCalls
from gyre_hpc.harness.loop import AgentRun, HarnessConfig
from gyre_hpc.harness.tasks import load_suite
from gyre_hpc.harness.tokenizer import split_bytes
from gyre_hpc.models.tiny_lm import build_model


def test_untrained_model_makes_partial_progress_on_the_easy_suite(tmp_path):
    torch.set_num_threads(1)
    driver = EngineCalls(TorchEngine(build_model("tiny", seed=0)), temperature=1.0)
    cfg = HarnessConfig(max_new_tokens=32, context_limit=512)
    jobs = [(task, g) for task in load_suite("easy") for g in range(4)]

    async def main():
        runs = [AgentRun(task, tmp_path / f"{task.task_id}-{g}", driver.client(g), tmp_path / f"{task.task_id}-{g}.jsonl",
                         cfg, run_id=f"{task.task_id}-{g}") for task, g in jobs]
        return await asyncio.gather(*(r.run() for r in runs))

    results = asyncio.run(main())
    for (task, g), r in zip(jobs, results):
        assert r.status == "finished" and len(r.calls) == 1, r.error
        # a random model emits no valid call: its bytes became the answer (the default action)
        answer = (tmp_path / f"{task.task_id}-{g}" / task.answer_file).read_bytes()
        assert answer == split_bytes(r.calls[0].output)
        assert r.reward in (0.0, 0.25, 0.5, 0.75, 1.0)
    rewards = [r.reward for r in results]
    assert 0 < sum(rewards) / len(rewards) < 1      # graded signal, neither nothing nor everything
    assert len({tuple(r.calls[0].output.tolist()) for r in results}) == len(results)   # seeds differ per run


@pytest.mark.slow
def test_tiny_model_learns_the_easy_task_in_a_few_policy_gradient_steps(tmp_path):
    """Evidence for the suite's claim: plain REINFORCE with group-normalised advantages (no
    project trainer involved) over real harness rollouts raises the mean reward within ten
    steps. Deterministic: seeded sampling per run, single-threaded CPU training."""
    torch.set_num_threads(1)
    task = next(t for t in load_suite("easy") if t.task_id == "answer-short")
    policy = build_model("tiny", seed=0)
    engine = TorchEngine(build_model("tiny", seed=0))
    driver = EngineCalls(engine, temperature=1.0)
    opt = torch.optim.Adam(policy.parameters(), lr=5e-2)
    cfg = HarnessConfig(max_new_tokens=24, context_limit=512)
    group = 16
    means = []
    for step in range(10):
        async def rollouts():
            runs = [AgentRun(task, tmp_path / f"ws{step}-{g}", driver.client(step * 100 + g), tmp_path / f"s{step}-{g}.jsonl",
                             cfg, run_id=f"{step}-{g}") for g in range(group)]
            return await asyncio.gather(*(r.run() for r in runs))

        results = asyncio.run(rollouts())
        rewards = np.array([r.reward for r in results])
        means.append(rewards.mean())
        advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        loss = torch.zeros(())
        for r, adv in zip(results, advantages):
            call = r.calls[0]
            seq = torch.from_numpy(np.concatenate([call.prompt, call.output]).astype(np.int64))[None]
            logits = policy(seq, torch.arange(seq.shape[1])[None])[0, call.prompt.size - 1:-1]
            logp = torch.log_softmax(logits, -1).gather(-1, seq[0, call.prompt.size:, None]).squeeze(-1)
            loss = loss - float(adv) * logp.sum() / group
        opt.zero_grad()
        loss.backward()
        opt.step()
        engine.load_weights(policy.state_dict(), step + 1)
    print("mean reward per step", np.round(means, 3).tolist())
    assert np.mean(means[-3:]) >= np.mean(means[:3]) + 0.1, means


def test_engine_failure_fails_the_run_but_still_scores_and_journals_it(tmp_path):
    from gyre_hpc.harness.journal import load_journal

    engine = TorchEngine(build_model("tiny", seed=0))
    engine.sleep()                     # a real engine state in which submit refuses work
    driver = EngineCalls(engine, temperature=0.0)
    task = load_suite("easy")[0]
    r = asyncio.run(AgentRun(task, tmp_path / "ws", driver.client(0), tmp_path / "j.jsonl",
                             HarnessConfig(max_new_tokens=16, context_limit=512)).run())
    assert r.status == "failed" and "EngineError" in r.error and r.reward == 0.0
    assert load_journal(tmp_path / "j.jsonl").status == "failed"
