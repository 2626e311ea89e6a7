"""`gyre-hpc report RUN`: PNG figures and one self-contained HTML page, checked in a real
headless Chromium (Debian's): the page loads without errors, the browser decodes every
figure, and a screenshot of it is not blank."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre_hpc.rundir.report import FIGURES, write_report

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


@pytest.fixture(scope="module")
def run_with_trees(tmp_path_factory):
    """A simulated run (the metrics.h5 schema every run writes) with a trees.zarr beside it."""
    from gyre_hpc.sim.sample import make_sample

    sample = tmp_path_factory.mktemp("sample")
    make_sample(sample)
    run = sample / "runs" / "elastic"
    shutil.copytree(sample / "synthetic_trees" / "trees.zarr", run / "trees.zarr")
    return run


def test_report_writes_every_figure_and_a_page_that_holds_them(run_with_trees, tmp_path):
    rep = write_report(run_with_trees, tmp_path / "out")
    assert sorted(p.name for p in rep.figures) == sorted(f for f, _, _ in FIGURES)
    assert all(p.stat().st_size > 5000 for p in rep.figures)
    page = rep.html.read_text()
    assert page.count('<figure class="gyre-figure">') == len(FIGURES) == page.count("data:image/png;base64,")
    assert "src=\"http" not in page and "<link" not in page          # self-contained: nothing fetched
    assert "<th>steps done</th>" in page and "<th>flips</th>" in page


def test_report_command_names_a_missing_run(tmp_path):
    from click.testing import CliRunner

    from gyre_hpc.rundir.report import report

    out = CliRunner().invoke(report, [str(tmp_path / "nope")])
    assert out.exit_code == 1 and "nope" in out.output


@pytest.mark.chromium
def test_report_page_renders_every_figure_in_headless_chromium(run_with_trees, tmp_path):
    rep = write_report(run_with_trees, tmp_path / "out")
    profile = tmp_path / "chromium-profile"
    url = rep.html.resolve().as_uri()
    dom = subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    body = re.search(r"<body[^>]*>", dom.stdout).group(0)
    assert f'data-figures="{len(FIGURES)}"' in body and f'data-figures-shown="{len(FIGURES)}"' in body, body
    console = [line for line in dom.stderr.splitlines() if "CONSOLE" in line]
    assert not [line for line in console if "Uncaught" in line or "Error" in line], console
    shot = tmp_path / "page.png"
    subprocess.run(["chromium", *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size=1200,2000",
                    f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120, check=True)
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    inked = (pixels < 0.9).any(axis=-1).mean()             # share of pixels that are not near-white
    assert pixels.std() > 0.05 and inked > 0.05, (pixels.std(), inked)


def test_report_runs_from_the_command_line(run_with_trees, tmp_path):
    gyre = str(Path(sys.executable).with_name("gyre-hpc"))
    proc = subprocess.run([gyre, "report", str(run_with_trees), "--out", str(tmp_path / "r")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"page   {tmp_path / 'r' / 'report.html'}" in proc.stdout and proc.stdout.count("figure ") == len(FIGURES)
