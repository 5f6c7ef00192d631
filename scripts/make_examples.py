"""Write the example notebooks (examples/*.ipynb) from the cells below, so they stay reviewable as code.

Run: .venv/bin/python scripts/make_examples.py
     .venv/bin/python scripts/make_examples.py --copy-to DIR   # copies for this environment's kernel (make demo)
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent.parent / "examples"

QUICKSTART = [
    new_markdown_cell(
        "# jupyter-gpulease quickstart\n\n"
        "The *cell*, not the notebook, holds the GPU. A `%%gpu` cell gets a lease from the broker, runs in a "
        "worker process that sees only the leased GPUs, brings its results back, and gives the GPU back the "
        "moment it ends — so plotting and thinking never hold a GPU.\n\n"
        "With a simulated inventory (the demo) everything works the same, without real GPUs."
    ),
    new_code_cell("%load_ext jupyter_gpulease\n%gpu status"),
    new_markdown_cell("Some data, made in the kernel (no GPU needed for that):"),
    new_code_cell(
        "import numpy as np\n"
        "rng = np.random.default_rng(0)\n"
        "X = rng.normal(size=(4096, 16))\n"
        "true_w = rng.normal(size=16)\n"
        "y = X @ true_w + 0.1 * rng.normal(size=4096)"
    ),
    new_markdown_cell(
        "Train in a `%%gpu` cell: `--in` sends values to the worker, `--out` brings them back. Output streams "
        "live. The model uses PyTorch on the leased GPU when there is one, numpy otherwise."
    ),
    new_code_cell(
        "%%gpu 1 --time 10m --in X,y --out weights,losses\n"
        "import os\n"
        "import numpy as np\n"
        "print('leased devices:', os.environ['CUDA_VISIBLE_DEVICES'])\n"
        "w = np.zeros(X.shape[1])\n"
        "losses = []\n"
        "for step in range(200):\n"
        "    err = X @ w - y\n"
        "    w -= 0.05 * X.T @ err / len(y)\n"
        "    losses.append(float((err ** 2).mean()))\n"
        "    if step % 50 == 0:\n"
        "        print(f'step {step:3d}  loss {losses[-1]:.4f}', flush=True)\n"
        "weights = w\n"
        "np.save(os.path.join(os.environ['GPULEASE_ARTIFACTS'], 'weights.npy'), weights)\n"
        "losses[-1]"
    ),
    new_markdown_cell("Back in the kernel, with no GPU held: plot the loss."),
    new_code_cell(
        "import matplotlib\n"
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(5, 3))\n"
        "ax.semilogy(losses)\n"
        "ax.set_xlabel('step'); ax.set_ylabel('loss')\n"
        "print('max |w - true_w| =', float(np.abs(weights - true_w).max()))\n"
        "%gpu leases"
    ),
    new_markdown_cell("Every lease has an artifact directory: the streamed output, metadata and your files."),
    new_code_cell(
        "%gpu artifacts 3\n"
        "import jupyter_gpulease.artifacts as artifacts\n"
        "latest = artifacts.recent(limit=1)[0]\n"
        "print(latest.files)\n"
        "print(latest.meta['status'], latest.meta['devices'][0]['name'])"
    ),
]

SEARCH = [
    new_markdown_cell(
        "# Hyper-parameter search that grows with the free GPUs\n\n"
        "`jupyter_gpulease.map` holds one incremental lease of 1 to `max_gpus` GPUs: it starts with what is "
        "free, and as the broker grows the lease it runs more trials at once, each in its own worker on its own "
        "GPU. Results come back in order."
    ),
    new_code_cell("%load_ext jupyter_gpulease\nimport jupyter_gpulease\n%gpu status"),
    new_code_cell(
        "import numpy as np\n"
        "rng = np.random.default_rng(1)\n"
        "X = rng.normal(size=(2048, 8)); y = X @ rng.normal(size=8)\n"
        "def trial(lr):\n"
        "    import numpy as np\n"
        "    w = np.zeros(X.shape[1])\n"
        "    for _ in range(100):\n"
        "        w -= lr * X.T @ (X @ w - y) / len(y)\n"
        "    loss = float(((X @ w - y) ** 2).mean())\n"
        "    print(f'lr={lr:g} loss={loss:.4g}')\n"
        "    return loss\n"
        "lrs = [0.001, 0.003, 0.01, 0.03, 0.1, 0.3]\n"
        "losses = jupyter_gpulease.map(trial, lrs, gpus_per_call=1, max_gpus=4)\n"
        "best = lrs[int(np.argmin(losses))]\n"
        "print('best lr:', best)"
    ),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "fig, ax = plt.subplots(figsize=(5, 3))\n"
        "ax.loglog(lrs, losses, 'o-'); ax.set_xlabel('learning rate'); ax.set_ylabel('final loss')"
    ),
]

SESSIONS = [
    new_markdown_cell(
        "# A warm session across cells\n\n"
        "`%%gpu --session NAME` keeps one leased worker across cells, so a model stays loaded on the GPU. "
        "When the session has been idle for its idle timeout (or sooner while others wait for GPUs), the broker "
        "ends its lease (with a warning first) and the session is *parked*: its variables go to host memory, "
        "the GPU to whoever waits, and the session's next cell gets a GPU and its variables back. "
        "`%gpu session park NAME` does that now; `%gpu session stop NAME` ends the session."
    ),
    new_code_cell("%load_ext jupyter_gpulease"),
    new_code_cell(
        "%%gpu --session model --idle 5m\n"
        "import os, numpy as np\n"
        "model = np.random.default_rng(0).normal(size=(256, 256))  # stands in for weights on the GPU\n"
        "print('loaded in worker', os.getpid())"
    ),
    new_code_cell(
        "%%gpu --session model --out score\n"
        "score = float(np.linalg.norm(model @ np.ones(256)))\n"
        "print('same worker', os.getpid(), 'score', round(score, 2))"
    ),
    new_code_cell("print('score in the kernel:', round(score, 2))\n%gpu sessions"),
    new_code_cell("%gpu session park model\n%gpu sessions"),
    new_code_cell(
        "%%gpu --session model\n"
        "print('new worker', os.getpid(), 'same model', model.shape)"
    ),
    new_code_cell("%gpu session stop model"),
]


KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def main() -> None:
    HERE.mkdir(exist_ok=True)
    for name, cells in (("quickstart", QUICKSTART), ("hyperparameter_search", SEARCH), ("sessions", SESSIONS)):
        nb = new_notebook(cells=cells, metadata={"kernelspec": dict(KERNELSPEC)})
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")


def copy_for_this_kernel(dest: Path) -> list[Path]:
    """Copy the examples into ``dest`` (a copy already there is kept: it may hold the user's work) with the metadata
    of the kernel they will run on here: the kernelspec's display name and the kernel's ``language_info``
    (the Python version). JupyterLab writes those into a notebook when its kernel starts and marks it modified
    if they differ, so a plain copy would open already modified."""
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager

    spec = KernelSpecManager().get_kernel_spec(KERNELSPEC["name"])
    dest.mkdir(parents=True, exist_ok=True)
    written = []
    for source in sorted(HERE.glob("*.ipynb")):
        target = dest / source.name
        if target.exists():
            continue
        nb = nbformat.read(source, as_version=4)
        nb.metadata["kernelspec"] = {"name": KERNELSPEC["name"], "display_name": spec.display_name,
                                     "language": spec.language}
        nb.metadata["language_info"] = dict(IPythonKernel.language_info)
        nbformat.write(nb, target)
        written.append(target)
    return written


if __name__ == "__main__":
    if sys.argv[1:2] == ["--copy-to"] and len(sys.argv) == 3:
        copy_for_this_kernel(Path(sys.argv[2]))
    elif len(sys.argv) > 1:
        sys.exit("usage: make_examples.py [--copy-to DIR]")
    else:
        main()
