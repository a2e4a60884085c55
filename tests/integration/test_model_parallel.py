"""The model-parallel example: three stages on process sets agree with one process.

``hora run -np 6 python examples/pytorch_model_parallel.py`` trains a model split into three
stages (ranks 0-1, 2-3, 4-5), each data-parallel inside its set, activations and their
gradients passed between stages. One process running the whole model on the whole batch, from
the same initial weights and on the same data, must end with the same parameters and losses.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "pytorch_model_parallel.py"
HORA = [sys.executable, "-c", "import sys; from hora.launch.cli import main; sys.exit(main())"]


def _example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pytorch_model_parallel", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _whole_model(mod: ModuleType, argv: list[str]) -> tuple[list[dict], list[float]]:
    """Train the three stages as one model in this process, on whole batches."""
    args = mod.parse_args(argv)
    stages = mod.build_stages(args)
    model = torch.nn.Sequential(*stages)
    x, y = mod.make_data(args)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    losses = []
    for epoch in range(1, args.epochs + 1):
        total, steps = 0.0, mod.batches(args, epoch)
        for index in steps:
            opt.zero_grad()
            loss = F.cross_entropy(model(x[index]), y[index])
            loss.backward()
            opt.step()
            total += float(loss.detach())
        losses.append(total / len(steps))
    return [s.state_dict() for s in stages], losses


@pytest.mark.timeout(300)
def test_three_stages_on_process_sets_match_one_process(tmp_path: Path) -> None:
    argv = ["--epochs", "2", "--samples", "256", "--batch-size", "32"]
    cmd = [
        *HORA,
        "run",
        "-np",
        "6",
        sys.executable,
        str(SCRIPT),
        *argv,
        "--save-dir",
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "[4]<stdout>:Epoch 2: mean loss" in done.stdout
    mod = _example()
    want_params, want_losses = _whole_model(mod, argv)
    initial = [s.state_dict() for s in mod.build_stages(mod.parse_args(argv))]
    for stage, want in enumerate(want_params):
        got = torch.load(tmp_path / f"stage{stage}.pt")
        assert got.keys() == want.keys()
        for key in want:
            assert not torch.equal(got[key], initial[stage][key]), "the stage did not train"
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-5)
    got_losses = torch.load(tmp_path / "losses.pt").tolist()
    assert got_losses == pytest.approx(want_losses, rel=1e-4)


def test_help_names_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=60
    ).stdout
    for flag in ("--epochs", "--batch-size", "--save-dir"):
        assert flag in out
