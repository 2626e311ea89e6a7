"""Rebuild the embedded tokenizer (gyre_hpc/models/embedded_tokenizer.json) offline.

The corpus is the text a run of the built-in suites produces: the harness's fixed prompts,
every task's spec, files and tests, tool results, and one tool call per tool. Run from the
repository root: ``python scripts/build_tokenizer.py`` (needs ``tokenizers``).
"""
from __future__ import annotations

from gyre_hpc.harness import loop
from gyre_hpc.harness.actions import TOOLS, tool_call_json
from gyre_hpc.harness.tasks.builtin import SUITES
from gyre_hpc.models.tokenizer import EMBEDDED_FILE, build_bpe


def corpus() -> list[str]:
    texts = [loop.SYSTEM_TEXT, loop.SUBAGENT_TEXT, loop.SUMMARY_REQUEST, "summary: ", "retry 1: ",
             "appended 12 bytes to answer.txt", "wrote 5 bytes to notes.txt", "error: ", "turn budget spent",
             "system\n", "user\n", "assistant\n"]
    tasks = {t.task_id: t for suite in SUITES.values() for t in suite}
    for task in tasks.values():
        texts.append(task.spec)
        texts.extend(task.files.values())
        texts.extend(test.code for test in task.tests)
        texts.append(f"{len(task.tests)}/{len(task.tests)} tests passed")
    samples = {"path": "answer.txt", "content": "x = 1\n", "command": "python -m pytest -q", "task": "write tests",
               "message": "done"}
    for tool, (names, _) in TOOLS.items():
        texts.append(tool_call_json(tool, *(samples[n] for n in names)))
    # Repeated so the suite's words and the call syntax win merges over one-off strings.
    return texts * 4


def main() -> None:
    tok = build_bpe(corpus())
    tok.backend.save(str(EMBEDDED_FILE))
    print(f"wrote {EMBEDDED_FILE}: {tok.vocab_size} ids")


if __name__ == "__main__":
    main()
