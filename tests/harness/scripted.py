"""A teacher policy for harness tests: a deterministic function of the prompt.

It is a ModelClient, not a stand-in for a model in the must-show tests: there it only
produces the (prompt, output) pairs that the real tiny model is then trained on, and the
real TorchEngine run must reproduce them.
"""
from __future__ import annotations

from gyre_hpc.harness.actions import format_action
from gyre_hpc.harness.client import Completion
from gyre_hpc.harness.loop import SUMMARY_REQUEST
from gyre_hpc.harness.tasks import Task, TaskTest
from gyre_hpc.harness.tokenizer import ChatFormat, encode, split_bytes
from gyre_hpc.models.tokenizer import embedded_tokenizer

_CHAT = ChatFormat(embedded_tokenizer())
SUMMARY_PROMPT_END = _CHAT.message("user", SUMMARY_REQUEST) + _CHAT.generation_prompt()

# A task whose first finish fails one test, so the retry path is taken.
HI_TASK = Task(
    task_id="say-hi",
    spec="Make ok.txt say hi.",
    tests=(TaskTest("exists", "import os\nassert os.path.isfile('ok.txt')"),
           TaskTest("says_hi", "assert open('ok.txt').read() == 'hi'")),
    max_turns=8,
)


def teacher(prompt: list[int]) -> list[int]:
    """delegate -> sub-agent writes 'no' and finishes -> finish (fails) -> retry -> write 'hi' -> finish."""
    text = split_bytes(prompt)
    if prompt[-len(SUMMARY_PROMPT_END):] == SUMMARY_PROMPT_END:
        return encode("wrote") + [_CHAT.tokenizer.eos_id]   # plain text ends where the model stops
    if b"summary: wrote" in text:
        return format_action("finish")
    if b"subtask:" in text:
        return format_action("finish", "ok") if b"wrote" in text else format_action("write", "ok.txt", "no")
    if b"retry 1" not in text:
        return format_action("finish") if b"sub1:" in text else format_action("delegate", "go")
    if b"wrote" in text.split(b"retry 1")[1]:
        return format_action("finish")
    return format_action("write", "ok.txt", "hi")


class ScriptClient:
    """Answers each prompt with ``policy(prompt)`` and logprob -1 per token."""

    def __init__(self, policy=teacher, delay_s: float = 0.0):
        self.policy = policy
        self.delay_s = delay_s
        self.prompts: list[list[int]] = []

    async def complete(self, prompt, max_new_tokens, stop, *, agent="main"):
        import asyncio
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        self.prompts.append(list(prompt))
        out = self.policy(list(prompt))[:max_new_tokens]
        return Completion(tuple(out), tuple(-1.0 for _ in out), 3)
