"""The clustering notebook runs top to bottom and draws its plots; it is
committed executed (jupyter nbconvert --to notebook --execute --inplace)."""

import pathlib

import nbclient
import nbformat

NOTEBOOK = (pathlib.Path(__file__).resolve().parents[1] / 'notebooks'
            / 'routing_as_clustering.ipynb')


def _code_cells(notebook):
  return [cell for cell in notebook.cells if cell.cell_type == 'code']


def _check_outputs(notebook):
  """No error, at least 3 plots, and EM routing equal to a textbook GMM."""
  outputs = [output for cell in _code_cells(notebook)
             for output in cell.outputs]
  assert not [output for output in outputs if output.output_type == 'error']
  images = [output for output in outputs
            if 'image/png' in output.get('data', {})]
  assert len(images) >= 3
  text = ''.join(output.get('text', '') for output in outputs)
  # The last cell compares EM routing with a textbook Gaussian-mixture EM.
  difference = float(text.split('largest difference to routing:')[1].split()[0])
  assert difference < 1e-3


def test_notebook_is_stored_executed():
  """A reader on GitHub sees the plots: every code cell ran, in order."""
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  nbformat.validate(notebook)
  counts = [cell.execution_count for cell in _code_cells(notebook)]
  assert counts == list(range(1, len(counts) + 1)), counts
  _check_outputs(notebook)


def test_notebook_runs_and_plots():
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  # Run from notebooks/, as a user would; the notebook finds the package.
  client = nbclient.NotebookClient(
      notebook, timeout=120, kernel_name='python3',
      resources={'metadata': {'path': str(NOTEBOOK.parent)}})
  client.execute()  # raises CellExecutionError if any cell fails
  _check_outputs(notebook)
