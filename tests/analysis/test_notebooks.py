"""The analysis notebooks execute headless against a small recorded run and write PNGs."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = ("timeline", "utilisation", "steps", "trees", "sweep")
FIGURES = {"timeline": ["gantt.png"], "utilisation": ["busy.png"], "steps": ["step_times.png", "rewards.png"],
           "trees": ["tree_savings.png"], "sweep": ["sweep.png"]}


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    from gyre_hpc.sim.sample import make_sample
    return make_sample(tmp_path_factory.mktemp("sample"))


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A python3 kernelspec that runs this very interpreter (the venv's ipykernel)."""
    spec_root = tmp_path_factory.mktemp("jupyter")
    spec = spec_root / "kernels" / "gyre-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "gyre test", "language": "python"}))
    return str(spec_root)


def test_committed_notebooks_match_their_builder(tmp_path):
    sys.path.insert(0, str(REPO / "analysis"))
    try:
        import build_notebooks
    finally:
        sys.path.pop(0)
    for built in build_notebooks.build(tmp_path):
        assert built.read_text() == (REPO / "analysis" / built.name).read_text(), (
            f"analysis/{built.name} is stale: run python analysis/build_notebooks.py")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes_and_writes_figures(name, sample, kernel_env, tmp_path, monkeypatch):
    import matplotlib.image
    import nbclient
    import nbformat
    figures = tmp_path / "figures"
    monkeypatch.setenv("GYRE_SAMPLE", str(sample))
    monkeypatch.setenv("GYRE_FIGURES", str(figures))
    monkeypatch.setenv("JUPYTER_PATH", kernel_env + os.pathsep + os.environ.get("JUPYTER_PATH", ""))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(REPO / "analysis" / f"{name}.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, startup_timeout=120, kernel_name="gyre-test",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    for png in FIGURES[name]:
        img = matplotlib.image.imread(figures / png)
        assert img.shape[0] > 100 and img.shape[1] > 100
        assert img[..., :3].std() > 0.01, f"{png} is blank"
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert text.strip(), f"{name} printed nothing"
