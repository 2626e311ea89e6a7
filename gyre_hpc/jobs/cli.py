"""``gyre-hpc run`` (the head in the foreground) and ``gyre-hpc submit`` (the head as a Slurm job)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click

from gyre_hpc.config import WORKLOADS, ConfigError, RunConfig, load_config

_set_option = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                           help="override a config field, e.g. --set cells.count=4 (repeatable)")


def _load(config: str, overrides: tuple[str, ...]) -> RunConfig:
    try:
        return load_config(config, list(overrides))
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


def _prepare(cfg: RunConfig, build: bool) -> RunConfig:
    """The config checked by its workload (refused before anything starts) and with what the
    workload resolves before launch (``jobs.preflight``)."""
    from gyre_hpc.jobs.preflight import prepare_workload_config

    try:
        return prepare_workload_config(cfg, build, log=click.echo)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
def run(config: str, overrides: tuple[str, ...]) -> None:
    """Run the head job here: launch the fleet, supervise it, print where outputs are."""
    from gyre_hpc.jobs.head import run_head
    from gyre_hpc.rundir.layout import RunDir

    cfg = _load(config, overrides)
    cfg = _prepare(cfg, build=True)
    if WORKLOADS[cfg.workload].step_progress:
        from gyre_hpc.jobs.progress import progress_display
        with progress_display(cfg):
            result = run_head(cfg)
    else:
        result = run_head(cfg)
    run_dir = RunDir.at(cfg.run_dir)
    click.echo(f"outputs in {run_dir.root}:")
    for label, path in (("metrics", run_dir.metrics), ("checkpoints", run_dir.checkpoints),
                        ("trees", run_dir.trees), ("logs", run_dir.logs)):
        if path.exists():
            click.echo(f"  {label:<12} {path}")
    click.echo(f"summary: gyre-hpc inspect {run_dir.root}")
    if WORKLOADS[cfg.workload].step_progress:
        from gyre_hpc.jobs.progress import notebook_hint
        hint = notebook_hint(run_dir.root)
        if hint:
            click.echo(hint)
    sys.exit(result.exit_code)


@click.command()
@click.argument("config", type=click.Path(dir_okay=False))
@_set_option
@click.option("--sbatch", "use_sbatch", is_flag=True,
              help="submit a generated het-job script with sbatch instead of through submitit")
@click.option("--wait", is_flag=True, help="wait for the head job and print its result (submitit)")
@click.option("--dry-run", is_flag=True,
              help="print the sbatch script and the resolved config that would be submitted; submit and write nothing")
def submit(config: str, overrides: tuple[str, ...], use_sbatch: bool, wait: bool, dry_run: bool) -> None:
    """Submit the head job to Slurm (submitit by default)."""
    from gyre_hpc.rundir.layout import RunDir

    cfg = _load(config, overrides).model_copy(update={"launcher": "slurm"})
    # Never train on a login node: a warm start must be built already (in an allocation).
    cfg = _prepare(cfg, build=False)
    if dry_run:
        click.echo(dry_run_text(cfg, use_sbatch), nl=False)
        return
    run_dir = RunDir.at(cfg.run_dir).make()
    cfg = cfg.model_copy(update={"run_dir": str(run_dir.root)})
    if use_sbatch:
        job_id, script = submit_sbatch(cfg, run_dir.root)
        click.echo(f"submitted het job {job_id} ({script}); outputs in {run_dir.root}")
        return
    from gyre_hpc.jobs.submit import submit as submit_job

    job = submit_job(cfg)
    click.echo(f"submitted job {job.job_id} (submitit folder {run_dir.root / 'submitit'}); outputs in {run_dir.root}")
    if wait:
        from gyre_hpc.jobs.submit import wait_for_result

        try:
            click.echo(str(wait_for_result(job)))
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None


def dry_run_text(cfg: RunConfig, use_sbatch: bool) -> str:
    """What ``submit`` would submit, as text: the batch script and the resolved config. Writes
    nothing (the run directory is named, not made) and calls no Slurm command."""
    root = Path(cfg.run_dir).expanduser().resolve()
    cfg = cfg.model_copy(update={"run_dir": str(root)})
    if use_sbatch:
        from gyre_hpc.jobs.sbatch_script import render_head_script

        script = render_head_script(cfg, output=str(root / "logs" / "head-%j.out"))
        how = f"sbatch --parsable {root / 'gyre_head.sh'} {root / 'submitted.yaml'}"
    else:
        from gyre_hpc.jobs.submit import submission_script

        script = submission_script(cfg, root / "submitit")
        how = f"submitit (sbatch of this script from {root / 'submitit'})"
    return (f"# gyre-hpc submit --dry-run: nothing was submitted or written\n# would run: {how}\n"
            f"# ---- batch script ----\n{script}# ---- resolved config ({root / 'submitted.yaml'}) ----\n"
            f"{cfg.to_yaml()}")


def submit_sbatch(cfg: RunConfig, run_root: Path) -> tuple[str, Path]:
    """Write the het-job script for this config's shape and the resolved config, then sbatch them."""
    from gyre_hpc.jobs.sbatch_script import render_head_script

    script = run_root / "gyre_head.sh"
    script.write_text(render_head_script(cfg, output=str(run_root / "logs" / "head-%j.out")))
    script.chmod(0o755)
    submitted = run_root / "submitted.yaml"
    submitted.write_text(cfg.to_yaml())
    out = subprocess.run(["sbatch", "--parsable", str(script), str(submitted)],
                         capture_output=True, text=True, cwd=Path.cwd())
    if out.returncode != 0:
        raise click.ClickException(f"sbatch failed: {out.stderr.strip()}")
    return out.stdout.strip().split(";")[0], script
