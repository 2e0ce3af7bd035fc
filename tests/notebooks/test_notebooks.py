"""The notebooks run top to bottom (nbclient), and stay stripped.

Each notebook answers one question with real measurements on this machine and draws
its plots. Readers run them at realistic sizes; the test runs every cell of each at tiny
sizes instead, injected papermill's way: after the notebook's one cell tagged
``parameters`` comes a cell of ``SMOKE_PARAMETERS`` that overrides its values. That is
still the slowest part of the suite, hence ``slow``. Committed notebooks carry no
outputs: ``test_notebooks_are_stripped`` keeps it that way.

The notebooks of one test process share one kernel (``kernel``): a fresh kernel's start and
imports (JAX, Flax, optax, matplotlib, torch, transformers, jaxckpt: 4.5 to 7 s of CPU) were
paid again by every notebook. Each notebook starts from an empty namespace instead (``RESET``,
injected before its first cell), so a name it uses but does not define still fails
(``test_each_notebook_starts_from_an_empty_namespace``); what the reset keeps is the modules
imported and their state (a warnings filter, matplotlib's backend: every notebook sets
``%matplotlib inline`` itself). A kernel a notebook killed is started again for the next one.
"""

import ast
import doctest
import os
import time
from pathlib import Path

import pytest
from gc_tuning import thresholds

NOTEBOOKS_DIR = Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
# Eight CPU devices, as in every test process (conftest.py): notebook 03's FSDP plan over 8 devices
# compiles in the kernel instead of one subprocess per compile (each importing JAX and jaxckpt).
ENV = {
    "MPLBACKEND": "Agg",
    "TORCH_DEVICE_BACKEND_AUTOLOAD": "0",
    "HF_HUB_OFFLINE": "1",
    "JAX_NUM_CPU_DEVICES": "8",
}
# Per notebook, the values the test runs it with: the smallest sizes at which every cell still
# runs and draws (each name must be one its parameters cell sets).
SMOKE_PARAMETERS = {
    "01_flash_attention": (
        "T_VALUES = [64, 128]\nJNN_MAX_T = 128\nFIT_FROM = 64\nTIME_T = [64, 128]\nROUNDS = 1"
    ),
    "02_remat_policies": (
        'BATCH, SEQ = 2, 32\nSTEPS = 1\nPRESETS = ("none", "full", "save_attn", "ratio_0.5")'
    ),  # a preset of each kind: four train steps compiled, not eight
    "03_memory_planner": (
        'CONFIG = nn.TransformerConfig.preset("llama2-7b", d_model=128, n_layers=2, n_heads=4, '
        "ffn_dim=344, vocab_size=512)\nB, T = 8, 64\nN_DEVICES = 8"
    ),
    "04_pytorch_checkpoints": "STEPS, BATCH, SEQ = 3, 2, 16",
    "05_ascend_npu": "LENGTHS = (16,)",
    "06_finetune": ("N_RECORDS = 40\nSTEPS, BATCH, SEQ, EVAL_EVERY, EVAL_SPLIT = 4, 2, 64, 2, 0.1\nNEW = 6"),
    "07_long_context": "SEQ = 256\nMLP_CHUNK = 64\nSTEPS = 1",
    "08_your_own_model": (
        "IMAGE, PATCH = 16, 4\nDIM, HEADS, MLP, DEPTH = 24, 2, 40, 2\nBATCH = 16\nBUDGET_AT = 0.4"
    ),  # activations above the state, and a budget the first plan fits: plan_fn compiles once, not 7 times
    "09_per_layer_plans": "N_LAYERS = 3\nBATCH, SEQ = 1, 32\nN_BUDGETS = 0",  # no sweep (test_plan_per_layer)
    "10_compressed_residuals": "SMOOTH = 5\nWORST = 3",  # reads the committed results: no training
}


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:5] == [
        "01_flash_attention.ipynb",
        "02_remat_policies.ipynb",
        "03_memory_planner.ipynb",
        "04_pytorch_checkpoints.ipynb",
        "05_ascend_npu.ipynb",
    ]
    assert sorted(SMOKE_PARAMETERS) == [p.stem for p in NOTEBOOKS]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebooks_are_stripped(path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name} cell {i} has outputs: clear them before committing"
            assert cell.execution_count is None, f"{path.name} cell {i} has an execution count"
    assert "widgets" not in nb.metadata, f"{path.name} carries widget state"


def _assigned(source: str) -> set[str]:
    """The names a cell's top-level assignments set."""
    names = set()
    for node in ast.parse(source).body:
        for target in node.targets if isinstance(node, ast.Assign) else ():
            names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    return names


def with_smoke_parameters(nb, path: Path):
    """``nb`` with ``SMOKE_PARAMETERS`` injected as a cell after its one ``parameters`` cell.

    Raises AssertionError where the notebook has no such cell, several, or the injected cell
    sets a name the parameters cell does not (a renamed parameter would run at full size).
    """
    import nbformat

    tagged = [i for i, cell in enumerate(nb.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{path.name}: {len(tagged)} cells tagged 'parameters', not one"
    source = SMOKE_PARAMETERS[path.stem]
    unknown = _assigned(source) - _assigned(nb.cells[tagged[0]].source)
    assert not unknown, f"{path.name}: its parameters cell sets no {sorted(unknown)}"
    injected = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    nb.cells.insert(tagged[0] + 1, injected)
    return nb


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_smoke_parameters_override_the_parameters_cell(path):
    nbformat = pytest.importorskip("nbformat")
    nb = with_smoke_parameters(nbformat.read(path, as_version=4), path)
    cells = [cell.metadata.get("tags", []) for cell in nb.cells]
    assert cells.index(["injected-parameters"]) == cells.index(["parameters"]) + 1


@pytest.fixture(scope="module")
def kernel():
    """One Python kernel, started in ``notebooks/`` with ``ENV``, for every notebook run by
    this process (see the module)."""
    pytest.importorskip("nbclient")
    manager = pytest.importorskip("jupyter_client.manager")
    km = manager.KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(NOTEBOOKS_DIR), env={**os.environ, **ENV})
    yield km
    km.shutdown_kernel(now=True)


RESET = f'%reset -f\n__import__("gc").freeze()\n__import__("gc").set_threshold{thresholds()}'
"""Empties the namespace (``%reset`` collects the garbage), then moves what survives (the modules
and their objects) out of the collector's reach: each later collection, and the next reset's,
walks only what the notebook made, not the whole kernel's heap (JAX, Flax, torch, transformers).
The youngest generation is then collected as seldom as in the test processes (``gc_tuning.py``)."""


def with_reset(nb):
    """``nb`` with a first cell that empties the shared kernel's namespace (``RESET``)."""
    import nbformat

    nb.cells.insert(0, nbformat.v4.new_code_cell(RESET, metadata={"tags": ["injected-reset"]}))
    return nb


def execute_in(kernel, nb, timeout: int = CELL_TIMEOUT_S):
    """Runs every cell of ``nb`` in ``kernel`` (nbclient), which stays up for the next notebook.

    Raises:
        nbclient.exceptions.CellExecutionError: for a cell that raised.
    """
    import nbclient

    client = nbclient.NotebookClient(nb, km=kernel, timeout=timeout)
    try:
        return client.execute()
    finally:
        if client.kc is not None:
            client.kc.stop_channels()


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path, kernel):
    nbformat = pytest.importorskip("nbformat")
    if not kernel.is_alive():  # the notebook before this one killed it
        kernel.restart_kernel(now=True)
    nb = with_reset(with_smoke_parameters(nbformat.read(path, as_version=4), path))
    start = time.perf_counter()
    execute_in(kernel, nb)
    seconds = time.perf_counter() - start
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.execution_count is not None for c in code), f"{path.name}: a cell did not run"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any("image/png" in o.get("data", {}) for o in outputs), f"{path.name} drew no plot"
    print(f"{path.name}: {seconds:.0f} s")


@pytest.mark.slow
def test_each_notebook_starts_from_an_empty_namespace(kernel):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    first = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("left_behind = 1")])
    execute_in(kernel, first)
    second = with_reset(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("left_behind")]))
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="NameError"):
        execute_in(kernel, second)


def test_plot_helpers_doctests(monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.syspath_prepend(str(NOTEBOOKS_DIR))
    import plots

    failures, tests = doctest.testmod(plots)
    assert tests > 0 and failures == 0
