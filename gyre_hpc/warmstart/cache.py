"""Build the warm-start checkpoint once and reuse it: a directory keyed by what shapes it.

The key hashes everything that changes the teacher's token ids or the trained weights:
the suite's tasks and playbooks, the harness settings from ``rollout``, the model preset's
architecture (vocabulary size included, read from the built model, never assumed), a
tokenizer fingerprint (the ids of the system prompt and of a formatted tool call, so a new
tokenizer or call syntax gets a new checkpoint) and the SFT settings. Building writes into
a scratch directory renamed into place (``fsio.replace_dir``), so a half-built checkpoint is
never picked up and a rebuild never leaves the cache without one.

Some checkpoints ship with the package (``shipped/<key>``): the xLong suite's takes ~37 min of
teacher runs and SFT on 2 cores, more than twice the 15 minutes its benchmark is allowed, so a
fresh clone would otherwise spend its first ``bench xlong`` building it. A shipped checkpoint is
used only under its own key, so any change to what shapes it builds a new one as before; the
package's tests fail while a shipped key matches no example config (``--ship`` replaces it).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import torch

from gyre_hpc import fsio
from gyre_hpc.config import ConfigError, RunConfig
from gyre_hpc.harness.actions import format_action
from gyre_hpc.harness.loop import SUBAGENT_TEXT, SYSTEM_TEXT, HarnessConfig
from gyre_hpc.harness.tasks import builtin_task, load_suite, suite_names
from gyre_hpc.harness.tokenizer import ChatFormat
from gyre_hpc.models.checkpoint import is_checkpoint, save_pretrained
from gyre_hpc.models.tiny_lm import build_model
from gyre_hpc.models.tokenizer import embedded_tokenizer
from gyre_hpc.warmstart.sft import train_sft
from gyre_hpc.warmstart.trajectories import playbook_of, teacher_runs, teacher_variants

# Bump when the teacher's behaviour or the SFT recipe changes in a way the key cannot see.
RECIPE_VERSION = 1
SHIPPED = Path(__file__).with_name("shipped")


def warmstart_suite(cfg: RunConfig) -> tuple[str, str]:
    """The suite the teacher runs and the field that names it: ``warmstart.tasks`` where set
    (a warm start on smaller tasks than RL's), else ``rollout.tasks``."""
    if cfg.warmstart.tasks is not None:
        return cfg.warmstart.tasks, "warmstart.tasks"
    return cfg.rollout.tasks, "rollout.tasks"


def _tasks(cfg: RunConfig):
    name, field = warmstart_suite(cfg)
    tasks = load_suite(name, field)
    # A playbook is looked up by task id and was written for the built-in task of that id: a
    # task from files under the same id but other content would get a teacher solving another
    # task. A built-in suite written out as files loads back equal and keeps its playbooks.
    missing = [t.task_id for t in tasks if playbook_of(t) is None or builtin_task(t.task_id) != t]
    if missing:
        raise ValueError(f"warmstart: {field}={name!r} has tasks without a teacher playbook "
                         f"({', '.join(missing)}); a playbook is written for a built-in task, so a task "
                         f"from files has one only where it equals that task; suites with playbooks: "
                         f"{', '.join(playbook_suites())}")
    return tasks


def playbook_suites() -> list[str]:
    """The suites a teacher can run: every task has a playbook."""
    return [n for n in suite_names() if all(playbook_of(t) is not None for t in load_suite(n))]


def teacher_harness(cfg: RunConfig) -> HarnessConfig:
    """The run's harness settings, without its wall clock: a teacher run is never cut short
    (on a loaded machine it would be, and the checkpoint would depend on the load)."""
    return dataclasses.replace(HarnessConfig.from_rollout(cfg.rollout), run_timeout_s=3600.0)


def _tokenizer_fingerprint() -> list:
    """Ids of the chat-formatted system prompts, a generation prompt and a tool call: a new
    tokenizer, chat template or call syntax changes them, so it gets a new checkpoint."""
    tok = embedded_tokenizer()
    chat = ChatFormat(tok)
    return [tok.vocab_size, chat.message("system", SYSTEM_TEXT), chat.message("system", SUBAGENT_TEXT),
            chat.generation_prompt(), list(format_action("write", "a.py", "x = 1\n", tokenizer=tok))]


def warmstart_key(cfg: RunConfig) -> str:
    tasks = _tasks(cfg)
    harness = teacher_harness(cfg)
    model = build_model(cfg.model.preset, seed=cfg.warmstart.seed)
    fingerprint = {
        "recipe": RECIPE_VERSION,
        "tasks": [repr(t) for t in tasks],
        "playbooks": [repr(playbook_of(t)) for t in tasks],
        "harness": repr(harness),
        "model": dataclasses.asdict(model.config),
        "tokenizer": _tokenizer_fingerprint(),
        # The suite is in "tasks" (by content, so naming the default suite keeps the key).
        "sft": cfg.warmstart.model_dump(exclude={"enabled", "cache_dir", "seed", "tasks"}),
        "seed": cfg.warmstart.seed,
    }
    variants = teacher_variants(tasks, cfg.warmstart.runs_per_task)
    if variants:   # xlong: the teacher runs variants of the tasks, which the tasks' repr does not show
        fingerprint["variants"] = variants
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True, default=str).encode()).hexdigest()[:16]


def build_warmstart(cfg: RunConfig, out: Path, key: str, log=print) -> dict:
    """Teacher runs -> SFT -> HF checkpoint in ``out``; returns the report written beside it."""
    # One thread unless told otherwise, as the fleet's ranks: on shared cores more threads
    # than cores make every step slower (measured 12x on a loaded 2-core machine).
    torch.set_num_threads(int(os.environ.get("GYRE_TORCH_THREADS", "1")))
    t0 = time.perf_counter()
    harness = teacher_harness(cfg)
    ws = cfg.warmstart
    runs = teacher_runs(_tasks(cfg), ws.runs_per_task, harness, seed=ws.seed, give_up=ws.teacher_give_up,
                       wrong_rate=ws.teacher_wrong_rate)
    teacher = runs.stats()
    log(f"[warmstart] {teacher['runs']} teacher runs, {teacher['calls_mean']:.1f} calls each, "
        f"{teacher['trained_tokens']} trained tokens ({time.perf_counter() - t0:.0f}s)")
    model = build_model(cfg.model.preset, seed=ws.seed)
    sft = train_sft(model, runs.trees, steps=ws.steps, lr=ws.lr, row_tokens=ws.row_tokens, max_s=ws.max_s,
                    seed=ws.seed, log=log)
    report = {"key": key, "suite": warmstart_suite(cfg)[0], "preset": cfg.model.preset, "teacher": teacher,
              "sft": dataclasses.asdict(sft), "seconds": time.perf_counter() - t0}
    save_pretrained(model, out, extra={"warmstart": report})
    (out / "warmstart.json").write_text(json.dumps(report, indent=1))
    return report


def _checkpoint_at(path: Path) -> Path | None:
    return path if is_checkpoint(path) else None


def shipped_warmstart(key: str) -> Path | None:
    """The checkpoint the package ships for ``key``, if any."""
    return _checkpoint_at(SHIPPED / key)


def warmstart_source(cfg: RunConfig) -> str:
    """Where ``ensure_warmstart`` would take ``cfg``'s checkpoint from: ``cache``, ``shipped``
    or ``build`` (looks, changes nothing)."""
    key = warmstart_key(cfg)
    if _checkpoint_at(Path(cfg.warmstart.cache_dir) / key):
        return "cache"
    return "shipped" if shipped_warmstart(key) else "build"


def cached_warmstart(cfg: RunConfig, log=print) -> Path | None:
    """The checkpoint for ``cfg`` in the cache, the shipped one copied there if the cache lacks
    it, else None (trains nothing: a login node may call it)."""
    return _cached(Path(cfg.warmstart.cache_dir) / warmstart_key(cfg), log)


def _cached(final: Path, log) -> Path | None:
    """``cached_warmstart`` for the cache entry ``final`` (``<cache_dir>/<key>``)."""
    fsio.recover_dir(final)     # a rebuild killed between its renames left the old one aside
    if _checkpoint_at(final):
        return final
    shipped = shipped_warmstart(final.name)
    if shipped is None:
        return None
    _copy_checkpoint(shipped, final.parent)
    log(f"[warmstart] installed the shipped checkpoint {final.name} into {final.parent}")
    return final


def ship_warmstart(path: Path, into: Path = SHIPPED) -> Path:
    """Copy the built checkpoint ``path`` into the package as ``shipped/<its key>`` (a
    maintainer's step, after a change that gives the shipped suite's config a new key)."""
    return _copy_checkpoint(Path(path), Path(into))


def _copy_checkpoint(src: Path, parent: Path) -> Path:
    """``src`` copied to ``parent/<its name>`` through a scratch copy renamed into place."""
    parent.mkdir(parents=True, exist_ok=True)
    scratch = parent / f".{src.name}.{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    shutil.copytree(src, scratch)
    fsio.replace_dir(scratch, parent / src.name)
    return parent / src.name


def ensure_warmstart(cfg: RunConfig, force: bool = False, log=print) -> Path:
    """The cached checkpoint for ``cfg`` (built now if missing); its directory."""
    root = Path(cfg.warmstart.cache_dir)
    final = root / warmstart_key(cfg)
    if not force and _cached(final, log) is not None:     # the key computed once: it builds a model
        log(f"[warmstart] using cached {final}")
        return final
    root.mkdir(parents=True, exist_ok=True)
    scratch = root / f".{final.name}.{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    build_warmstart(cfg, scratch, final.name, log=log)
    fsio.replace_dir(scratch, final)
    log(f"[warmstart] checkpoint {final}")
    return final


def with_warmstart(cfg: RunConfig, log=print, build: bool = True) -> RunConfig:
    """``cfg`` starting from its warm-start checkpoint (unchanged unless enabled and no model.path).

    With ``build=False`` (a login node: nothing is trained there) the checkpoint must be
    cached or shipped already; a missing one is a ConfigError naming what to do."""
    if not cfg.warmstart.enabled or cfg.model.path:
        return cfg
    path = ensure_warmstart(cfg, log=log) if build else cached_warmstart(cfg, log=log)
    if path is None:
        raise ConfigError(
            f"warmstart.enabled: no cached warm-start checkpoint under {cfg.warmstart.cache_dir} for this "
            f"config; build it first inside an allocation (srun gyre-hpc warmstart CONFIG) or set "
            f"warmstart.enabled=false")
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": str(path.resolve())})})
