"""The Colab quickstart runs top to bottom on CPU, offline, with the shipped model (as CI executes it)."""

from pathlib import Path

import pytest


nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOK = Path(__file__).parents[1] / "notebooks" / "qerl_grpo_quickstart.ipynb"


@pytest.mark.slow
def test_quickstart_notebook_runs_top_to_bottom(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=900, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})  # fmt: skip
    client.execute()
    text = "\n".join(
        output.get("text", "") + str(output.get("data", {}).get("text/plain", ""))
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
    )
    assert "NVFP4 layers" in text and "sigma per stage" in text
    assert "EvaluationResult" in text or "accuracy" in text
    assert "skipping push_to_hub()" in text
    assert (tmp_path / "qerl-quickstart" / "metrics.png").stat().st_size > 0
    assert (tmp_path / "qerl-quickstart" / "adapter" / "adapter_model.safetensors").exists()
    assert any(
        output.get("data", {}).get("image/png") for cell in notebook.cells for output in cell.get("outputs", [])
    )
